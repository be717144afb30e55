"""SwiGLU up projection for Hopper (sm_90) through Pallas' Mosaic GPU backend: one GEMM kernel whose
epilogue applies silu(gate) * up, so the [T, 2F] gate/up product is never written to memory.

Why: with cuBLAS for the merged gate/up GEMM, XLA runs silu(gate) * up as a kernel of its own that
reads the [T, 2F] product back and writes [T, F]: at a prefill step of 8,192 tokens of llama3_2_1b
(F = 8,192) that is 402 MB a layer, about 2 ms of a ~28 ms step on an H100 (docs/benchmarks.md).

Structure (the warp-specialized persistent GEMM of jax's Hopper matmul example,
jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py): one CTA per SM loops over output tiles;
a memory warpgroup streams x and the two weight tiles with TMA into a ring of `num_stages`
shared-memory buffers; two compute warpgroups take `block_m` rows each and issue wgmma into two f32
accumulators, one for the gate columns and one for the matching up columns. The epilogue computes
silu(gate) * up from the f32 accumulators, rounds once to x's dtype and stores through shared
memory with TMA. The reference rounds the GEMM's output to x's dtype before the activation, so the
two differ by about one rounding of the operands (tests/pallas_kernels/test_swiglu.py).

Mosaic GPU has no CPU interpreter for this kernel (its interpret mode does not support the
warpgroup-collective scratch): CPU tests trace it; the GPU tests run it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.swiglu.reference import validate

_COMPUTE_WGS = 2
_EPI = 64  # epilogue tiles of 64 x 64 through shared memory
_SMEM_BYTES = 227 * 1024  # H100 / H200 per-block shared memory
_DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_m: rows per compute warpgroup (a CTA takes 2 * block_m); block_n: gate (and up)
    columns per CTA; block_k: the reduction step; num_stages: buffers in the TMA ring; group_n:
    column blocks per group of the tile order (see the kernel)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    group_n: int = 8

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_stages", "group_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if self.block_m % 64:
            raise ValueError(f"block_m={self.block_m} must be a multiple of 64 (one wgmma M tile per warpgroup)")
        if self.block_n % _EPI or self.block_k % 64:
            raise ValueError(f"block_n={self.block_n} and block_k={self.block_k} must be multiples of 64")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be >= 2")

    def smem_bytes(self, itemsize: int) -> int:
        ring = self.num_stages * (_COMPUTE_WGS * self.block_m * self.block_k + 2 * self.block_k * self.block_n)
        return itemsize * (ring + _COMPUTE_WGS * 2 * _EPI * _EPI)


# H100 and H200 sweeps at llama3_2_1b's shape (docs/kernels/swiglu.md): groups of 8 column blocks were
# the best or within run-to-run noise (3-5%) of it at 256-8,192 rows on H100s; 4 stages beat 3; 64 x
# 64 tiles, 128-deep k steps, 2-CTA clusters sharing the weight tiles and one wgmma group kept in
# flight gained nothing.
DEFAULT_BLOCK_SIZES = BlockSizes()


def supports(x: jax.Array, w: jax.Array, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES) -> bool:
    """Whether the kernel takes these shapes and dtypes (the caller runs the reference if not)."""
    T, D = x.shape
    F = w.shape[-1]
    bs = block_sizes
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and w.dtype == x.dtype
            and T % (_COMPUTE_WGS * bs.block_m) == 0 and D % bs.block_k == 0 and F % bs.block_n == 0)


def _num_sms() -> int:
    try:
        return int(jax.devices()[0].core_count)
    except (AttributeError, TypeError, RuntimeError):
        return _DEFAULT_NUM_SMS


def _kernel(x_gmem, w_gmem, out_gmem, *, bs: BlockSizes):
    T, D = x_gmem.shape
    F = out_gmem.shape[1]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    dtype = x_gmem.dtype
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(bk * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(_EPI * itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // itemsize)), plgpu.SwizzleTransform(out_swizzle))
    cta_m = _COMPUTE_WGS * bm
    m_iters, n_iters, k_iters = T // cta_m, F // bn, D // bk

    def pipeline(body, compute_context):
        w_spec = plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, bk), lambda k: (0, k), transforms=transforms,
                                      memory_space=plgpu.SMEM), w_spec, w_spec],
            wg_axis="wg", num_compute_wgs=_COMPUTE_WGS, max_concurrent_steps=bs.num_stages,
            compute_context=compute_context)

    ignore = lambda *_, **__: None  # the allocations do not depend on the body

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem, w_gmem),
        out_smem=plgpu.SMEM((_COMPUTE_WGS, 2, _EPI, _EPI), dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * bm, bm)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tile(info):
            (idx,) = info.index
            # Tiles in groups of group_n weight column blocks (the columns varying fastest within a
            # group, then the rows; snaking between groups): the tiles in flight at once (one per
            # SM) share a few column blocks of the weight and a few row blocks of x, so both come
            # from L2. With the columns varying fastest over the whole width, every row block
            # re-read the whole weight (67 MB at llama3_2_1b, more than L2) from memory.
            mi, ni = plgpu.planar_snake(idx, (m_iters, n_iters), 1, min(bs.group_n, n_iters))
            rows = pl.ds(mi * cta_m, cta_m)

            def compute_context(run):
                @functools.partial(pl.run_scoped, acc_g=plgpu.ACC((bm, bn), jnp.float32),
                                   acc_u=plgpu.ACC((bm, bn), jnp.float32))
                def _acc(acc_g, acc_u):
                    run((acc_g, acc_u))
                    g = acc_g[...]
                    h = (g * jax.nn.sigmoid(g) * acc_u[...]).astype(dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_tile = out_gmem.at[rows, pl.ds(ni * bn, bn)].at[wg_rows]
                    for em in range(bm // _EPI):
                        for en in range(bn // _EPI):
                            slot = (em * (bn // _EPI) + en) % 2
                            sl = (slice(em * _EPI, (em + 1) * _EPI), slice(en * _EPI, (en + 1) * _EPI))
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = h[sl]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[sl])

            def mma(_, x_smem, g_smem, u_smem, carry):
                acc_g, acc_u = carry
                plgpu.wgmma(acc_g, x_smem.at[wg_rows], g_smem)
                plgpu.wgmma(acc_u, x_smem.at[wg_rows], u_smem)
                plgpu.wgmma_wait(0)
                return carry

            pipeline(mma, compute_context)(
                x_gmem.at[rows, :], w_gmem.at[:, pl.ds(ni * bn, bn)], w_gmem.at[:, pl.ds(F + ni * bn, bn)],
                allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("block_sizes",))
def swiglu_mosaic(x: jax.Array, w: jax.Array, *, block_sizes: BlockSizes | None = None) -> jax.Array:
    """silu(x @ w[:, 0]) * (x @ w[:, 1]): x [T, D], w [D, 2, F] -> [T, F] x.dtype, on a Hopper GPU.

    T must be a multiple of 2 * block_m, D of block_k and F of block_n (`supports`)."""
    validate(x, w)
    bs = block_sizes or DEFAULT_BLOCK_SIZES
    if not supports(x, w, bs):
        raise ValueError(f"x {x.shape} {x.dtype}, w {w.shape} {w.dtype}: the kernel needs bf16/f16 of one dtype, "
                         f"T a multiple of {_COMPUTE_WGS * bs.block_m}, D of {bs.block_k}, F of {bs.block_n}")
    if bs.smem_bytes(x.dtype.itemsize) > _SMEM_BYTES:
        raise ValueError(f"block_sizes={bs} need {bs.smem_bytes(x.dtype.itemsize)} bytes of shared memory; "
                         f"Hopper has {_SMEM_BYTES}")
    T, D = x.shape
    F = w.shape[2]
    kernel = plgpu.kernel(
        functools.partial(_kernel, bs=bs),
        out_type=jax.ShapeDtypeStruct((T, F), x.dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(x, w.reshape(D, 2 * F))
