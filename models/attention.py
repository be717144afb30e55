"""Attention metadata: the per-step description of the ragged batch that the model reads K/V with.

These four arrays are exactly the ragged paged attention kernel's batch arguments (see
pallas_kernels/ragged_paged_attention/reference.py for the layout). The engine's step packer builds
them padded to a bucket; `AttentionMetadata.build` is the simple host-side packer for tests, scripts
and one-shot generation.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np


class AttentionMetadata(NamedTuple):
    kv_lens: jax.Array  # i32[S]: KV length of each sequence, this step's tokens included
    page_indices: jax.Array  # i32[S, P_max]: pages of each sequence in order
    cu_q_lens: jax.Array  # i32[S + 1]: offsets of each sequence's queries in the token buffer
    num_seqs: jax.Array  # i32[1]: entries past this are padding

    @classmethod
    def build(
        cls,
        kv_lens: Sequence[int],
        q_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        *,
        max_seqs: int | None = None,
        pages_per_seq: int | None = None,
    ) -> AttentionMetadata:
        """Pack per-sequence lengths and page lists into padded numpy arrays (host side)."""
        n = len(kv_lens)
        if not (len(q_lens) == len(page_tables) == n):
            raise ValueError(
                f"kv_lens, q_lens and page_tables must have one entry per sequence; got {n}, "
                f"{len(q_lens)}, {len(page_tables)}"
            )
        S = max_seqs or max(n, 1)
        if n > S:
            raise ValueError(f"{n} sequences do not fit max_seqs={S}")
        P_max = pages_per_seq or max([len(p) for p in page_tables] + [1])
        pages = np.zeros((S, P_max), np.int32)
        for i, p in enumerate(page_tables):
            if len(p) > P_max:
                raise ValueError(f"sequence {i} has {len(p)} pages; pages_per_seq is {P_max}")
            pages[i, : len(p)] = p
        for i, (kl, ql) in enumerate(zip(kv_lens, q_lens)):
            if not 0 <= ql <= kl:
                raise ValueError(f"sequence {i}: q_len {ql} must be in [0, kv_len={kl}]")
        kvl = np.zeros((S,), np.int32)
        kvl[:n] = kv_lens
        cu = np.zeros((S + 1,), np.int32)
        cu[1 : n + 1] = np.cumsum(q_lens)
        cu[n + 1 :] = cu[n]
        return cls(kvl, pages, cu, np.array([n], np.int32))
