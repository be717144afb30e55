"""Flash attention for Hopper (sm_90) through Pallas' Mosaic GPU backend: FlashAttention-3 style.

Structure follows jax's FA3 example (jax/experimental/pallas/ops/gpu/attention_mgpu.py) and the
FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608): each CTA owns 2 * block_q query rows
of one head; two compute warpgroups take block_q rows each and issue wgmma (QK^T, then PV) from
swizzled shared memory, and a third, register-starved warpgroup streams K/V tiles with TMA into a
ring of `num_stages` buffers guarded by mbarriers. A "schedule barrier" ping-pongs the compute
warpgroups so one's softmax overlaps the other's matmuls.

Added here over the example: our masking semantics (causal aligned to the last key so chunked
prefill works, sliding window, KV tail padding), GQA, soft cap, sm_scale, bf16 shared memory,
arbitrary T/S (padded to whole tiles), heavy causal tiles scheduled first.

Masked scores are -inf, and in masked steps the running max is floored at -1e30 so a row with
nothing visible yet computes exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN. A finite mask
value (-1e30) is not safe here: p = exp2(fma(s, scale, -m)) evaluates s * scale exactly while m
was rounded, and at 1e30 that rounding residual (~1e23) overflows exp2 to inf whenever its sign
is positive; on an H200 that turned every row whose first KV block was fully masked by a sliding
window into NaN. Segment ids and float32 are not handled here (gpu.py routes them to the Triton
kernel).

Mosaic GPU ignores pl.CostEstimate (its lowering drops it) and plgpu.kernel takes none.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.common import BlockSizes, round_up, validate_inputs

_LOG2E = math.log2(math.e)
_M_FLOOR = -1e30  # running-max floor in masked steps (see module docstring)
# Measured on H100 (docs/kernels/flash_attention.md). block_q is per compute warpgroup.
DEFAULT_BLOCK_SIZES = {
    64: BlockSizes(block_q=64, block_kv=128, num_stages=2),
    128: BlockSizes(block_q=64, block_kv=128, num_stages=2),
    256: BlockSizes(block_q=64, block_kv=64, num_stages=2),
}
SUPPORTED_HEAD_DIMS = (64, 128, 256)
_COMPUTE_WGS = 2


def supports(q, *, segment_ids) -> bool:
    """Whether this kernel handles the call (the caller falls back to the Triton kernel if not)."""
    return (segment_ids is None and q.shape[-1] in SUPPORTED_HEAD_DIMS
            and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _check_blocks(bs: BlockSizes, H: int):
    if bs.block_q != 64:
        raise ValueError(f"block_sizes.block_q={bs.block_q}: the Mosaic GPU kernel needs 64 (one wgmma M tile per warpgroup)")
    if bs.block_kv % 64:
        raise ValueError(f"block_sizes.block_kv={bs.block_kv}: the Mosaic GPU kernel needs a multiple of 64")
    if bs.num_stages < 2:
        raise ValueError(f"block_sizes.num_stages={bs.num_stages}: the Mosaic GPU kernel needs >= 2 K/V buffers")
    smem = 2 * (_COMPUTE_WGS * bs.block_q * H + 2 * bs.num_stages * bs.block_kv * H)
    if smem > 227 * 1024:
        raise ValueError(f"block_sizes={bs} at head_dim {H} needs {smem} bytes of shared memory; H100 has 227 KiB")


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "sliding_window", "soft_cap", "block_sizes"))
def flash_attention_mosaic(
    q: jax.Array,  # bf16/f16[B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:  # [B, T, N, H]
    p = validate_inputs(q, k, v, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    if not supports(q, segment_ids=None):
        raise ValueError(f"q: the Mosaic GPU kernel needs bf16/f16 and head_dim in {SUPPORTED_HEAD_DIMS}; "
                         f"got {q.dtype}, head_dim {q.shape[-1]}")
    B, T, S, N, H, G = p.B, p.T, p.S, p.N, p.H, p.group
    bs = block_sizes or DEFAULT_BLOCK_SIZES[H]
    _check_blocks(bs, H)
    bq, bkv = bs.block_q, bs.block_kv
    cta_q = _COMPUTE_WGS * bq
    Tp, Sp = round_up(T, cta_q), round_up(S, bkv)
    nq_cta, nk = Tp // cta_q, Sp // bkv
    off = p.q_offset
    mask_tail = Sp != S
    max_stages = min(bs.num_stages, nk)
    dtype = q.dtype
    score_scale = (sm_scale if soft_cap is None else 1.0) * _LOG2E  # folded into exp2's FMA

    def wg_kv_range(q_base, rows):
        """Python-or-traced [lo, b, c, hi): masked [lo, b), unmasked [b, c), masked [c, hi)."""
        q_max = off + q_base + rows - 1
        hi = jnp.minimum(lax.div(q_max + bkv, bkv), nk) if causal else nk
        full_hi = lax.div(off + q_base + 1, bkv) if causal else nk
        if mask_tail:
            full_hi = jnp.minimum(full_hi, nk - 1)
        if sliding_window is not None:
            lo = lax.div(jnp.maximum(off + q_base - sliding_window + 1, 0), bkv)
            full_lo = lax.div(jnp.maximum(q_max - sliding_window + 1, 0) + bkv - 1, bkv)
        else:
            lo, full_lo = 0, 0
        b = jnp.clip(full_lo, lo, hi)
        c = jnp.clip(full_hi, b, hi)
        return lo, b, c, hi

    def kernel(q_ref, k_ref, v_ref, out_ref, scoped):
        batch = lax.axis_index("batch")
        q_head = lax.axis_index("heads")
        q_cta = nq_cta - 1 - lax.axis_index("q_seq")  # causal: heavy tiles first
        smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped
        wg_idx = lax.axis_index("wg")
        qo_smem2, k_smem, v_smem = smem_buffers
        k_barriers, v_barriers, q_barriers = buffer_barriers
        k_consumed_barriers, v_consumed_barriers = consumed_barriers
        cta_base = q_cta * cta_q
        # The CTA's K/V stream: the union of both warpgroups' ranges (WG0's lo, WG1's hi).
        cta_lo = jnp.int32(wg_kv_range(cta_base, bq)[0])
        cta_hi = jnp.int32(wg_kv_range(cta_base + bq, bq)[3])

        def perform_schedule_barrier():
            plgpu.barrier_arrive(schedule_barrier)
            plgpu.barrier_wait(schedule_barrier)

        def slot_of(step):
            return lax.rem(step - cta_lo, jnp.array(max_stages, jnp.int32))

        @pl.when(wg_idx < _COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")  # 2 x 128 x 232 + 128 x 40 <= 64K registers
            qo_smem = qo_smem2.at[wg_idx]
            q_base = cta_base + wg_idx * bq
            _, b, c, hi = (jnp.int32(x) for x in wg_kv_range(q_base, bq))

            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), q_head], qo_smem, q_barriers.at[wg_idx])
            plgpu.barrier_wait(q_barriers.at[wg_idx])

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, dtype=jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((bq,), 0, dtype=jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((bq, H), 0, dtype=jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(cta_hi > cta_lo)
            def _():
                plgpu.barrier_wait(k_barriers.at[0])

            pl.when(wg_idx == 1)(perform_schedule_barrier)

            def kv_loop(kv_step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = slot_of(kv_step)

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    perform_schedule_barrier()
                    return acc_ref[...]

                qk = pl.run_scoped(compute_qk, plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(k_consumed_barriers.at[slot])
                if soft_cap is not None:
                    qk = soft_cap * jnp.tanh(qk * (sm_scale / soft_cap))
                if masked:
                    q_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                    kv_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                    q_pos = q_ids + (off + q_base)
                    kv_pos = kv_ids + kv_step * bkv
                    mask = None
                    if causal:
                        mask = kv_pos <= q_pos
                    if sliding_window is not None:
                        mask = mask & (kv_pos > q_pos - sliding_window)
                    if mask_tail:
                        tail = kv_pos < S
                        mask = tail if mask is None else mask & tail
                    if mask is not None:
                        qk = jnp.where(mask, qk, -jnp.inf)

                # m is kept in base-2 units so p is one FMA + exp2 per score.
                m_ij = jnp.maximum(m_i, qk.max(axis=1) * score_scale)
                if masked:
                    m_ij = jnp.maximum(m_ij, _M_FLOOR)
                alpha = jnp.exp2(m_i - m_ij)
                m_i = m_ij
                p = jnp.exp2(qk * score_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i *= alpha
                p16 = p.astype(dtype)

                def end_softmax_barriers():
                    plgpu.barrier_arrive(schedule_barrier)  # done with softmax
                    plgpu.barrier_wait(v_barriers.at[slot])
                    plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

                # Ordering taken from jax's example, which measured it to matter by head_dim.
                if H <= 128:
                    l_i += p.sum(axis=1)
                    acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
                    end_softmax_barriers()
                else:
                    end_softmax_barriers()
                    l_i += p.sum(axis=1)

                # Computed outside run_state: on jax 0.11 a constant closed over by run_state (cta_lo,
                # hi are literals when static) comes back from its discharge as a Python int and
                # breaks the lowering.
                next_slot = slot_of(kv_step + 1)
                has_next = kv_step + 1 < hi

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    @pl.when(has_next)
                    def _wait():
                        plgpu.barrier_wait(k_barriers.at[next_slot])

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_consumed_barriers.at[slot])
                return acc, m_i, l_i

            def drain_loop(kv_step, _):
                # Steps the other warpgroup still needs: release the buffers and keep the schedule
                # barrier's phase count in step with it.
                slot = slot_of(kv_step)
                plgpu.barrier_arrive(k_consumed_barriers.at[slot])
                plgpu.barrier_arrive(v_consumed_barriers.at[slot])
                perform_schedule_barrier()
                perform_schedule_barrier()

            carry = (acc, m_i, l_i)
            # Both warpgroups start at the CTA's first block (WG1's extra leading block is masked).
            carry = lax.fori_loop(cta_lo, b, functools.partial(kv_loop, masked=True), carry)
            carry = lax.fori_loop(b, c, functools.partial(kv_loop, masked=False), carry)
            carry = lax.fori_loop(c, hi, functools.partial(kv_loop, masked=True), carry)
            lax.fori_loop(hi, cta_hi, drain_loop, None)
            acc, m_i, l_i = carry
            pl.when(wg_idx == 0)(perform_schedule_barrier)

            acc *= lax.broadcast_in_dim(1.0 / l_i, (bq, H), [0])
            qo_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, bq), q_head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg_idx == _COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(q_head, jnp.array(G, q_head.dtype))
            n_steps = cta_hi - cta_lo
            for i in range(max_stages):
                @pl.when(i < n_steps)
                def _prefetch():
                    s = (batch, pl.ds((cta_lo + i) * bkv, bkv), kv_head)
                    plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[i], k_barriers.at[i])
                    plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[i], v_barriers.at[i])

            @pl.loop(cta_lo + max_stages, cta_hi)
            def _kv_loop(kv_step):
                slot = slot_of(kv_step)
                s = (batch, pl.ds(kv_step * bkv, bkv), kv_head)
                plgpu.barrier_wait(k_consumed_barriers.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_barriers.at[slot])
                plgpu.barrier_wait(v_consumed_barriers.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_barriers.at[slot])

    def entry(q_ref, k_ref, v_ref, out_ref):
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        qo_scratch = plgpu.SMEM((_COMPUTE_WGS, bq, H), dtype, transforms=(tiling, swizzle))
        k_scratch = plgpu.SMEM((max_stages, bkv, H), dtype, transforms=(tiling, swizzle))
        v_scratch = plgpu.SMEM((max_stages, bkv, H), dtype, transforms=(tiling, swizzle))
        pl.run_scoped(
            lambda *args: kernel(q_ref, k_ref, v_ref, out_ref, args),
            (qo_scratch, k_scratch, v_scratch),
            (plgpu.Barrier(num_barriers=max_stages), plgpu.Barrier(num_barriers=max_stages),
             plgpu.Barrier(num_barriers=_COMPUTE_WGS)),
            (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=max_stages),) * 2,
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
            collective_axes="wg",
        )

    qp = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) if Tp != T else q
    kp = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0))) if Sp != S else k
    vp = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0))) if Sp != S else v
    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((B, Tp, N, H), dtype),
        grid=(N, nq_cta, B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qp, kp, vp)
    return out[:, :T] if Tp != T else out
