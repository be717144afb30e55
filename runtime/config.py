"""EngineConfig: every engine setting, read once, frozen. Derived values are cached properties.

Fields that depend on the model (max_model_len, num_pages) may be left None here; the engine
resolves them against the loaded model with `resolve(...)`, which returns a config with every
field set. Bucket tables are part of the config because they decide what XLA compiles: the step
function exists only for (token bucket, seq bucket) pairs in these tables (runtime/compilation.py).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from sharding.mesh import MeshConfig

# The engine's paged attention takes float32 and bfloat16 (auto: float16 checkpoints load as bfloat16).
_DTYPES = ("auto", "float32", "bfloat16")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """1 (a single decode: batch-1 latency, one program with the seq bucket 1), then powers of two
    from `smallest` (or the budget, when smaller), ending at the budget itself. On an H200 a batch-1
    decode step of llama3_8b took 4.31 ms in a bucket of 1 token, 4.61 ms in one of 16."""
    out, b = [], min(smallest, max_num_batched_tokens)
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    return tuple(sorted({1, *out, max_num_batched_tokens}))


def default_seq_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of four from 1, ending at max_num_seqs: a decode at batch 1 gets its own program
    (sampling over [1, V] rather than [S, V]) while the table stays small (compile time)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 4
    return tuple(out + [max_num_seqs])


def _check_table(name: str, table: tuple[int, ...], must_cover: int, cover_name: str) -> None:
    if not table or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in table):
        raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {table!r}")
    if list(table) != sorted(set(table)):
        raise ValueError(f"{name} must be strictly increasing, got {table!r}")
    if table[-1] < must_cover:
        raise ValueError(f"{name} ends at {table[-1]}; it must reach {cover_name} ({must_cover})")


def _check_int(config, name: str, *, minimum: int, optional: bool) -> None:
    """config.<name> must be an int (not a bool) of at least `minimum`, or None where optional."""
    v = getattr(config, name)
    if optional and v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {'None or ' if optional else ''}{what}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # S: sequences that run in one step (slots)
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    page_size: int = 16  # G: tokens per KV page
    num_pages: int | None = None  # P: pages in the pool; None derives it (see Engine)
    kv_memory_fraction: float = 0.9  # with num_pages None on an accelerator: share of free memory
    max_model_len: int | None = None  # prompt + output of one sequence; None: the model's maximum
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark: float = 0.01  # fraction of the pool kept free when admitting
    # K > 1: when nothing waits and every running request just decodes, a step samples K tokens
    # per sequence in one device program (a burst; runtime/scheduler.py), paying the host's
    # per-step work once per K tokens. A request arriving meanwhile waits up to K model steps.
    decode_steps: int = 1
    token_buckets: tuple[int, ...] | None = None  # T values compiled; None: default_token_buckets
    seq_buckets: tuple[int, ...] | None = None  # S values compiled; None: default_seq_buckets
    # On NVIDIA GPUs: step programs whose token bucket T is at least this compile their matmuls with
    # cuBLAS instead of XLA's Triton GEMM emitter (XLA option xla_gpu_enable_triton_gemm=False);
    # None: every program keeps XLA's choice. See docs/benchmarks.md ("sixteenth session").
    gpu_cublas_min_tokens: int | None = 64
    # Burst programs (decode_steps > 1) of seq buckets of at most this many sequences run their K
    # model steps as straight-line code instead of a loop: the loop's own kernels and launch gaps go,
    # and what depends only on the step index (the RoPE tables) is computed once for all K. On
    # H200s, llama3_2_1b's batch-1 bursts took ~7-25 us less per model step (+0.6-2.8%; on an H100
    # no change), for ~1.5 s more XLA compile time per burst program; at 64 sequences unrolled
    # bursts ran 3-5% slower. 0: every burst loops; None: 1 on GPUs, 0 elsewhere (unmeasured
    # there). See docs/benchmarks.md ("thirty-fourth session").
    unroll_burst_max_seqs: int | None = None
    max_logprobs: int = 20  # top-n logprobs a request may ask for; fixed output width of the step
    max_stop_token_ids: int = 16  # EOS + stop token ids banned while below min_tokens (fixed width)
    dtype: str = "auto"  # weights and compute: auto (the checkpoint's; float16 as bfloat16), float32, bfloat16
    kv_dtype: str | None = None  # KV pages; None: the compute dtype (f32 for 16-bit models on CPUs: kv_pool_dtype)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    seed: int = 0  # seeds of requests that bring none are drawn from this
    strict_compile: bool = False  # a compile after warmup raises (tests) instead of logging an alert
    warmup: bool = True  # compile every bucket at start-up
    # With warmup: also run each compiled step program once on an all-padding batch (it computes nothing
    # into the KV pool or the page table), so that a program's one-time first-run costs (on a GPU: its
    # kernels loaded, its command buffer built, tens of ms) are not paid by the first request that needs
    # it. None: on GPUs only.
    warmup_runs: bool | None = None
    progress: bool = True  # tqdm progress bars (warmup, LLM.generate)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "decode_steps"):
            _check_int(self, name, minimum=1, optional=False)
        for name in ("num_pages", "max_model_len", "gpu_cublas_min_tokens"):
            _check_int(self, name, minimum=1, optional=True)
        _check_int(self, "unroll_burst_max_seqs", minimum=0, optional=True)
        _check_int(self, "seed", minimum=0, optional=False)
        if self.seed >= 2**63:  # (numpy's and JAX's generators take it as a signed 64-bit int)
            raise ValueError(f"seed must be < 2**63, got {self.seed}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        # (a YAML "false" or "no" is a string, and truthy: it would have meant True)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "strict_compile", "warmup", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.warmup_runs is not None and not isinstance(self.warmup_runs, bool):
            raise ValueError(f"warmup_runs must be None, True or False, got {self.warmup_runs!r}")
        for name in ("kv_memory_fraction", "watermark"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        for name in ("max_logprobs", "max_stop_token_ids"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
        if self.kv_dtype is not None and self.kv_dtype not in _DTYPES[1:]:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not supported; use one of {', '.join(_DTYPES[1:])}")
        if not isinstance(self.mesh, MeshConfig):
            raise ValueError(f"mesh must be a MeshConfig, got {type(self.mesh).__name__}")
        if self.mesh.context != 1:
            raise ValueError(f"the engine does not run context parallelism yet; mesh.context is {self.mesh.context}")
        for name in ("token_buckets", "seq_buckets"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))
        _check_table("token_buckets", self.token_bucket_table, self.max_num_batched_tokens, "max_num_batched_tokens")
        _check_table("seq_buckets", self.seq_bucket_table, self.max_num_seqs, "max_num_seqs")
        if self.max_model_len is not None and self.num_pages is not None:
            need = _cdiv(self.max_model_len, self.page_size)
            if self.num_pages < need:
                raise ValueError(
                    f"num_pages {self.num_pages} cannot hold one sequence of max_model_len {self.max_model_len} "
                    f"({need} pages of {self.page_size})"
                )

    @cached_property
    def token_bucket_table(self) -> tuple[int, ...]:
        return self.token_buckets or default_token_buckets(self.max_num_batched_tokens)

    @cached_property
    def seq_bucket_table(self) -> tuple[int, ...]:
        return self.seq_buckets or default_seq_buckets(self.max_num_seqs)

    @cached_property
    def max_pages_per_seq(self) -> int:
        """P_max: width of each sequence's page table (needs max_model_len resolved)."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet; call resolve() with the model")
        return _cdiv(self.max_model_len, self.page_size)

    def resolve(self, *, max_position_embeddings: int, num_pages: int | None = None) -> EngineConfig:
        """This config with max_model_len and num_pages set (num_pages: the engine's estimate, used
        only when the field is None)."""
        L = self.max_model_len or max_position_embeddings
        if L > max_position_embeddings:
            raise ValueError(f"max_model_len {L} exceeds the model's max_position_embeddings {max_position_embeddings}")
        P = self.num_pages or num_pages
        if P is None:
            raise ValueError("num_pages is not set and the engine gave no estimate")
        return dataclasses.replace(self, max_model_len=L, num_pages=P)
