"""Prometheus metrics, names in the `xlaserve:` namespace mirroring vLLM's `vllm:` ones.

Request-level series are observed by the serving core as outputs stream out; engine-level series
(queue lengths, KV usage, prefix cache, preemptions) are read from `engine.stats()` at scrape time
by a collector, so they are never stale and cost nothing between scrapes. Each server owns its own
CollectorRegistry (no process-global state; tests run several servers in one process).

    xlaserve:time_to_first_token_seconds        histogram  arrival -> first token
    xlaserve:inter_token_latency_seconds        histogram  every gap between tokens of a sequence
    xlaserve:request_time_per_output_token_seconds  histogram  per request: (e2e - ttft) / (tokens - 1)
    xlaserve:e2e_request_latency_seconds        histogram  arrival -> last token
    xlaserve:request_prompt_tokens              histogram
    xlaserve:request_generation_tokens          histogram
    xlaserve:prompt_tokens_total                counter
    xlaserve:generation_tokens_total            counter
    xlaserve:request_success_total{finished_reason}   counter  stop | length | abort
    xlaserve:request_failure_total{reason}      counter  invalid | rejected | unavailable | deadline | error | ...
    xlaserve:num_requests_running               gauge
    xlaserve:num_requests_waiting               gauge
    xlaserve:kv_cache_usage_perc                gauge    0..1, pages referenced by live sequences
    xlaserve:prefix_cache_queries_total         counter  prompt tokens looked up (once a prompt)
    xlaserve:prefix_cache_hits_total            counter  prompt tokens found (the cached_tokens)
    xlaserve:num_preemptions_total              counter
    xlaserve:engine_steps_total                 counter
    xlaserve:compiles_after_warmup_total        counter  should stay 0
Every series carries a `model_name` label. The per-request TPOT is named as vLLM names it since it
deprecated `vllm:time_per_output_token_seconds`, which it now reports per token, as the inter-token
latency.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector:
    def __init__(self, model_name: str, stats: Callable[[], object]) -> None:
        self._model, self._stats = model_name, stats

    def collect(self):
        s = self._stats()
        if s is None:
            return
        lab = ["model_name"]
        v = [self._model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"xlaserve:{name}", doc, labels=lab)
            g.add_metric(v, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"xlaserve:{name}", doc, labels=lab)
            c.add_metric(v, float(value))
            return c

        yield gauge("num_requests_running", "Sequences holding a slot (prefilling or decoding).", s.num_running)
        yield gauge("num_requests_waiting", "Sequences queued in the scheduler.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV pages referenced by live sequences (1 = full).",
                    s.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hit_tokens)
        yield counter("num_preemptions", "Sequences preempted (pages released, recomputed later).",
                      s.num_preemptions)
        yield counter("engine_steps", "Steps dispatched to the device.", s.num_steps)
        yield counter("compiles_after_warmup", "XLA compilations after warmup (should stay 0).",
                      s.num_compiles_after_warmup)


class ServingMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], object] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("xlaserve:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("xlaserve:inter_token_latency_seconds", "Time between consecutive tokens.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("xlaserve:request_time_per_output_token_seconds",
                              "Per request: mean time per output token after the first.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("xlaserve:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.req_prompt_tokens = Histogram("xlaserve:request_prompt_tokens", "Prompt tokens per request.", lab,
                                           buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.req_generation_tokens = Histogram("xlaserve:request_generation_tokens",
                                               "Generated tokens per request (all n sequences).", lab,
                                               buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("xlaserve:prompt_tokens", "Prompt tokens of accepted requests.", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("xlaserve:generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        self._success = Counter("xlaserve:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._failure = Counter("xlaserve:request_failure", "Requests answered with an error, by reason.",
                                ["model_name", "reason"], registry=r)
        if engine_stats is not None:
            r.register(_EngineCollector(model_name, engine_stats))

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def request_failed(self, reason: str) -> None:
        self._failure.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
