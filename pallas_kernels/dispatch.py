"""The one place that picks a kernel implementation. The model calls only these functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import flash_attention as _flash_attention
from pallas_kernels import greedy_head as _greedy_head
from pallas_kernels import ragged_paged_attention as _rpa
from pallas_kernels.ragged_paged_attention import gpu_write as _rpa_write
from pallas_kernels import rms_norm as _rms_norm
from pallas_kernels import swiglu as _swiglu


def _platform(x) -> str:
    """Platform of a concrete array's devices; under tracing, the default backend's."""
    try:
        return next(iter(x.devices())).platform
    except (AttributeError, jax.errors.ConcretizationTypeError):
        return jax.default_backend()


# platform -> ragged paged attention kernel; CPU (and any other platform) runs "xla", the jnp
# implementation that does only the batch's work (ragged_paged_attention/xla.py).
_RPA_BY_PLATFORM = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}
_JNP_PATHS = ("tpu", "xla", "reference")  # attention implementations whose KV write and norms are jnp


def select_attention_impl(platform: str, head_dim: int) -> str:
    """The ragged paged attention implementation for a model whose arrays live on `platform`.

    Models resolve this once, from their mesh, rather than per call from the default backend: a
    model placed on CPU devices of a GPU host must not trace a GPU kernel. Head dims the kernels
    don't tile (the GPU kernel needs a power of two >= 16, e.g. stories260K's H=8 is not) run the
    reference, which XLA compiles for any backend, not "xla": XLA's GPU runtime would copy the predicate
    of each of its loops (trip counts known only at run time) to the host every iteration."""
    impl = _RPA_BY_PLATFORM.get(platform, "xla")
    if impl == "gpu" and (head_dim < 16 or head_dim & (head_dim - 1)):
        return "reference"
    return impl


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, implementation: str = "auto"):
    """Attention of a ragged token batch over paged KV. See ragged_paged_attention/reference.py.

    implementation: "auto" (the Mosaic TPU kernel on TPU, the Triton kernel on NVIDIA GPUs, "xla"
    elsewhere, by the platform of q), "tpu", "gpu", "xla" (jnp, only the batch's work) or
    "reference" (the oracle, whose work grows with the page table's width)."""
    if implementation == "auto":
        implementation = _RPA_BY_PLATFORM.get(_platform(q), "xla")
    implementation = _fit_pages(implementation, kv_pages, page_indices)
    if implementation == "reference":
        return _rpa.ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                               sm_scale=sm_scale, sliding_window=sliding_window,
                                               soft_cap=soft_cap)
    return _rpa.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                       sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                       implementation=implementation)


def _fit_pages(implementation: str, kv_pages, page_indices) -> str:
    """"reference" where the GPU kernel cannot block this page geometry (the page size is the
    engine's setting, unknown when select_attention_impl resolves the model's implementation)."""
    if implementation == "gpu" and not _rpa.gpu.pages_fit(kv_pages.shape[1], page_indices.shape[1]):
        return "reference"
    return implementation


def write_qkv(kv_pages, qkv, cos, sin, kv_lens, page_indices, cu_q_lens, num_seqs, *,
              implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The step's attention input from the merged QKV projection qkv [T, K, R + 2, H]: RoPE (cos,
    sin f32[T, H/2]) on q and k, k and v written to their page slots (in place when the caller
    donates kv_pages), q [T, K * R, H] returned. See reference.ref_write_qkv.

    implementation: the one the model resolved for attention (select_attention_impl), so the write
    runs where the cache lives: "gpu" -> one Pallas Triton launch (ragged_paged_attention/gpu_write.py)
    where XLA would run RoPE and the K/V interleave as two fusions before a write; "tpu", "xla" and
    "reference" -> the jnp RoPE and one XLA scatter of the step's T rows (ref_write_qkv). "auto"
    picks by the platform of kv_pages and its head dim, as select_attention_impl does."""
    if implementation == "auto":
        implementation = select_attention_impl(_platform(kv_pages), kv_pages.shape[-1])
    if implementation == "gpu":
        return _rpa_write.write_qkv(kv_pages, qkv, cos, sin, kv_lens, page_indices, cu_q_lens, num_seqs)
    if implementation in _JNP_PATHS:
        return _rpa.ref_write_qkv(kv_pages, qkv, cos, sin, kv_lens, page_indices, cu_q_lens, num_seqs)
    raise ValueError(f"implementation={implementation!r} must be one of 'auto', 'gpu', {', '.join(map(repr, _JNP_PATHS))}")


def kv_pool_dtype(attn_impl: str, dtype):
    """The KV pool's dtype for a model of compute `dtype` whose attention is `attn_impl`, when the
    engine is not told one: `dtype`, but float32 for a 16-bit model on the "xla" path (CPUs).

    XLA's CPU backend scatters no 16-bit floats: it converts the whole pool to f32 and back around
    the step's KV write, every layer, every step (SmolLM2-135M in bf16, 8 sequences: 14.6 output tok/s
    on this workplace's CPU, a sixth of float32's). An f32 pool takes the write in place. It holds the
    same values: k and v are rounded to `dtype` before the write (ref_write_qkv), and the attention
    computes in f32 either way, so the outputs equal those of a 16-bit pool bit for bit, at twice
    its memory (docs/design.md, "16-bit models on CPUs")."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if attn_impl == "xla" and dtype.itemsize == 2 else dtype


def write_qkv_attention(kv_pages, qkv, cos, sin, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                        decode_only: bool = False, sliding_window=None, soft_cap=None, implementation: str = "auto"):
    """write_qkv then ragged_paged_attention -> (o [T, K * R, H], kv_pages): a decoder layer's
    attention from its merged QKV projection. decode_only: the caller guarantees every sequence has
    at most one token in the step (the engine's decode-only steps and bursts).

    qkv may be f32[P, T, K, R + 2, H] partial products (gemv_partials): their sum, rounded to the
    cache's dtype, is the projection (the fused kernel sums them as it loads its rows).

    implementation: as write_qkv's. "gpu" with decode_only -> one Pallas Triton launch that takes
    each token's own key from the projection and writes it (ragged_paged_attention/gpu.py,
    write_qkv_attention); otherwise the two calls (two launches on GPU; "xla" with decode_only takes
    the queries one at a time, the tile no decode fills more of)."""
    if implementation == "auto":
        implementation = select_attention_impl(_platform(kv_pages), kv_pages.shape[-1])
    implementation = _fit_pages(implementation, kv_pages, page_indices)
    if decode_only and decode_attention_is_fused(implementation):
        return _rpa.gpu.write_qkv_attention(kv_pages, qkv, cos, sin, kv_lens, page_indices, cu_q_lens, num_seqs,
                                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if qkv.ndim == 5:
        qkv = qkv.sum(axis=0).astype(kv_pages.dtype)
    q, kv_pages = write_qkv(kv_pages, qkv, cos, sin, kv_lens, page_indices, cu_q_lens, num_seqs,
                            implementation=implementation)
    if implementation == "xla":
        return _rpa.xla.xla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                                   sm_scale=sm_scale, sliding_window=sliding_window,
                                                   soft_cap=soft_cap, decode_only=decode_only), kv_pages
    return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  implementation=implementation), kv_pages


def decode_attention_is_fused(implementation: str) -> bool:
    """Whether write_qkv_attention(..., decode_only=True) runs one launch for this (resolved)
    attention implementation rather than write_qkv and the attention: the engine then compiles
    decode-only model programs, which differ from the others only there."""
    return implementation == "gpu"


def add_rms_norm(x, r, scale, *, eps: float, implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(x + r, RMSNorm(x + r) * scale): a decoder layer's residual add and the norm after it. x may
    be f32[P, T, D] partial products (gemv_partials): their sum, rounded to r's dtype, is added.

    implementation: the one the model resolved for attention (select_attention_impl): "gpu" -> one
    Pallas Triton launch (rms_norm/gpu.py) where XLA runs two; "tpu", "xla" and "reference" -> jnp
    (ref_add_rms_norm). "auto" picks by the platform of r."""
    if implementation == "auto":
        implementation = _RPA_BY_PLATFORM.get(_platform(r), "xla")
    if implementation == "gpu":
        return _rms_norm.add_rms_norm(x, r, scale, eps=eps)
    if implementation in _JNP_PATHS:
        return _rms_norm.ref_add_rms_norm(x, r, scale, eps=eps)
    raise ValueError(f"implementation={implementation!r} must be one of 'auto', 'gpu', {', '.join(map(repr, _JNP_PATHS))}")


def embed_rms_norm(table, ids, scale, *, eps: float, dtype, rows: int | None = None,
                   implementation: str = "reference") -> tuple[jax.Array, jax.Array]:
    """(x, RMSNorm(x) * scale) for the embedding rows x = table[ids] cast to `dtype`, [rows, D] (rows
    past the ids embed id 0): the model's entry and its first layer's input norm (see
    rms_norm/reference.py, ref_embed_rms_norm).

    implementation: the model's gemm_impl (select_gemm_impl): "mosaic_gpu" (one Hopper GPU, the table whole
    on it) -> one Pallas Triton launch that gathers the rows itself (rms_norm/gpu.py), where XLA runs
    the gather and the norm as two; "reference" -> jnp (on several devices the table may be split
    over `vocab`, and a custom call would make XLA gather it whole); "cpu" -> the same jnp, its table
    tied to the ids by an optimization barrier. XLA's CPU gathers no 16-bit floats: it gathers from
    convert(table) to f32, which it fuses into the gather (only the rows read are converted), but
    inside a decode burst's loop that convert is loop-invariant, and XLA hoists it and writes the
    whole table in f32 once a burst (SmolLM2-135M's: 113 MB, ~38 ms). Through the barrier the table
    depends on each step's ids, so it stays fused (docs/design.md, "16-bit models on CPUs")."""
    if implementation == "mosaic_gpu":
        return _rms_norm.embed_rms_norm(table, ids, scale, eps=eps, dtype=dtype, rows=rows)
    _check_gemm_impl(implementation)
    if implementation == "cpu":
        table, ids = jax.lax.optimization_barrier((table, ids))
    return _rms_norm.ref_embed_rms_norm(table, ids, scale, eps=eps, dtype=dtype, rows=rows)


# Batch-1 decode steps of small models on one Hopper GPU run the q/k/v, o and down projections as
# GEMV_PARTS[name] batched GEMVs over slices of the contraction, leaving f32 partial products that the
# kernel after each sums (write_qkv_attention, add_rms_norm). XLA splits these GEMVs' K itself at
# such rows and then runs a reduce kernel per GEMV: 47 launches, ~58 us of llama3_2_1b's ~950 us
# batch-1 step on an H200. The summing costs the consumers part of that back, so it pays only where
# the reduces are a large share: llama3_2_1b's batch-1 step (hidden 2,048) 0.962-0.965 -> 0.920-0.926
# ms on an H200 and 1.176-1.199 -> 1.149-1.155 on an H100 (alternating runs), its batch 16 lost 1-2%,
# and llama3_8b (hidden 4,096) at batch 1 lost ~1% (docs/benchmarks.md, twenty-eighth session).
GEMV_PARTS = {"qkv": 4, "o": 4, "down": 8}
GEMV_PARTIALS_MAX_ROWS = 8  # the engine's batch-1 programs (1 token, 2 rows: LlamaModel pads it)
GEMV_PARTIALS_MAX_HIDDEN = 2048
# Decode-only steps of DOWN_PARTS_ROWS rows (the buckets whose programs use cuBLAS by default,
# EngineConfig.gpu_cublas_min_tokens, up to the largest measured) leave the MLP's down projection as
# partial products too: cuBLAS splits that contraction itself at these rows and then runs a reduce
# kernel (3.1-3.6 us at 256 rows of llama3_2_1b on an H200); a batched GEMM over the parts runs
# without it, and add_rms_norm sums them. Down + add_rms_norm, H200 (docs/benchmarks.md,
# thirty-second session): llama3_2_1b 23.2 -> 17.8 us a layer at 256 rows with 4 parts, 16.3 -> 13.9
# at 128, 15.1 -> 12.9 at 64; llama3_8b 49.7 -> 46.4 at 256 and 39.3 -> 36.6 at 128 with 2 parts
# (4 were no better there, and at 64 rows 2 were 0.6 us slower). q/k/v (read by the attention
# kernel, which then ran slower) and o (<= 0.3 us faster at 128-256 rows) stay single products.
DOWN_PARTS_ROWS = (64, 256)


def gemv_parts(name: str, rows: int, contraction: int, hidden: int, *, decode_only: bool, attn_impl: str,
               gemm_impl: str) -> int:
    """How many partial products to leave for projection `name` ("qkv", "o" or "down") of `rows`
    rows over `contraction`, in a model of `hidden` size, on one Hopper GPU (gemm_impl "mosaic_gpu")
    whose attention and norms run the GPU kernels, in decode-only steps: GEMV_PARTS[name] at most
    GEMV_PARTIALS_MAX_ROWS rows of a model of at most GEMV_PARTIALS_MAX_HIDDEN; for "down" at
    DOWN_PARTS_ROWS rows, 4 (hidden <= 2048) or 2 (larger models, from 128 rows). The parts must
    divide the contraction (then gemv_partials); else 1 (one product, x @ w)."""
    if not decode_only or attn_impl != "gpu" or gemm_impl != "mosaic_gpu":
        return 1
    if rows <= GEMV_PARTIALS_MAX_ROWS and hidden <= GEMV_PARTIALS_MAX_HIDDEN:
        parts = GEMV_PARTS[name]
    elif name == "down" and DOWN_PARTS_ROWS[0] <= rows <= DOWN_PARTS_ROWS[1]:
        parts = 4 if hidden <= GEMV_PARTIALS_MAX_HIDDEN else 2 if rows >= 128 else 1
    else:
        return 1
    return parts if contraction % parts == 0 else 1


def gemv_partials(x, w, parts: int, *, precision=None) -> jax.Array:
    """f32[parts, T, ...]: the products of x [T, Kd] and w [Kd, ...] over `parts` equal slices of Kd
    (one batched GEMV), whose sum is x @ w, for the kernel after it to sum (add_rms_norm,
    write_qkv_attention). parts must divide Kd."""
    T, Kd = x.shape
    if parts < 2 or Kd % parts:
        raise ValueError(f"parts={parts} must be at least 2 and divide the contraction {Kd}")
    out = jnp.einsum("tpk,pkn->ptn", x.reshape(T, parts, Kd // parts), w.reshape(parts, Kd // parts, -1),
                     precision=precision, preferred_element_type=jnp.float32)
    return out.reshape(parts, T, *w.shape[1:])


# Token buckets from which the fused Hopper SwiGLU kernel replaces cuBLAS + XLA's activation kernel:
# at llama3_2_1b's shape it was 8% slower at 128 rows (H200) and 6-16% faster at 256-8,192 (H100 and
# H200; docs/kernels/swiglu.md).
SWIGLU_MIN_TOKENS = 256
# Token buckets up to which the Triton GEMV with the activation in its epilogue (swiglu/gpu.py)
# replaces XLA's Triton GEMV + activation kernel, in models of hidden size up to SWIGLU_GEMV_MAX_HIDDEN:
# llama3_2_1b's MLP 0.6-1.5 us a layer faster at 2-16 rows on an H200, llama3_8b's (hidden 4,096)
# within -0.9..+0.6 us of XLA (docs/kernels/swiglu.md).
SWIGLU_GEMV_MAX_TOKENS = 16
SWIGLU_GEMV_MAX_HIDDEN = 2048


GEMM_IMPLS = ("mosaic_gpu", "reference", "cpu")


def select_gemm_impl(mesh: jax.sharding.Mesh) -> str:
    """How the GEMMs of a model on `mesh` run: "mosaic_gpu" (one Hopper GPU) -> the ones with fused
    epilogues (the MLP's SwiGLU up projection, the greedy LM head) as kernels of
    pallas_kernels/mosaic_gemm.py; "cpu" (CPU devices) -> XLA, with 16-bit dots returning f32 that
    is rounded once to the model's dtype after (f32_dot_outputs); "reference" (elsewhere) -> XLA as
    jnp writes them. On several GPUs the weights may be split over `tensor` or `vocab`, and a custom
    call there would make XLA gather them around every call."""
    devices = mesh.devices.flat
    if devices[0].platform == "cpu":
        return "cpu"
    if mesh.devices.size != 1 or devices[0].platform not in ("gpu", "cuda"):
        return "reference"
    return "mosaic_gpu" if str(getattr(devices[0], "compute_capability", "")).startswith("9.") else "reference"


def _check_gemm_impl(implementation: str):
    if implementation not in GEMM_IMPLS:
        raise ValueError(f"implementation={implementation!r} must be one of {GEMM_IMPLS}")


def f32_dot_outputs(gemm_impl: str) -> bool:
    """Whether a model of this gemm_impl asks its dots for f32 outputs (`preferred_element_type`) and
    rounds them to its dtype after: on CPUs ("cpu"). XLA's CPU dot of bf16 operands that returns bf16
    runs 3-6x slower than the same dot returning f32 (it upcasts internally, ../shared/JAX_NOTES.md; on
    this workplace's CPU, 8 rows of SmolLM2-135M's gate/up 0.91 against 0.33 ms, its LM head 37.5
    against 3.0 ms), and the value is the same f32 sum rounded once. For f32 models the two are one
    dot. GPUs and TPUs round inside the dot and keep their 16-bit outputs (docs/design.md,
    "16-bit models on CPUs")."""
    _check_gemm_impl(gemm_impl)
    return gemm_impl == "cpu"


def swiglu(x, w, *, precision=None, implementation: str = "reference") -> jax.Array:
    """silu(x @ w[:, 0]) * (x @ w[:, 1]) for x [T, D], w [D, 2, F] -> [T, F] x.dtype.

    implementation: "mosaic_gpu" runs a fused kernel where one applies (bf16/f16 and tile-aligned D
    and F): the Hopper GEMM for T a multiple of 128 and at least SWIGLU_MIN_TOKENS, the Triton GEMV
    for T up to SWIGLU_GEMV_MAX_TOKENS and D up to SWIGLU_GEMV_MAX_HIDDEN; the reference elsewhere.
    "reference" is jnp (XLA); "cpu" the same with the GEMM's output in f32 (f32_dot_outputs)."""
    if implementation == "mosaic_gpu":
        if x.shape[0] >= SWIGLU_MIN_TOKENS:
            from pallas_kernels.swiglu import gpu_mosaic  # Mosaic GPU imports are heavier; load on use

            if gpu_mosaic.supports(x, w):
                return gpu_mosaic.swiglu_mosaic(x, w)
        elif x.shape[0] <= SWIGLU_GEMV_MAX_TOKENS and x.shape[1] <= SWIGLU_GEMV_MAX_HIDDEN:
            from pallas_kernels.swiglu import gpu

            if gpu.supports(x, w):
                return gpu.swiglu_gemv(x, w)
    return _swiglu.ref_swiglu(x, w, precision=precision, f32_out=f32_dot_outputs(implementation))


# Rows from which greedy_head runs the Mosaic GPU kernel (gpu_mosaic.py): from 64 rows it beats cuBLAS
# + XLA's argmax (204 vs 219 us at 64 rows, 230 vs 306 at 256; docs/kernels/greedy_head.md); on one row
# padded to 128 it lost to XLA's Triton GEMV (llama3_2_1b batch-1 bursts on an H100: 810-824 tok/s
# against 841-850).
GREEDY_HEAD_MIN_ROWS = 64
# Rows up to which greedy_head runs the Triton GEMV with the argmax in its epilogue (gpu.py): at
# llama3_2_1b's head on an H200, 119-123 us a call against 123-128 for XLA's GEMV, its argmax and the
# greedy sampler's ban at 1-16 rows; at llama3_8b's within 1 us of them (docs/kernels/greedy_head.md).
GREEDY_HEAD_GEMV_MAX_ROWS = 16


def greedy_head(x, head, *, transposed: bool, rows=None, precision=None,
                implementation: str = "reference") -> jax.Array:
    """i32[R]: each row's argmax over the f32 logits x @ head (head [D, V]), or x @ head.T
    (`transposed`: head [V, D], a tied embedding); the first index among equal maxima. rows: the
    rows of x [T, D] to take logits for (i32[R] in [0, T): the Triton kernel clamps, where jnp.take
    would count negative indices from the end), or None for all (R = T).

    implementation: "mosaic_gpu" (one Hopper GPU, select_gemm_impl) runs a kernel with the argmax in
    the GEMM's epilogue where one applies (bf16/f16): the Triton GEMV for up to
    GREEDY_HEAD_GEMV_MAX_ROWS rows (it gathers `rows` itself), the Mosaic GEMM from
    GREEDY_HEAD_MIN_ROWS (D a multiple of 64, V of 128); the reference elsewhere. "reference" is jnp
    (the logits, then their argmax)."""
    fused = _greedy_head_kernel(_rows_of(x, rows), head, transposed=transposed, implementation=implementation)
    if fused == "triton":
        from pallas_kernels.greedy_head import gpu

        return gpu.greedy_head_gemv(x, head, transposed=transposed, rows=rows)
    if rows is not None:
        x = jnp.take(x, rows, axis=0)
    if fused == "mosaic":
        from pallas_kernels.greedy_head import gpu_mosaic  # Mosaic GPU imports are heavier; load on use

        return gpu_mosaic.greedy_head_mosaic(x, head, transposed=transposed)
    return _greedy_head.ref_greedy_head(x, head, transposed=transposed, precision=precision,
                                        fold_transpose=f32_dot_outputs(implementation))


def _rows_of(x, rows):
    return x if rows is None else jax.ShapeDtypeStruct((rows.shape[0], x.shape[1]), x.dtype)


def greedy_head_is_fused(x, head, *, transposed: bool, implementation: str) -> bool:
    """Whether greedy_head runs a kernel for arrays (or ShapeDtypeStructs) of these shapes and
    dtypes (x [R, D]: the rows it takes logits for), rather than the logits and their argmax; the
    engine compiles its GREEDY_HEAD bursts only then."""
    return _greedy_head_kernel(x, head, transposed=transposed, implementation=implementation) is not None


def _greedy_head_kernel(x, head, *, transposed: bool, implementation: str) -> str | None:
    if implementation != "mosaic_gpu":
        _check_gemm_impl(implementation)
        return None
    if x.shape[0] <= GREEDY_HEAD_GEMV_MAX_ROWS:
        from pallas_kernels.greedy_head import gpu

        return "triton" if gpu.supports(x, head, transposed=transposed) else None
    if x.shape[0] >= GREEDY_HEAD_MIN_ROWS:
        from pallas_kernels.greedy_head import gpu_mosaic

        return "mosaic" if gpu_mosaic.supports(x, head, transposed=transposed) else None
    return None


def flash_attention(q, k, v, *, sm_scale, causal=True, segment_ids=None, sliding_window=None, soft_cap=None,
                    block_sizes=None, implementation: str = "auto"):
    """Prefill attention q [B, T, N, H] over k, v [B, S, K, H]. See flash_attention/common.py.

    "auto": the Mosaic TPU kernel on TPU, the best GPU kernel on GPU (Mosaic GPU on Hopper, else
    Triton), the pure-jnp reference elsewhere (CPU)."""
    if implementation == "auto":
        implementation = {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "reference")
    return _flash_attention.flash_attention(
        q, k, v, sm_scale=sm_scale, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
        soft_cap=soft_cap, block_sizes=block_sizes, implementation=implementation)
