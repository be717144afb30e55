"""Pure-jnp ragged paged attention: the oracle every implementation is tested against (the CPU runs
xla.py, which does only the batch's work; this attends every token to the whole page table).

KV layout (one array per layer):  kv_pages: [P, G, 2K, H]
  P pages of G tokens; along the third axis, index 2k holds K of KV head k and 2k+1 its V, so a
  tensor-parallel split of that axis keeps each KV head's K and V on the same device.
Ragged query layout: q[cu_q_lens[s]:cu_q_lens[s+1]] are the queries of sequence s, the last
  q_len tokens of its KV (kv_lens[s] includes them); they attend causally. Tokens at or past
  cu_q_lens[num_seqs] are padding: their outputs are finite (zero) and nothing reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


# The oracle computes in true f32 everywhere: XLA's default f32 dot on GPU is TF32 (~1e-3 relative
# error), which would make the reference the least accurate side of every comparison.
_HIGHEST = jax.lax.Precision.HIGHEST


def _token_seq_ids(cu_q_lens, num_seqs, T):
    """i32[T] sequence id of each token, and bool[T] whether it is a real (non-padding) token."""
    t = jnp.arange(T, dtype=jnp.int32)
    S = cu_q_lens.shape[0] - 1
    # Counting boundaries (rather than searchsorted) stays correct when entries past num_seqs are junk.
    live = jnp.arange(S, dtype=jnp.int32) < num_seqs[0]
    seq = jnp.sum((cu_q_lens[1:][None, :] <= t[:, None]) & live[None, :], axis=1).astype(jnp.int32)
    # tokens before cu_q_lens[0] are padding too (the kernels skip them): they wrote into sequence 0's pages
    valid = (t >= cu_q_lens[0]) & (t < cu_q_lens[num_seqs[0]])
    return jnp.minimum(seq, S - 1), valid


def kv_write_slots(
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    num_tokens: int,
    *,
    page_size: int,
    num_slots: int,
) -> jax.Array:  # i32[num_tokens]
    """Flat cache slot (page * page_size + offset, into a [P * G, ...] view) of each token's new K/V.

    Token t of sequence s sits at KV position kv_lens[s] - q_len + (t - cu_q_lens[s]) and goes to
    page_indices[s, pos // G] * G + pos % G. Padding tokens get `num_slots` (= P * G, one past the
    pool): the reference's scatter drops it and the kernels mask it. Every write path uses this."""
    G = page_size
    seq, valid = _token_seq_ids(cu_q_lens, num_seqs, num_tokens)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq])
    page = page_indices[seq, jnp.clip(pos // G, 0, page_indices.shape[1] - 1)]
    return jnp.where(valid, page * G + pos % G, num_slots).astype(jnp.int32)


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """k, v [T, K, H] -> [T, 2K, H] in the pool's row order: row 2h is K of head h, 2h + 1 its V."""
    T, K, H = k.shape
    return jnp.stack([k, v], axis=2).reshape(T, 2 * K, H)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split ("rotate_half") RoPE, the form HF checkpoints use, computed in f32 and rounded to
    x's dtype. x: [T, heads, H]; cos, sin: f32[T, H/2]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def split_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merged [T, K, R + 2, H] rows (per KV head: its R query heads, its k, its v) -> q [T, K * R, H],
    k [T, K, H], v [T, K, H]. Query head g * R + r reads KV head g (standard GQA order)."""
    T, K, R2, H = qkv.shape
    return qkv[:, :, :R2 - 2].reshape(T, K * (R2 - 2), H), qkv[:, :, R2 - 2], qkv[:, :, R2 - 1]


def ref_write_qkv(
    kv_pages: jax.Array,  # [P, G, 2K, H]
    qkv: jax.Array,  # [T, K, R + 2, H]
    cos: jax.Array,  # f32[T, H/2]
    sin: jax.Array,  # f32[T, H/2]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
) -> tuple[jax.Array, jax.Array]:  # (q [T, K * R, H] qkv.dtype, kv_pages)
    """A step's attention input from the merged QKV projection: RoPE on q and k, k and v written
    to their page slots (ref_write_kv_pages), q returned for attention."""
    q, k, v = split_qkv(qkv)
    return rope(q, cos, sin), ref_write_kv_pages(kv_pages, rope(k, cos, sin), v, kv_lens, page_indices,
                                                 cu_q_lens, num_seqs)


def ref_write_kv_pages(
    kv_pages: jax.Array,  # [P, G, 2K, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
) -> jax.Array:  # [P, G, 2K, H]
    """Write this step's K/V of every real token into its page slot; padding tokens write nothing."""
    P, G, K2, H = kv_pages.shape
    T = k.shape[0]
    slot = kv_write_slots(kv_lens, page_indices, cu_q_lens, num_seqs, T, page_size=G, num_slots=P * G)
    new = interleave_kv(k, v).astype(kv_pages.dtype)
    flat = kv_pages.reshape(P * G, K2, H).at[slot].set(new, mode="drop")
    return flat.reshape(P, G, K2, H)


def write_kv_cost_estimate(kv_pages, new) -> pl.CostEstimate:
    """What the write must move: the merged rows new [T, K, R + 2, H] read once, k and v written to
    the pool and the R query rows (if any) written out, plus the slot of each token. Write kernels
    pass this to pallas_call."""
    T, K, R2, H = new.shape
    itemsize = jnp.dtype(new.dtype).itemsize
    return pl.CostEstimate(
        flops=0,
        transcendentals=0,
        bytes_accessed=int(T * K * H * ((2 * R2 - 2) * itemsize + 2 * jnp.dtype(kv_pages.dtype).itemsize) + 4 * T),
    )


def ref_ragged_paged_attention(
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
) -> jax.Array:  # [T, N, H], q.dtype
    T, N, H = q.shape
    P, G, K2, _ = kv_pages.shape
    K = K2 // 2
    S, P_max = page_indices.shape
    L = P_max * G
    t = jnp.arange(T, dtype=jnp.int32)
    kv_pos = jnp.arange(L, dtype=jnp.int32)
    qg = q.astype(jnp.float32).reshape(T, K, N // K, H)

    def one_seq(s, out):
        live = s < num_seqs[0]
        q_start, q_end, kv_len = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
        kv = kv_pages[page_indices[s]].reshape(L, K, 2, H).astype(jnp.float32)
        kv = jnp.where((kv_pos < kv_len)[:, None, None, None], kv, 0.0)  # unused slots may hold NaN
        in_seq = live & (t >= q_start) & (t < q_end)
        q_pos = kv_len - (q_end - q_start) + (t - q_start)
        mask = in_seq[:, None] & (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_len)
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        logits = jnp.einsum("tkgh,lkh->tkgl", qg, kv[:, :, 0], precision=_HIGHEST) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("tkgl,lkh->tkgh", p, kv[:, :, 1], precision=_HIGHEST) / jnp.where(denom > 0, denom, 1.0)
        return jnp.where(in_seq[:, None, None, None], o, out)

    out = jax.lax.fori_loop(0, S, one_seq, jnp.zeros((T, K, N // K, H), jnp.float32))
    return out.reshape(T, N, H).astype(q.dtype)


def ref_cost_estimate(q, kv_pages, page_indices, *, soft_cap=None) -> pl.CostEstimate:
    """The work the reference's math implies for these shapes, as a static upper bound.

    Every query token attends to at most P_max * G keys (4 flops per key and head dim: QK^T and PV;
    one exp per logit, one tanh more with a soft cap); KV is read once per sequence, so at most
    min(P, S * P_max) pages; q is read and the output written once. Kernels pass this to
    pallas_call so XLA can schedule around them.
    """
    T, N, H = q.shape
    P, G, K2, _ = kv_pages.shape
    S, P_max = page_indices.shape
    keys = P_max * G
    itemsize = jnp.dtype(kv_pages.dtype).itemsize
    kv_bytes = min(P, S * P_max) * G * K2 * H * itemsize
    qo_bytes = 2 * T * N * H * jnp.dtype(q.dtype).itemsize
    meta_bytes = 4 * (page_indices.size + 2 * S + 2)
    return pl.CostEstimate(
        flops=int(4 * T * N * H * keys),
        transcendentals=int(T * N * keys * (2 if soft_cap is not None else 1)),
        bytes_accessed=int(kv_bytes + qo_bytes + meta_bytes),
    )
