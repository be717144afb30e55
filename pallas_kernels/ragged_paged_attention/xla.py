"""Ragged paged attention in plain jnp that does only the work the batch holds: the CPU's (and any
platform's without a Pallas kernel). Same contract as reference.ref_ragged_paged_attention. Not for
GPUs: its loops run to traced bounds, and XLA's GPU runtime copies such a loop's predicate to the host
every iteration (tests/runtime/test_step.py); GPU head dims the Triton kernel does not tile run the
reference.

Why not the reference: the oracle attends every token of the batch to all P_max * G slots of the
page table once per sequence row, so its cost grows with S * T * max_model_len whatever the batch
holds. Serving SmolLM2-135M on this workplace's 2-core CPU (configs/serve_cpu.yaml: max_model_len
2048, 8 sequences) spent ~80% of a decode step of 428 ms there (docs/benchmarks.md, "CPU serving").

How: work items, each a tile of `q_tokens_per_block` consecutive query tokens of one sequence; an
item walks only the key blocks (`kv_pages_per_block` pages) its causal window, and a sliding window's
lower edge, reach, with an online softmax in f32 (the reference's precision). Both loops run to
traced bounds (XLA while loops), so one compiled program serves every batch of its bucket, and the
cost follows sum(q_len * kv_len) over the sequences rather than the bucket's maxima.

A token's result depends only on its own sequence's keys and the two static sizes: a key block that
masks every key of a row leaves that row's running max, sum and accumulator bit for bit as they were
(exp(-inf) is 0), so neither the other rows of its tile, nor how many blocks the tile walks, nor the
batch's other sequences change it. (The tile's width changes the dots' blocking in the last bits, as
a bucket's T does the model's matmuls.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention.common import BlockSizes, validate_inputs

# The oracle's precision: true f32 dots (XLA's default f32 dot on GPU is TF32).
_HIGHEST = lax.Precision.HIGHEST
_KV_BLOCK_KEYS = 64  # keys a block reads by default (CPU sweep in default_block_sizes)


def default_block_sizes(q, kv_pages, page_indices, *, decode_only: bool = False) -> BlockSizes:
    """Tiles of 16 query tokens in buckets of prefill chunks (>= 8 tokens a sequence on average),
    else, and in decode-only steps (`decode_only`: at most one token a sequence), of one: a wider
    tile computes rows no token fills (one decode over 1,000 keys: 1.19 ms in a tile of 16, 0.43 in
    one of 1, this workplace's CPU). Blocks of ~64 keys: at 8 decodes over 50-1,000 keys they beat
    16 and 256 (0.23-3.4 ms against 0.26-3.6 and 1.1-4.2)."""
    T, S = q.shape[0], page_indices.shape[0]
    G, P_max = kv_pages.shape[1], page_indices.shape[1]
    return BlockSizes(q_tokens_per_block=min(T, 16) if T >= 8 * S and not decode_only else 1,
                      kv_pages_per_block=max(1, min(P_max, _KV_BLOCK_KEYS // G)))


def xla_ragged_paged_attention(
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
    decode_only: bool = False,
) -> jax.Array:  # [T, N, H], q.dtype
    """Attention of the ragged batch over paged KV (see the module docstring). block_sizes: its
    q_tokens_per_block and kv_pages_per_block are the tile and key block (the other fields are the
    kernels'); None: default_block_sizes, told `decode_only` (at most one token a sequence)."""
    validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    bs = block_sizes or default_block_sizes(q, kv_pages, page_indices, decode_only=decode_only)
    return _xla_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=float(sm_scale),
                          sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
                          q_tile=min(bs.q_tokens_per_block, q.shape[0]),
                          pages_per_block=min(bs.kv_pages_per_block, page_indices.shape[1]))


# The name marks its loops in a program's HLO (op_name ".../jit(_xla_attention)/while"), the only ones
# of a step program allowed a trip count known only at run time (tests/runtime/test_step.py).
@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "q_tile", "pages_per_block"))
def _xla_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap,
                   q_tile, pages_per_block):
    T, N, H = q.shape
    _, G, K2, _ = kv_pages.shape
    K, R = K2 // 2, N // (K2 // 2)
    S, P_max = page_indices.shape
    tq, ppb = q_tile, pages_per_block
    B = ppb * G  # keys a block
    f32 = jnp.float32
    live = jnp.arange(S, dtype=jnp.int32) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # entries past num_seqs are junk
    n_items = (q_lens + tq - 1) // tq  # i32[S]: tiles of each sequence's queries
    items_end = jnp.cumsum(n_items)
    qg = q.astype(f32).reshape(T, K, R, H)
    t = jnp.arange(tq, dtype=jnp.int32)
    kb = jnp.arange(B, dtype=jnp.int32)

    def item(i, out):  # out: f32[T, K, R, H]
        s = jnp.sum(items_end <= i).astype(jnp.int32)  # the sequence of item i (i < items_end[-1])
        start, q_len, kv_len = cu_q_lens[s], q_lens[s], kv_lens[s]
        j = i - (items_end[s] - n_items[s])  # the item's tile within its sequence
        rows = start + j * tq + t  # i32[tq]
        row_ok = rows < start + q_len
        q_pos = kv_len - q_len + (rows - start)  # each row's position in its sequence
        qi = jnp.where(row_ok[:, None, None, None], qg[jnp.clip(rows, 0, T - 1)], 0.0)  # padding may be NaN
        end = jnp.minimum(kv_len, q_pos[0] + tq)  # keys [0, end) hold every key a row of the tile sees
        lo = 0 if sliding_window is None else jnp.maximum(q_pos[0] - sliding_window + 1, 0) // B

        def block(b, carry):
            m, l, acc = carry  # f32[tq, K, R], f32[tq, K, R], f32[tq, K, R, H]
            pages = page_indices[s, jnp.clip(b * ppb + jnp.arange(ppb), 0, P_max - 1)]
            kv = jnp.take(kv_pages, pages, axis=0, mode="clip").reshape(B, K, 2, H).astype(f32)
            pos = b * B + kb
            kv = jnp.where((pos < kv_len)[:, None, None, None], kv, 0.0)  # unwritten slots may hold NaN
            logits = jnp.einsum("tkrh,bkh->tkrb", qi, kv[:, :, 0], precision=_HIGHEST) * sm_scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            mask = row_ok[:, None] & (pos[None, :] <= q_pos[:, None])  # a real row's q_pos < kv_len
            if sliding_window is not None:
                mask &= pos[None, :] > q_pos[:, None] - sliding_window
            logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(logits - base[..., None])
            scale = jnp.exp(m - base)  # 0 while m is -inf, 1 where no key of the block is seen
            acc = acc * scale[..., None] + jnp.einsum("tkrb,bkh->tkrh", p, kv[:, :, 1], precision=_HIGHEST)
            return m_new, l * scale + jnp.sum(p, axis=-1), acc

        init = (jnp.full((tq, K, R), -jnp.inf, f32), jnp.zeros((tq, K, R), f32), jnp.zeros((tq, K, R, H), f32))
        _, l, acc = lax.fori_loop(lo, (end + B - 1) // B, block, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return out.at[jnp.where(row_ok, rows, T)].set(o, mode="drop")  # rows of other sequences dropped

    out = lax.fori_loop(0, items_end[-1], item, jnp.zeros((T, K, R, H), f32))
    return out.reshape(T, N, H).astype(q.dtype)
