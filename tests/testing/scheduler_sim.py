"""A simulated device for scheduler tests.

FakeDevice plays the model: it writes each scheduled token (and its position) into the pages of
its sequence, then "attends" by reading positions [0, kv_len) back through the page list, and
samples a token that is a hash of everything it read. So a wrong page table, a prefix-cache hit on
the wrong page, or a shared page overwritten by a neighbour changes the outputs, and comparing with
a request generated alone (reference_generate) catches it. Harness drives a Scheduler with it.
"""

from __future__ import annotations

from runtime.request import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig

VOCAB = 64
EOS = 0



def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB


def reference_generate(prompt, params: SamplingParams, eos=(EOS,), max_model_len=None):
    """Greedy generation of one request alone, with the stop rules spelled out independently."""
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(prompt)
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens:
            if t in eos and not params.ignore_eos:
                return out, "stop"
            if t in params.stop_token_ids:
                return out, "stop"
        if len(out) >= max_tokens:
            return out, "length"


class FakeDevice:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        cfg = sched.config
        self.G = cfg.page_size
        self.kv = [[None] * cfg.page_size for _ in range(cfg.num_pages)]
        self.refcounts = {}
        self.sampled = {}  # (request id, index in its token_ids) -> the token sampled there

    def known(self, req, n: int) -> list[int]:
        """req's first n tokens, placeholders replaced by what this device sampled there (a
        burst's placeholders all name its last row; the ones before are never fed again)."""
        return [t if t >= 0 else self.sampled[req.request_id, i] for i, t in enumerate(req.token_ids[:n])]

    def planned(self, plan) -> None:
        """Call right after step(): pages written by a plan must be held by their sequence only
        at that point (a fork made before the step runs may share them; it reads them later)."""
        self.refcounts = {p: self.sched.allocator.refcount(p) for s in plan.seqs for p in s.pages}

    def run(self, plan, prev: list | None = None) -> list:
        """Run a plan. `prev`: the previous step's output, which placeholder tokens (-(row + 1), a
        plan made before that step was resolved) are read from, as the engine's step does (from
        its last model step's tokens when it was a burst). A burst (plan.num_steps K > 1) runs K
        model steps, each feeding a sequence the token it sampled in the one before, and returns
        [K][num_seqs] tokens."""
        G, cfg, K = self.G, self.sched.config, plan.num_steps
        if prev is not None and isinstance(prev[0], list):
            prev = prev[-1]

        def real(t):
            return t if t >= 0 else prev[-t - 1]

        assert plan.num_tokens <= cfg.max_num_batched_tokens * K
        assert plan.num_seqs <= cfg.max_num_seqs
        assert len({s.slot for s in plan.seqs}) == plan.num_seqs
        assert len({s.request_id for s in plan.seqs}) == plan.num_seqs
        flags = [s.is_prefill for s in plan.seqs]
        assert flags == sorted(flags), "decodes must come before prefill chunks"
        assert plan.num_decode_tokens == K * sum(s.q_len for s in plan.seqs if not s.is_prefill)
        if K > 1:
            return self._run_burst(plan, real)
        # Like the model: every layer writes all new K/V before any sequence attends.
        for s in plan.seqs:
            assert s.q_len >= 1 and s.num_computed_after == s.start_pos + s.q_len
            assert len(s.pages) == -(-s.num_computed_after // G) <= cfg.max_pages_per_seq
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                page = s.pages[pos // G]
                assert self.refcounts[page] == 1, f"write into shared page {page}"
                self.kv[page][pos % G] = (real(t), pos)
        out = []
        for s in plan.seqs:
            read = [self.kv[s.pages[p // G]][p % G] for p in range(s.kv_len)]
            assert all(r is not None and r[1] == p for p, r in enumerate(read)), f"{s.request_id}: bad KV"
            context = [r[0] for r in read]
            req = self.sched.get_request(s.request_id)
            assert context == self.known(req, s.kv_len), f"{s.request_id}: KV holds other tokens"
            assert s.sample == (s.kv_len == req.num_tokens)
            out.append(next_token(context) if s.sample else -1)
            self.sampled[s.request_id, s.kv_len] = out[-1]
        return out

    def _run_burst(self, plan, real) -> list[list[int]]:
        G, K = self.G, plan.num_steps
        capacity = self.sched.config.max_pages_per_seq * G  # positions stop at the table's end, as on the device
        for s in plan.seqs:
            assert not s.is_prefill and s.q_len == 1 and s.sample
            assert s.num_computed_after == s.start_pos + K
            assert len(s.pages) == -(-min(s.num_computed_after, capacity) // G)
        fed = [real(s.token_ids[0]) for s in plan.seqs]
        outs = []
        for j in range(K):
            for s, t in zip(plan.seqs, fed):
                pos = min(s.start_pos + j, capacity - 1)
                page = s.pages[pos // G]
                assert self.refcounts[page] == 1, f"write into shared page {page}"
                self.kv[page][pos % G] = (t, pos)
            out = []
            for row, s in enumerate(plan.seqs):
                n = s.start_pos + j + 1
                if n > capacity:  # past max_tokens (the scheduler drops its tokens): nothing to check
                    out.append(-1)
                    continue
                read = [self.kv[s.pages[p // G]][p % G] for p in range(n)]
                assert all(r is not None and r[1] == p for p, r in enumerate(read)), f"{s.request_id}: bad KV"
                req = self.sched.get_request(s.request_id)
                known = self.known(req, s.start_pos + 1) + [o[row] for o in outs]
                assert [r[0] for r in read] == known, f"{s.request_id}: KV holds other tokens"
                out.append(next_token(known))
                self.sampled[s.request_id, n] = out[-1]
            outs.append(out)
            fed = out
        return outs


class Harness:
    def __init__(self, **cfg):
        cfg.setdefault("max_model_len", 256)
        self.sched = Scheduler(SchedulerConfig(**cfg))
        self.dev = FakeDevice(self.sched)
        self.reqs = {}
        self.plans = []

    def add(self, rid, prompt, params=None, **kw):
        params = params or SamplingParams(max_tokens=8)
        self.reqs[rid] = self.sched.add_request(rid, prompt, params, eos_token_ids=[EOS], **kw)
        return self.reqs[rid]

    def step(self):
        plan = self.sched.step()
        self.dev.planned(plan)
        self.plans.append(plan)
        if not plan.is_empty:
            self.sched.update_from_output(plan, self.dev.run(plan))
        self.sched.check_invariants()
        return plan

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"requests still live after {max_steps} steps")

    def check_all_exact(self):
        for rid, r in self.reqs.items():
            want = reference_generate(r.prompt_token_ids, r.sampling_params, max_model_len=self.sched.config.max_model_len)
            assert (r.output_token_ids, r.finish_reason) == want, rid

    def check_drained(self):
        a = self.sched.allocator
        assert a.num_referenced == 0 and a.num_free + a.num_cached == a.num_pages
        assert self.sched.num_running == self.sched.num_waiting == 0


def rand_prompt(rng, n):
    return [rng.randrange(1, VOCAB) for _ in range(n)]
