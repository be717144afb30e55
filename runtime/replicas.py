"""Replica parallelism: one engine per index of the mesh's `replica` axis, behind one engine's API.

A mesh of R replicas x T tensor devices runs R independent engines, each on its T devices with its
own scheduler, KV pool and compiled programs, sharing the loaded weights (LoadedModel.replica_views:
no copy). A request runs on one replica from start to end (its n samples too: they share its
prompt's pages). A new request goes to the replica whose prefix cache holds the most of its prompt
(multi-turn chats return to the replica that has their history), unless that replica has
max_num_seqs more live sequences (n a request) than the least loaded one; with no cached prefix
anywhere, to the replica with the fewest live sequences, the earlier one on a tie. `step()` steps
every replica that has work, one after another: each engine's step returns once its next step is
dispatched (runtime/engine.py, lookahead), so every replica's device computes while the host serves
the others.

Why not one SPMD program with the batch split over `replica`: the Pallas kernels are custom calls
that XLA's partitioner cannot split, the KV pool and page tables would need a replica axis the
scheduler packs for, and a replica with nothing to do would still run every step in lockstep with
the others. Separate engines need none of that, and a replica's steps size to its own batch.

EngineConfig's limits (max_num_seqs, max_num_batched_tokens, num_pages) are per replica: R replicas
hold R times the sequences and pages of one. Requests whose seed is unset draw it from a generator
per replica, each seeded from EngineConfig.seed and the replica's index.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from runtime.checkpoint import LoadedModel
from runtime.config import EngineConfig
from runtime.engine import Engine, EngineStats
from runtime.llm import RequestOutput
from runtime.request import SamplingParams, check_priority, new_request_id, validate_cache_salt
from sharding.mesh import MeshConfig


def make_engine(model: LoadedModel, config: EngineConfig | None = None, *, tokenizer=None,
                eos_token_ids: Sequence[int] | None = None) -> Engine | ReplicatedEngine:
    """The engine for `model`'s mesh: an Engine on one replica, a ReplicatedEngine on several.
    The config's mesh is the model's: left unset (MeshConfig()) it becomes it, and one that differs
    is a ValueError (the model was loaded on another mesh)."""
    config = config or EngineConfig()
    mesh = MeshConfig.of(model.mesh)
    if config.mesh != mesh:
        if config.mesh != MeshConfig():
            raise ValueError(f"EngineConfig.mesh is {config.mesh}, but the model was loaded on a mesh of {mesh}: load "
                             "it on EngineConfig.mesh.make_mesh(), or leave the engine's mesh unset")
        config = dataclasses.replace(config, mesh=mesh)
    if mesh.replica == 1:
        return Engine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids)
    return ReplicatedEngine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids)


class ReplicatedEngine:
    """R Engines, one per replica of `model`'s mesh, driven as one: the Engine API that LLM and the
    async engine use (add_request, abort, step, stats, ...)."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, tokenizer=None,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        config = config or EngineConfig()
        views = model.replica_views()
        self.model = model
        seeds = np.random.SeedSequence(config.seed).generate_state(len(views), np.uint32)
        self.replicas = [Engine(view, dataclasses.replace(config, seed=int(seed)), tokenizer=tokenizer,
                                eos_token_ids=eos_token_ids) for view, seed in zip(views, seeds)]
        # resolved (num_pages: each replica's), with the seed it was given (each replica draws from its own)
        self.config = dataclasses.replace(self.replicas[0].config, seed=config.seed)
        self.tokenizer = self.replicas[0].tokenizer  # (sized to the model's vocabulary)
        self.eos_ids = self.replicas[0].eos_ids
        self._where: dict[str, Engine] = {}  # live request id -> its replica
        self._held: list[RequestOutput] = []  # outputs of a step call a later replica's exception ended
        self._ids = itertools.count()

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # -- lifecycle ------------------------------------------------------------------------------
    def warmup(self) -> None:
        for e in self.replicas:
            e.warmup()

    def close(self) -> None:
        for e in self.replicas:
            e.close()

    # -- requests in ----------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    prompt_text: str | None = None) -> str:
        """Engine.add_request on the replica `_route` picks (the prompt is tokenized and checked once,
        here: the route reads its ids and salt)."""
        params = params or SamplingParams()
        request_id = self._new_id(request_id)
        check_priority(priority)
        validate_cache_salt(cache_salt)
        text, prompt_ids = self.prepare_prompt(prompt)
        self.validate(prompt_ids, params, request_id=request_id)
        return self.enqueue_checked(prompt_ids, params, request_id=request_id, priority=priority,
                                    cache_salt=cache_salt, prompt_text=text if text is not None else prompt_text)

    def enqueue_checked(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                        **kwargs) -> str:
        """Engine.enqueue_checked on the replica `_route` picks."""
        request_id = self._new_id(request_id)
        engine = self._route(prompt_ids, kwargs.get("cache_salt"))
        engine.enqueue_checked(prompt_ids, params, request_id=request_id, **kwargs)
        self._where[request_id] = engine
        return request_id

    def prepare_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        return self.replicas[0].prepare_prompt(prompt)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str = "") -> None:
        """Engine.validate (the replicas share their configuration): safe from any thread."""
        self.replicas[0].validate(prompt_ids, params, request_id=request_id)

    def abort(self, request_id: str) -> bool:
        """Engine.abort: the id is free for a new request at once, as on one Engine."""
        engine = self._where.get(request_id)
        if engine is None or not engine.abort(request_id):
            return False
        del self._where[request_id]
        return True

    def waiting(self) -> tuple[int, int]:
        """(requests, prompt tokens) queued and not yet admitted, over every replica."""
        counts = [e.waiting() for e in self.replicas]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = new_request_id("req-", self._ids, self._where)
        elif request_id in self._where:
            raise ValueError(f"request id {request_id!r} is already live")
        return request_id

    def _route(self, prompt_ids: Sequence[int], cache_salt: str | None) -> Engine:
        loads = [e.num_live_sequences() for e in self.replicas]  # (requests of n = 4 and 1 weigh apart)
        limit = min(loads) + self.config.max_num_seqs
        cached = [e.cached_prefix_tokens(prompt_ids, cache_salt) if load < limit else 0
                  for e, load in zip(self.replicas, loads)]
        # the longest cached prefix; among equals (none cached included), the fewest live sequences
        best = max(range(len(self.replicas)), key=lambda i: (cached[i], -loads[i], -i))
        return self.replicas[best]

    # -- the step -------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._held) or any(e.has_unfinished() for e in self.replicas)

    def step(self, *, partial: bool = True) -> list[RequestOutput]:
        """One step of every replica that has work (Engine.step); their outputs together. An
        exception from a replica's step keeps the outputs the replicas before it gave for the next
        call, which carries on as Engine.step does: after an interrupt (Ctrl-C while it waits for
        the device) with the same requests; after an Exception without that replica's, which it dropped."""
        outputs, self._held = self._held, []
        try:
            for e in self.replicas:
                if e.has_unfinished():
                    outs = e.step(partial=partial)
                    for out in outs:  # (an aborted request's id may already name a new one)
                        if out.finished and self._where.get(out.request_id) is e and not e.is_live(out.request_id):
                            del self._where[out.request_id]
                    outputs.extend(outs)
        except BaseException:
            self._held = outputs
            self._where = {rid: e for rid, e in self._where.items() if e.is_live(rid)}
            raise
        return outputs

    def take_dropped(self) -> list[str]:
        """Engine.take_dropped over the replicas."""
        return [rid for e in self.replicas for rid in e.take_dropped()]

    # -- stats and checks -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The replicas' statistics summed; kv_usage is the share of all their pages in use."""
        parts = [e.stats() for e in self.replicas]
        total = {f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(EngineStats)}
        pages = total["num_total_pages"]
        total["kv_usage"] = sum(p.kv_usage * p.num_total_pages for p in parts) / pages if pages else 0.0
        return EngineStats(**total)

    def check_invariants(self) -> None:
        for e in self.replicas:
            e.check_invariants()
        if not self.has_unfinished():
            assert not self._where, f"{len(self._where)} request ids still mapped to a replica"
        if not self._held:
            stale = [rid for rid, e in self._where.items() if not e.is_live(rid)]
            assert not stale, f"request ids {stale} mapped to a replica that does not hold them"
