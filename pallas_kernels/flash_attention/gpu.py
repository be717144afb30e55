"""Flash attention on NVIDIA GPUs through Pallas' Triton lowering (any CUDA GPU Triton supports).

One program per (q block, batch, query head); it keeps its q tile in registers and walks the KV
blocks its rows can see, in three static-shape loops: masked blocks below the sliding window's
full range, unmasked blocks (no iota, no select), and masked blocks on the causal diagonal or the
padded KV tail. With segment ids every block is masked. Query heads of one GQA group read the same
K/V (n // group), which L2 serves.

The Hopper-only Mosaic GPU kernel (gpu_mosaic.py) is faster where it applies; `flash_attention_gpu`
below picks between them (docs/kernels/flash_attention.md has the measurements).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.flash_attention.common import (
    BlockSizes, normalize_segment_ids, round_up, validate_inputs)
from pallas_kernels.flash_attention.reference import reference_cost

# By padded head_dim. H = 128 is the best of a sweep on an H200 (docs/kernels/flash_attention.md);
# 64 and 256 are sized to fit shared memory (q tile + num_stages K/V tiles <= 227 KiB), untuned.
DEFAULT_BLOCK_SIZES = {
    64: BlockSizes(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    128: BlockSizes(block_q=128, block_kv=64, num_warps=8, num_stages=3),
    256: BlockSizes(block_q=64, block_kv=64, num_warps=8, num_stages=2),
}


def default_block_sizes(head_dim_padded: int) -> BlockSizes:
    return DEFAULT_BLOCK_SIZES[min((h for h in DEFAULT_BLOCK_SIZES if h >= head_dim_padded), default=256)]
_LOG2E = math.log2(math.e)
_NT = (((1,), (1,)), ((), ()))  # q @ k.T (pl.dot is gone in jax 0.11)


def _cdiv(a, b: int):
    # Non-negative a only; lax.div truncates, which equals floor there.
    return lax.div(a + (b - 1), b)


def _kernel(*refs, sm_scale, soft_cap, causal, sliding_window, q_offset, kv_len, bq, bk, nk,
            has_segments, mask_kv_tail):
    if has_segments:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref = refs
        qs_ref = ks_ref = None
    nq = pl.num_programs(0)
    i = nq - 1 - pl.program_id(0)  # causal: the longest rows launch first, the short tail fills gaps
    H = q_ref.shape[-1]
    q = q_ref[...]  # [bq, H]
    q0 = q_offset + i * bq  # key position of this block's first query
    q_pos = q0 + jnp.arange(bq, dtype=jnp.int32)
    q_seg = qs_ref[...] if has_segments else None  # i32[bq]
    # float32 inputs: IEEE products (jax 0.11's Triton lowering otherwise picks TF32, ~1e-3 error).
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(j, carry, masked: bool):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]  # [bk, H]
        s = lax.dot_general(q, k, _NT, precision=precision, preferred_element_type=jnp.float32)  # f32[bq, bk]
        if soft_cap is not None:
            s = s * sm_scale
            s = (soft_cap * _LOG2E) * jnp.tanh(s * (1.0 / soft_cap))
        else:
            s = s * (sm_scale * _LOG2E)  # base-2 scores: exp2 is one MUFU op
        if masked:
            kv_pos = start + jnp.arange(bk, dtype=jnp.int32)
            mask = None
            if causal:
                mask = kv_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask = mask & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
            if mask_kv_tail:
                tail = jnp.broadcast_to(kv_pos[None, :] < kv_len, (bq, bk))
                mask = tail if mask is None else mask & tail
            if has_segments:
                same = q_seg[:, None] == ks_ref[pl.ds(start, bk)][None, :]
                mask = same if mask is None else mask & same
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        if masked:
            # A row with nothing visible yet keeps m = -inf; shifting by 0 keeps exp2(-inf) = 0.
            m_next_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        else:
            m_next_safe = m_next
        alpha = jnp.exp2(m_prev - m_next_safe)
        p = jnp.exp2(s - m_next_safe[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        v = v_ref[pl.ds(start, bk), :]
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_next, l_next

    # KV block ranges (see module docstring): [lo, b) masked, [b, c) unmasked, [c, hi) masked.
    if causal:
        hi = jnp.minimum(_cdiv(q0 + bq, bk), nk)
        full_hi = lax.div(q0 + 1, bk)
    else:
        hi = nk
        full_hi = nk
    if mask_kv_tail:
        full_hi = jnp.minimum(full_hi, nk - 1)
    if sliding_window is not None:
        lo = lax.div(jnp.maximum(q0 - sliding_window + 1, 0), bk)
        full_lo = _cdiv(jnp.maximum(q0 + bq - sliding_window, 0), bk)
    else:
        lo = 0
        full_lo = 0
    carry = (jnp.zeros((bq, H), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    if has_segments:
        carry = lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    else:
        b = jnp.clip(full_lo, lo, hi)
        c = jnp.clip(full_hi, b, hi)
        carry = lax.fori_loop(lo, b, functools.partial(body, masked=True), carry)
        carry = lax.fori_loop(b, c, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(c, hi, functools.partial(body, masked=True), carry)
    acc, _, l = carry
    inv = 1.0 / jnp.where(l == 0.0, 1.0, l)  # empty rows: acc is 0, output 0
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)


def _check_triton_blocks(bs: BlockSizes):
    if bs.block_q < 16 or bs.block_kv < 16:
        raise ValueError(f"block_sizes={bs}: the Triton kernel needs block_q and block_kv >= 16 (tensor-core tiles)")


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret"))
def flash_attention_triton(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    segment_ids=None,
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, T, N, H]
    p = validate_inputs(q, k, v, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    seg = normalize_segment_ids(segment_ids, p.B, p.T, p.S)
    B, T, S, N, H, G = p.B, p.T, p.S, p.N, p.H, p.group
    Hp = max(16, pl.next_power_of_2(H))  # Triton tiles are powers of two; zero columns change nothing
    bs = block_sizes or default_block_sizes(Hp)
    _check_triton_blocks(bs)
    bq = min(bs.block_q, max(16, pl.next_power_of_2(T)))
    bk = min(bs.block_kv, max(16, pl.next_power_of_2(S)))
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    nq, nk = Tp // bq, Sp // bk
    pad = lambda x, n, L: jnp.pad(x, ((0, 0), (0, L - n), (0, 0), (0, Hp - H))) if (L != n or Hp != H) else x
    qp, kp, vp = pad(q, T, Tp), pad(k, S, Sp), pad(v, S, Sp)

    def q_map(i, b, n):
        return (b, nq - 1 - i, n, 0)

    in_specs = [
        pl.BlockSpec((None, bq, None, Hp), q_map),
        pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
    ]
    args = [qp, kp, vp]
    if seg is not None:
        qs = jnp.pad(seg.q, ((0, 0), (0, Tp - T)), constant_values=-1)  # i32[B, Tp]
        ks = jnp.pad(seg.kv, ((0, 0), (0, Sp - S)), constant_values=-2)  # i32[B, Sp]
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, n: (b, nq - 1 - i)),
                     pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0))]
        args += [qs, ks]
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        causal=causal, sliding_window=sliding_window, q_offset=p.q_offset, kv_len=S, bq=bq, bk=bk, nk=nk,
        has_segments=seg is not None, mask_kv_tail=Sp != S)
    num_warps = bs.num_warps if bs.num_warps is not None else (4 if Hp <= 64 else 8)
    out = pl.pallas_call(
        kernel,
        grid=(nq, B, N),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, Hp), q_map),
        out_shape=jax.ShapeDtypeStruct((B, Tp, N, Hp), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
        cost_estimate=reference_cost(q.shape, k.shape, q.dtype, causal=causal, sliding_window=sliding_window,
                                     has_segment_ids=seg is not None),
        interpret=interpret,
        name="flash_attention_triton",
    )(*args)
    return out[:, :T, :, :H]


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def flash_attention_gpu(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    segment_ids=None,
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    kernel: str = "auto",
    interpret: bool = False,
) -> jax.Array:  # [B, T, N, H]
    """The faster GPU kernel that handles the call: Mosaic GPU (FA3-style) on Hopper for bf16/f16
    without segment ids and head_dim 64/128/256, the Triton kernel otherwise."""
    from pallas_kernels.flash_attention import gpu_mosaic  # Mosaic GPU imports are heavier; load on use

    if kernel not in ("auto", "triton", "mosaic"):
        raise ValueError(f"kernel={kernel!r}: expected 'auto', 'triton' or 'mosaic'")
    if kernel == "auto":
        use_mosaic = not interpret and _is_hopper() and gpu_mosaic.supports(q, segment_ids=segment_ids)
        kernel = "mosaic" if use_mosaic else "triton"
    opts = dict(sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap,
                block_sizes=block_sizes)
    if kernel == "mosaic":
        if segment_ids is not None:
            raise ValueError("segment_ids: the Mosaic GPU kernel does not take segment ids; use kernel='triton'")
        if interpret:
            raise ValueError("interpret: the Mosaic GPU kernel has no interpret mode on jax 0.10 (run_state, layout_cast)")
        return gpu_mosaic.flash_attention_mosaic(q, k, v, **opts)
    return flash_attention_triton(q, k, v, segment_ids, interpret=interpret, **opts)
