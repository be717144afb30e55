"""Ragged paged attention on TPU (Mosaic): scalar-prefetched page tables, manual double-buffered DMA.

Grid: (KV-head blocks, query-token blocks of `q_tokens_per_block`). A grid step owns the output rows
of its query tokens x its q heads and walks every (sequence, KV block) pair those tokens need:
  * the sequences overlapping the token block are found by a binary search over cu_q_lens (SMEM);
  * for each, only the KV positions some row of the block can see are visited: causal upper end
    (the block's last query position) and, with a sliding window, the window's lower end, so
    prefill chunks skip future blocks and windowed layers skip old pages;
  * each KV block is `kv_pages_per_block` pages DMAed page by page (only pages that hold needed
    positions, so page_indices entries past a sequence's length are never read) into one half of
    a double buffer while the other half is being computed on;
  * all q heads that share a KV head are stacked as rows of one matmul (rows = tokens x q heads
    per KV head), so each KV page is read once per KV-head block;
  * softmax is online (running max m, sum l, unnormalised acc per row in VMEM scratch); rows of
    other sequences are untouched by construction (their mask is empty, so alpha = 1 and p = 0).

The KV layout [P, G, 2K, H] interleaves K and V along the sublane axis. For 32-bit KV the K/V of
one head are strided sublane loads. For bf16, K and V of one head share one packed 32-bit sublane
word, so the block is read as uint32 and K/V are its low/high halves (as in jax's
ops/tpu/ragged_paged_attention). jax 0.10's TPU simulator (`pltpu.InterpretParams`) does not model
ref reshape/bitcast transforms, so under it the de-interleave reads the block as a value instead;
the DMA, semaphore and page-table logic it checks is the same code.

VMEM at the defaults (bf16, H=128, 8 KV heads per block, 512 keys per block, 32 tokens x 4 q heads
per KV head): KV double buffer 4 MiB, q/out blocks 1 MiB, acc/m/l 1.5 MiB: inside v5e's 16 MiB and
v6e's 32 MiB scoped defaults; `vmem_limit_bytes` is still set from the estimate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.common import BlockSizes, validate_inputs
from pallas_kernels.ragged_paged_attention.reference import ref_cost_estimate

# Finite so that a row with every logit masked keeps exp(m_prev - m_next) = 1 instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LANES = 128  # m and l scratch are lane-replicated: Mosaic stores [R, 128] tiles, not [R, 1].


def _sublane_tile(dtype) -> int:
    """Rows of one (sublane x 128) VMEM tile: 8 for 32-bit, 16 for 16-bit (packed)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_block_sizes(q, kv_pages, page_indices) -> BlockSizes:
    T, N, _ = q.shape
    _, G, K2, _ = kv_pages.shape
    K = K2 // 2
    P_max = page_indices.shape[1]
    kv_heads = K
    half_tile = _sublane_tile(kv_pages.dtype) // 2
    if K % half_tile == 0 and (half_tile * (N // K)) % _sublane_tile(q.dtype) == 0:
        kv_heads = half_tile
    return BlockSizes(
        q_tokens_per_block=min(32, T),
        kv_pages_per_block=max(1, min(P_max, 512 // G)),
        kv_heads_per_block=kv_heads,
    )


def check_block_sizes(bs: BlockSizes, q, kv_pages, page_indices) -> tuple[int, int, int]:
    """(q tokens, pages, KV heads) per block, or ValueError naming the tile that does not fit."""
    T, N, _ = q.shape
    K = kv_pages.shape[2] // 2
    P_max = page_indices.shape[1]
    bq = min(bs.q_tokens_per_block, T)
    ppb = bs.kv_pages_per_block
    kb = bs.kv_heads_per_block or default_block_sizes(q, kv_pages, page_indices).kv_heads_per_block
    if ppb > P_max:
        raise ValueError(f"kv_pages_per_block={ppb} exceeds page_indices.shape[1]={P_max}")
    if K % kb:
        raise ValueError(f"kv_heads_per_block={kb} must divide K={K}")
    if kb != K:
        kv_tile, q_tile = _sublane_tile(kv_pages.dtype), _sublane_tile(q.dtype)
        if (2 * kb) % kv_tile or (kb * (N // K)) % q_tile:
            raise ValueError(
                f"kv_heads_per_block={kb} must be K={K} or give whole sublane tiles: 2*{kb} KV rows "
                f"(tile {kv_tile}) and {kb * (N // K)} q heads (tile {q_tile})")
    return bq, ppb, kb


def _load_kv_head(kv_buf, buf, kk, kv_block, simulate_layout):
    """K and V of KV head kk of the block in buffer `buf`: two [kv_block, H] values."""
    _, ppb, G, K2b, H = kv_buf.shape
    if simulate_layout:
        blk = kv_buf[buf]  # [ppb, G, 2Kb, H]
        return (blk[:, :, 2 * kk, :].reshape(kv_block, H), blk[:, :, 2 * kk + 1, :].reshape(kv_block, H))
    rows = kv_buf.at[buf].reshape(kv_block * K2b, H)
    if jnp.dtype(kv_buf.dtype).itemsize == 4:
        return (rows[pl.ds(2 * kk, kv_block, stride=K2b), :], rows[pl.ds(2 * kk + 1, kv_block, stride=K2b), :])
    # 16-bit: rows 2kk (K) and 2kk+1 (V) of a token are the low and high halves of one 32-bit word.
    words = rows.bitcast(jnp.uint32)[pl.ds(kk, kv_block, stride=K2b // 2), :]
    k = pltpu.bitcast(words << 16, jnp.float32).astype(kv_buf.dtype)
    v = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32).astype(kv_buf.dtype)
    return k, v


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # i32[S]
    page_indices_ref,  # i32[S, P_max]
    cu_q_lens_ref,  # i32[S + 1]
    num_seqs_ref,  # i32[1]
    # inputs
    q_ref,  # [bq, Nb, H] VMEM block
    kv_hbm_ref,  # [P, G, 2K, H] HBM
    # outputs
    o_ref,  # [bq, Nb, H]
    # scratch
    kv_buf,  # [2, ppb, G, 2Kb, H] VMEM
    sems,  # DMA semaphores [2]
    m_ref,  # f32[Kb, R, 128] running max (lane-replicated), R = bq * q_per_kv
    l_ref,  # f32[Kb, R, 128] running sum
    acc_ref,  # f32[bq, Nb, H] unnormalised output
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    q_per_kv: int,
    simulate_layout: bool,
):
    bq, Nb, H = q_ref.shape
    _, ppb, G, K2b, _ = kv_buf.shape
    Kb = K2b // 2
    bkv = ppb * G
    R = bq * q_per_kv
    S = kv_lens_ref.shape[0]
    h_blk, q_blk = pl.program_id(0), pl.program_id(1)
    n = num_seqs_ref[0]
    qbs = q_blk * bq
    qbe = qbs + bq
    f32 = jnp.float32

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, f32)
    l_ref[...] = jnp.zeros(l_ref.shape, f32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

    def seq_meta(s):
        """Scalars of sequence s seen from this token block; s is clamped so reads stay in range."""
        s = jnp.minimum(s, S - 1)
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        ctx = kv_len - (q_end - q_start)  # KV position of the sequence's first query token
        r0, r1 = jnp.maximum(q_start, qbs), jnp.minimum(q_end, qbe)
        hi = ctx + r1 - q_start  # keys [lo, hi) are all any row of this block can see
        lo = jnp.int32(0) if sliding_window is None else jnp.maximum(ctx + r0 - q_start - sliding_window + 1, 0)
        return dict(s=s, q_start=q_start, q_end=q_end, ctx=ctx, lo=lo, hi=hi, has_rows=r1 > r0)

    def in_block(s):
        return (s < n) & (cu_q_lens_ref[jnp.minimum(s, S)] < qbe)

    def advance(s):
        """First sequence >= s that has query rows in this block (skips empty q_len entries)."""
        return lax.while_loop(lambda s: in_block(s) & ~seq_meta(s)["has_rows"], lambda s: s + 1, s)

    def first_kv_block(s):
        return seq_meta(s)["lo"] // bkv

    def next_item(s, j):
        more = (j + 1) * bkv < seq_meta(s)["hi"]
        s_next = advance(s + 1)
        return (jnp.where(more, s, s_next), jnp.where(more, j + 1, first_kv_block(s_next)))

    def page_copies(s, j, buf):
        """(needed, descriptor) for each page of KV block j of sequence s."""
        meta = seq_meta(s)
        page_lo, page_hi = meta["lo"] // G, pl.cdiv(meta["hi"], G)
        out = []
        for i in range(ppb):
            page = j * ppb + i
            needed = (page >= page_lo) & (page < page_hi)
            src_page = page_indices_ref[meta["s"], jnp.where(needed, page, 0)]
            src = kv_hbm_ref.at[src_page, :, pl.ds(h_blk * K2b, K2b), :]
            out.append((needed, pltpu.make_async_copy(src, kv_buf.at[buf, i], sems.at[buf])))
        return out

    def start_fetch(s, j, buf):
        for needed, copy in page_copies(s, j, buf):
            pl.when(needed)(copy.start)

    def wait_fetch(s, j, buf):
        for needed, copy in page_copies(s, j, buf):
            pl.when(needed)(copy.wait)

    def compute(s, j, buf):
        meta = seq_meta(s)
        row_tok = qbs + lax.broadcasted_iota(jnp.int32, (R, bkv), 0) // q_per_kv
        q_pos = meta["ctx"] + row_tok - meta["q_start"]
        kv_pos = j * bkv + lax.broadcasted_iota(jnp.int32, (R, bkv), 1)
        mask = (row_tok >= meta["q_start"]) & (row_tok < meta["q_end"]) & (kv_pos <= q_pos)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        # Slots outside [lo, hi) are stale buffer contents or unwritten (NaN) cache slots: p is 0
        # there, but 0 * NaN is NaN in p @ V, so V is zeroed.
        v_pos = j * bkv + lax.broadcasted_iota(jnp.int32, (bkv, H), 0)
        v_ok = (v_pos >= meta["lo"]) & (v_pos < meta["hi"])
        precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
        for kk in range(Kb):
            k, v = _load_kv_head(kv_buf, buf, kk, bkv, simulate_layout)
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            q = q_ref[:, pl.ds(kk * q_per_kv, q_per_kv), :]
            if q_per_kv % (4 // jnp.dtype(q.dtype).itemsize):
                q = q.astype(f32)  # a packed dtype cannot fold an odd head count into sublanes
            q = q.reshape(R, H)
            logits = jnp.einsum("nd,md->nm", q, k, preferred_element_type=f32, precision=precision) * sm_scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev = jnp.max(m_ref[kk], axis=1, keepdims=True)  # [R, 1]; all lanes hold the same value
            l_prev = jnp.max(l_ref[kk], axis=1, keepdims=True)
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(logits - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            m_ref[kk] = jnp.broadcast_to(m_next, (R, _LANES))
            l_ref[kk] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), (R, _LANES))
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=f32, precision=precision)
            heads = pl.ds(kk * q_per_kv, q_per_kv)
            acc = acc_ref[:, heads, :].reshape(R, H)
            acc_ref[:, heads, :] = (alpha * acc + pv).reshape(bq, q_per_kv, H)

    # First sequence whose query range ends after this block starts (cu_q_lens is non-decreasing).
    def bisect(c):
        lo, hi = c
        mid = (lo + hi) // 2
        right = cu_q_lens_ref[mid + 1] <= qbs
        return jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)

    s0, _ = lax.while_loop(lambda c: c[0] < c[1], bisect, (jnp.int32(0), n))
    s0 = advance(s0)
    j0 = first_kv_block(s0)

    @pl.when(in_block(s0))
    def _():
        start_fetch(s0, j0, 0)

    def body(carry):
        s, j, buf = carry
        s_next, j_next = next_item(s, j)

        @pl.when(in_block(s_next))
        def _():
            start_fetch(s_next, j_next, 1 - buf)

        wait_fetch(s, j, buf)
        compute(s, j, buf)
        return s_next, j_next, 1 - buf

    lax.while_loop(lambda c: in_block(c[0]), body, (s0, j0, jnp.int32(0)))

    for kk in range(Kb):
        l = jnp.max(l_ref[kk], axis=1, keepdims=True)
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)  # padding rows have l = 0 -> 0
        heads = pl.ds(kk * q_per_kv, q_per_kv)
        acc_ref[:, heads, :] = (acc_ref[:, heads, :].reshape(R, H) * inv).reshape(bq, q_per_kv, H)
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes",
                                             "interpret"))
def _ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                            sliding_window, soft_cap, block_sizes, interpret):
    T, N, H = q.shape
    P, G, K2, _ = kv_pages.shape
    K = K2 // 2
    q_per_kv = N // K
    bq, ppb, kb = check_block_sizes(block_sizes, q, kv_pages, page_indices)
    nb = kb * q_per_kv
    R = bq * q_per_kv
    isz = jnp.dtype(q.dtype).itemsize
    vmem = (2 * ppb * G * 2 * kb * H * isz  # KV double buffer
            + 2 * 2 * bq * nb * H * isz  # pipelined q and out blocks
            + 4 * (bq * nb * H + 2 * kb * R * _LANES)  # acc, m, l
            + 4 * 4 * R * ppb * G)  # logits, p and masks
    vmem_limit = block_sizes.vmem_limit_bytes or int(min(max(32 << 20, 2 * vmem), 64 << 20))
    q_spec = pl.BlockSpec((bq, nb, H), lambda h, i, *_: (i, h, 0))
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        q_per_kv=q_per_kv, simulate_layout=isinstance(interpret, pltpu.InterpretParams))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(K // kb, pl.cdiv(T, bq)),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb, G, 2 * kb, H), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((kb, R, _LANES), jnp.float32),
                pltpu.VMEM((kb, R, _LANES), jnp.float32),
                pltpu.VMEM((bq, nb, H), jnp.float32),
            ],
        ),
        # No state crosses grid steps, so both axes may be split across TensorCores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        cost_estimate=ref_cost_estimate(q, kv_pages, page_indices, soft_cap=soft_cap),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_pages)


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    kv_pages: jax.Array,  # [P, G, 2K, H]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret=False,
) -> jax.Array:  # [T, N, H], q.dtype
    """Mosaic TPU kernel; same contract as reference.ref_ragged_paged_attention.

    q of another dtype than kv_pages is cast to the KV dtype; the output has q's dtype.

    interpret: False on a TPU; True or a `pltpu.InterpretParams` to run it on CPU.
    """
    validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    out_dtype = q.dtype
    q = q.astype(kv_pages.dtype)  # matmuls run in the cache's dtype (f32 activations, bf16 KV)
    if block_sizes is None:
        block_sizes = default_block_sizes(q, kv_pages, page_indices)
    out = _ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=float(sm_scale), sliding_window=sliding_window,
                                  soft_cap=None if soft_cap is None else float(soft_cap),
                                  block_sizes=block_sizes, interpret=interpret)
    return out.astype(out_dtype)
