"""The persistent, warp-specialized Hopper (sm_90) GEMM skeleton of the Mosaic GPU kernels whose
epilogues fuse what XLA would run as a kernel of its own: pallas_kernels/swiglu (silu(gate) * up)
and pallas_kernels/greedy_head (the LM head's argmax).

Structure (jax's Hopper matmul example, jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py): one
CTA per SM loops over output tiles; a memory warpgroup streams a row block of x and one tile of each
weight operand with TMA into a ring of `num_stages` shared-memory buffers; two compute warpgroups
take `block_m` rows each and issue wgmma into one f32 accumulator per weight operand, then hand the
accumulators' values to the kernel's epilogue.

Mosaic GPU has no CPU interpreter for these kernels (its interpret mode does not support the
warpgroup-collective scratch): CPU tests trace and lower them for CUDA; the GPU tests run them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WGS = 2
SMEM_BYTES = 227 * 1024  # H100 / H200 per-block shared memory
_DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_m: rows per compute warpgroup (a CTA takes 2 * block_m); block_n: columns of each weight
    operand per CTA; block_k: the reduction step; num_stages: buffers in the TMA ring; group_n:
    column blocks per group of the tile order (kernels that use it say how)."""

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
        if self.block_n % 64 or self.block_k % 64:
            raise ValueError(f"block_n={self.block_n} and block_k={self.block_k} must be multiples of 64")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be >= 2")

    @property
    def cta_m(self) -> int:
        return COMPUTE_WGS * self.block_m

    def ring_bytes(self, itemsize: int, num_w: int) -> int:
        """Shared memory of the TMA ring: x's row block and num_w weight tiles per stage."""
        return itemsize * self.num_stages * self.block_k * (self.cta_m + num_w * self.block_n)


def check_smem(bs: BlockSizes, total_bytes: int) -> None:
    if total_bytes > SMEM_BYTES:
        raise ValueError(f"block_sizes={bs} need {total_bytes} bytes of shared memory; Hopper has {SMEM_BYTES}")


def num_sms() -> int:
    try:
        return int(jax.devices()[0].core_count)
    except (AttributeError, TypeError, RuntimeError):
        return _DEFAULT_NUM_SMS


def smem_transforms(dtype, cols: int):
    """TMA tiling and swizzle of shared-memory tiles, swizzled for rows of `cols` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def tile_loop(x_gmem, w_gmems: Sequence, *, bs: BlockSizes, num_tiles: int, transpose_w: bool,
              tile: Callable, w_block: Callable, epilogue: Callable, scratch: dict) -> None:
    """The kernel body: for each output tile of this SM (tiles 0..num_tiles-1 spread over the "sm"
    axis), `tile(idx) -> (mi, ni)`; the CTA's rows are x[mi * cta_m:][:cta_m]; weight operand j
    contributes the columns `w_block(ni, j)` (a pl.ds) of w_gmems[j], a [D, N] matrix, or of its
    transpose when `transpose_w` (w_gmems[j] is then [N, D], as a tied embedding is). Each compute
    warpgroup (index `wg`) accumulates its block_m rows into one f32 [block_m, block_n] value per
    operand and calls `epilogue(accs, mi=, ni=, wg=, **scratch_refs)`, with `scratch` the extra
    shared-memory allocations (name -> plgpu.SMEM), one of each per CTA."""
    T, D = x_gmem.shape
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    cta_m = bs.cta_m
    dtype = x_gmem.dtype
    transforms = smem_transforms(dtype, bk)  # every operand tile's (a transposed weight's has block_k minor)
    w_shape, w_index = ((bn, bk), lambda k: (0, k)) if transpose_w else ((bk, bn), lambda k: (k, 0))

    def pipeline(body, compute_context):
        w_spec = plgpu.BlockSpec(w_shape, w_index, transforms=transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(D // bk,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, bk), lambda k: (0, k), transforms=transforms,
                                      memory_space=plgpu.SMEM), *[w_spec] * len(w_gmems)],
            wg_axis="wg", num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=bs.num_stages,
            compute_context=compute_context)

    ignore = lambda *_, **__: None  # the allocations do not depend on the body

    @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(x_gmem, *w_gmems),
                       collective_axes="wg", **scratch)
    def _scope(allocs, **scratch_refs):
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * bm, bm)

        @plgpu.nd_loop((num_tiles,), collective_axes="sm")
        def _tile(info):
            (idx,) = info.index
            mi, ni = tile(idx)

            def compute_context(run):
                @functools.partial(pl.run_scoped, accs=tuple(plgpu.ACC((bm, bn), jnp.float32) for _ in w_gmems))
                def _acc(accs):
                    run(accs)
                    epilogue(tuple(a[...] for a in accs), mi=mi, ni=ni, wg=wg, **scratch_refs)

            def mma(_, x_smem, *rest):
                *w_smems, accs = rest
                for acc, w_smem in zip(accs, w_smems):
                    plgpu.wgmma(acc, x_smem.at[wg_rows], plgpu.transpose_ref(w_smem, (1, 0)) if transpose_w else w_smem)
                plgpu.wgmma_wait(0)
                return accs

            w_tiles = [w.at[w_block(ni, j)] if transpose_w else w.at[:, w_block(ni, j)] for j, w in enumerate(w_gmems)]
            pipeline(mma, compute_context)(x_gmem.at[pl.ds(mi * cta_m, cta_m), :], *w_tiles, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def hopper_kernel(body: Callable, out_shape, **kwargs):
    """plgpu.kernel for tile_loop bodies: one CTA per SM (axis "sm"), the compute warpgroups and
    the memory warpgroup (axis "wg"), warpgroup lowering semantics."""
    return plgpu.kernel(
        body, out_type=out_shape, grid=(num_sms(),), grid_names=("sm",), num_threads=COMPUTE_WGS + 1,
        thread_name="wg", compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kwargs)
