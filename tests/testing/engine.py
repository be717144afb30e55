"""Engine test helpers shared by the engine tests (CPU and GPU): a small config, a random model that
needs no checkpoint, running requests alone or arriving at random steps, the idle-engine checks,
and a spy on the programs the executor runs."""

from __future__ import annotations

import jax
import numpy as np

from runtime.request import SamplingParams
from sharding.mesh import MeshConfig

# Near-ties: a request's logits differ by float reassociation between batch compositions (other token
# counts change matmul blocking), so where the reference's top-2 logits are closer than GAP the argmax
# may legitimately flip. Logit differences across batch compositions stay ~1e-5 on stories260K (logits
# have std ~8).
GAP = 1e-3

# stories260K prompts (tests/runtime/conftest.py's `llm`)
STORY_PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park", "One day"]

BASE = dict(
    max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64), seq_buckets=(2, 8), max_model_len=256,
    strict_compile=True, progress=False, dtype="float32",
)


def scaled_dummy(scale: float = 25.0, *, mesh=None, seed: int | None = None):
    """A tiny random untied model that needs no checkpoint. Weights at init_dummy's 0.02 std give
    near-uniform logits (every step a near-tie); scaled up they give diverse tokens with top-2 gaps
    around 1 (none under 1e-3 in 120 sampled steps). `mesh` defaults to one device, `seed` to a
    random one; a seed gives the same weights on every mesh."""
    import dataclasses

    from flax import nnx

    from models.config import ModelConfig
    from runtime.checkpoint import init_dummy

    cfg = ModelConfig("tiny", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=256)
    seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
    m = init_dummy(cfg, mesh=MeshConfig().make_mesh() if mesh is None else mesh, dtype="float32", seed=seed)
    flat = nnx.to_flat_state(m.params)
    params = nnx.from_flat_state(
        {tuple(p): v.replace(v[...] if p[-1] == "scale" else v[...] * scale) for p, v in flat}
    )
    return dataclasses.replace(m, params=params)


def spy_programs(monkeypatch, executor) -> list:
    """The keys of the programs the executor runs from now on, in order."""
    used = []
    executable = executor._executable
    monkeypatch.setattr(executor, "_executable", lambda key: used.append(key) or executable(key))
    return used


def greedy_requests(prefix: str, n: int = 12) -> list:
    """n greedy requests of random prompts (2-29 ids under 256) and lengths (5-39 tokens, EOS ignored)."""
    rng = np.random.default_rng()
    return [(f"{prefix}{i}", rng.integers(0, 256, int(rng.integers(2, 30))).tolist(),
             SamplingParams(temperature=0.0, max_tokens=int(rng.integers(5, 40)), ignore_eos=True))
            for i in range(n)]


def run_one(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final = o
    assert final is not None and final.request_id == rid
    return final


def run_workload(engine, workload, seed=None):
    """Submit requests a random number per step (0-3) while the engine runs; final outputs by id."""
    rng = np.random.default_rng(seed)
    pending, results = list(workload), {}
    while pending or engine.has_unfinished():
        for _ in range(min(int(rng.integers(0, 4)), len(pending))):
            rid, prompt, params = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid)
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o
    check_idle(engine)
    return results


def check_idle(engine):
    engine.check_invariants()
    s = engine.stats()
    assert s.num_running == s.num_waiting == 0
    assert s.num_free_pages + s.num_cached_pages == s.num_total_pages
    assert s.num_compiles_after_warmup == 0


def first_near_tie(completion) -> int:
    """Index of the first token whose top-2 logprobs (asked for in the reference run) are within GAP;
    the completion's length when there is none."""
    for j, d in enumerate(completion.logprobs):
        top = sorted(d.values(), reverse=True)
        if top[0] - top[1] < GAP:
            return j
    return len(completion.token_ids)


class _Poisoned:
    """A step's tokens that the device failed to compute: reading them raises."""

    def copy_to_host_async(self):
        pass

    def __array__(self, *args, **kwargs):
        raise RuntimeError("injected: the device failed the step")


class FailingExecutor:
    """An engine's StepExecutor (`real`), failing every step while `failing` (or only the first
    `times`): `how` "raise" raises `error` before anything runs; "pool consumed" and "page table
    consumed" raise after deleting those buffers, as a program that failed after they were donated
    into it; "tokens unreadable" runs the step and returns tokens whose read raises (the error comes
    when the host waits for them)."""

    def __init__(self, real, how, times=None, error=None):
        self.real, self.how, self.failing, self.calls, self.times = real, how, True, 0, times
        self.error = error

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, params, kv_pages, batch, prev, prev_burst):
        if not self.failing or self.calls == self.times:  # (times: only the first so many steps fail)
            return self.real(params, kv_pages, batch, prev, prev_burst)
        self.calls += 1
        if self.how == "raise":
            raise self.error
        if self.how == "page table consumed":
            self.real.page_table.delete()
            raise RuntimeError("injected: the page table update failed after taking the table")
        if self.how == "pool consumed" or isinstance(prev, _Poisoned):
            for a in jax.tree.leaves(kv_pages):
                a.delete()
            raise RuntimeError("injected: the program failed after taking the KV pool")
        tokens, last, logprobs, kv_pages = self.real(params, kv_pages, batch, prev, prev_burst)
        return _Poisoned(), last, logprobs, kv_pages
