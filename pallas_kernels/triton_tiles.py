"""Shape helpers shared by the Pallas Triton kernels (tiles must be powers of two)."""

from __future__ import annotations


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())
