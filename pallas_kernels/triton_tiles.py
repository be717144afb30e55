"""Helpers shared by the Pallas Triton kernels: tile shapes (tiles must be powers of two, a dot at
least 16 rows), loads of the partial products dispatch.gemv_partials leaves, and the early launch of
the next kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


MIN_DOT_ROWS = 16  # Triton's dot takes at least 16 rows; GEMVs pad fewer in registers


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def check_block_sizes(bs, *, dot_dims: tuple[str, str]) -> None:
    """Validate a Triton GEMV's BlockSizes dataclass `bs`: its two tile dims `dot_dims` (the output
    columns and block_k) and num_warps positive powers of two, the tile dims at least 16 (Triton's
    smallest dot), num_stages a positive int. Raises ValueError naming the bad field."""
    for name in (*dot_dims, "num_warps"):
        v = getattr(bs, name)
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v!r} must be a positive power of two")
    if min(getattr(bs, name) for name in dot_dims) < MIN_DOT_ROWS:
        dims = " and ".join(f"{name}={getattr(bs, name)}" for name in dot_dims)
        raise ValueError(f"{dims} must be at least {MIN_DOT_ROWS} (Triton's dot)")
    if not isinstance(bs.num_stages, int) or bs.num_stages < 1:
        raise ValueError(f"num_stages={bs.num_stages!r} must be a positive int")


def contraction_block(D: int, block_k: int) -> int:
    """A GEMV's contraction step for a hidden size D: block_k, or the largest power of two dividing
    D if that is smaller (576 -> 64); 0 if it would be below 16 (Triton's smallest dot)."""
    bk = min(block_k, D & -D) if D > 0 else 0
    return bk if bk >= 16 else 0


def load_parts(ref, rows, cols, *, parts: int, part_rows: int, mask, dtype):
    """f32 ref[rows, cols] (masked lanes 0), or with parts > 1 the sum of the `parts` partial products
    stored one after the other in ref (part p's row r at r + p * part_rows), rounded to `dtype`: what
    the GEMV would have written."""
    return sum_parts(load_part_tiles(ref, rows, cols, parts=parts, part_rows=part_rows, mask=mask), dtype)


def load_part_tiles(ref, rows, cols, *, parts: int, part_rows: int, mask) -> list:
    """load_parts' loads alone: each part's tile ref[rows + p * part_rows, cols] (masked lanes 0), nothing
    computed on them yet, so that a kernel can issue other loads before it waits on these."""
    return [plgpu.load(ref.at[rows + p * part_rows, cols], mask=mask, other=0.0) for p in range(parts)]


def sum_parts(tiles: list, dtype):
    """load_parts' arithmetic on load_part_tiles' tiles: one tile as f32, or the f32 sum of several
    rounded to `dtype`."""
    x = tiles[0].astype(jnp.float32)
    if len(tiles) > 1:
        for t in tiles[1:]:
            x += t
        x = x.astype(dtype).astype(jnp.float32)
    return x


def early_launch_enabled(interpret: bool) -> bool:
    """Whether a kernel lowered with this `interpret` flag emits `launch_dependents`: on GPUs that
    have the instruction, never in interpret mode."""
    return not interpret and early_launch_supported()


@functools.cache
def early_launch_supported() -> bool:
    """Whether this process's GPU has programmatic dependent launch (NVIDIA sm_90 and newer:
    `griddepcontrol`). False without a GPU, so CPU runs never emit the instruction."""
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return False
    try:
        return float(getattr(device, "compute_capability", "0")) >= 9.0
    except ValueError:  # not a CUDA compute capability (ROCm's gfx names)
        return False


def launch_dependents(idx: jax.Array, enabled: bool) -> jax.Array:
    """idx (int32) unchanged, after `griddepcontrol.launch_dependents` when enabled: the kernel that
    follows this one in the stream may launch now instead of when this one's programs exit.

    XLA launches every Pallas Triton kernel with programmatic dependent launch and puts
    `griddepcontrol.wait` at the entry of each one (jax 0.11.2 on Hopper: use_pdl on every launch
    of the step's CUDA graph), so a kernel that launches early still waits for this one to complete
    and for its writes before it runs; what it gains is its launch and the scheduling of its programs
    while this kernel works. Without the trigger the next kernel launches only when every program
    here has exited. An XLA kernel that follows without PDL (cuBLAS) is not affected.

    The instruction is inline assembly whose (zero) result is added to idx, so the compiler keeps it
    and issues it before idx's first use; call it on the first index vector a kernel computes.
    enabled: `early_launch_enabled(interpret)` of the kernel's call."""
    if not enabled:
        return idx
    [zero] = plgpu.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;", args=[idx], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(idx.shape, jnp.int32)])
    return idx + zero
