"""Ragged paged attention on NVIDIA GPUs through Pallas' Triton lowering.

Work decomposition (all static shapes, so one compile serves every batch of a given padding):
  * a work item is up to `q_tokens_per_block` query tokens of ONE sequence; the item table
    (sequence, first token, and the sequence's query range and KV length, so that a program's first
    loads do not wait on one another) is built with a few jnp ops before the launch, with a static
    upper bound of min(T, cdiv(T, bq) + S) items. Unused items write zeros to the padding tokens' rows
    (without splits; with splits the merge does), so no select over the output follows the call
    (one a layer, 15 ms of the offline run on an H100);
  * grid = (items, KV heads / kv_heads_per_block, kv_splits). A program stacks the q heads of its
    KV heads as matmul rows (rows = tokens x KV heads x q heads per KV head, padded to a power of
    two >= 16, Triton's minimum), so each K/V row is read once per KV head, not once per q head:
    decode is bandwidth bound. With several KV heads a program, their keys lie side by side in
    one K tile and a row's logits outside its own head's columns are masked (decode batches at
    head dim 64: fewer, longer programs);
  * it walks the keys its rows can see (causal upper end, sliding-window lower end) in blocks of
    kv_pages_per_block * G keys, gathering K/V rows token by token through the page table
    (page_indices[s, pos // G] * G + pos % G), so the block size is independent of the page size
    and nothing past a sequence's length is read; masked loads return 0 there. In buckets of
    prefill chunks the blocks every row sees whole (below the diagonal) go first, in a loop with
    no mask;
  * kv_splits > 1 divides each item's key range among programs (flash-decoding); each writes a
    normalised partial output and its log-sum-exp (zeros and -inf where it saw no key), merged by a
    second small kernel (a program per output row, all its loads issued at once, zeros for padding
    tokens). That is what fills the GPU when there are few sequences and long contexts (8 x 32k:
    64 (item, head) programs for 132 SMs without it).
Softmax uses exp2 with log2(e) folded into the scale. f32 inputs use IEEE f32 dots (Triton's f32
default is TF32, ~1e-3 relative error).

`write_qkv_attention` runs both for decode steps (at most one token a sequence: the engine's decode
bursts) in one launch: the attention RoPEs q and the token's own k from the projection, reads only
the keys before it from the pages, and writes k and v (split 0). Its loads go out before its
arithmetic and its store (with splits, the first key block's too): a batch-1 step waits on each
kernel's chain of round trips to memory, not on its bytes.

The step's KV write on its own (steps with prefill tokens): gpu_write.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.common import BlockSizes, validate_inputs
from pallas_kernels.ragged_paged_attention.gpu_write import check_head_dim, check_qkv
from pallas_kernels.ragged_paged_attention.reference import ref_cost_estimate
from pallas_kernels.triton_tiles import (early_launch_enabled, launch_dependents, load_part_tiles, next_pow2,
                                          sum_parts)

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
_DEFAULT_NUM_SMS = 132  # H100 / H200 SXM; used when the device does not report core_count


def _num_sms() -> int:
    try:
        return int(jax.devices()[0].core_count)
    except (AttributeError, TypeError, RuntimeError):
        return _DEFAULT_NUM_SMS


def prefill_shaped(T: int, S: int) -> bool:
    """A bucket of prefill chunks: >= 8 tokens a sequence on average (static shapes)."""
    return T >= 8 * S


def default_block_sizes(q, kv_pages, page_indices) -> BlockSizes:
    T, N, H = q.shape
    _, G, K2, _ = kv_pages.shape
    K = K2 // 2
    S, P_max = page_indices.shape
    q_per_kv = N // K
    # Decode-heavy batches have one token per sequence: a few tokens per item keeps rows >= 16.
    # Buckets of prefill chunks (>= 8 tokens a sequence on average) stack 64 rows: 16 x 512-token
    # prompts ran ~12% faster than with 16 rows (H200 sweep, docs/benchmarks.md).
    rows = 64 if prefill_shaped(T, S) else 16
    bq = max(1, min(rows // q_per_kv if q_per_kv < rows else 1, T))
    # H200 sweeps (docs/kernels/ragged_paged_attention.md): 64 keys per step, 4 warps, 2 stages and
    # about 2 programs per SM (64 x 4k: 1 split; 8 x 32k: 8) were best or within run-to-run noise
    # (~4%) of the best at 64 x 4k and 8 x 32k with pages of 16 and 64 (head dim 128).
    ppb = _pages_per_block(64, G, P_max)
    keys_per_seq = P_max * G
    items = max(min(S, T), pl.cdiv(T, bq))
    splits = next_pow2(pl.cdiv(2 * _num_sms(), items * K))
    # At most one split per key block of the longest sequence the table holds (it was one per four
    # blocks). Each sequence's blocks are dealt to its first splits at run time; the programs of the
    # splits a short context leaves empty end at once, so they cost little: llama3_2_1b at batch 1
    # over 512 keys of a 592-key table, attention + merge took 5.9 us a layer with 10 splits against
    # 8.2 with 3 and XLA's merge (H100, docs/benchmarks.md "eighteenth session").
    splits = max(1, min(splits, pl.cdiv(keys_per_seq, ppb * G)))
    kh = 1
    if splits == 1 and not prefill_shaped(T, S):
        # Decode batches that fill the GPU without splits: K tiles of 8k elements (128 keys at head
        # dim 64) were 3-6% faster than 64 keys at 256 sequences x 512-768 keys of llama3_2_1b
        # (H200, docs/benchmarks.md "sixteenth session"); at head dim 128 this stays 64.
        keys = max(64, 8192 // H)
        # At head dim 64, up to 4 KV heads a program share those 8k elements (4 x 32 keys): fewer,
        # longer programs, while >= 3 per SM remain. 256 sequences x 512-768 keys ran 2-5% faster
        # (H100: 126.2 against 129.2 us at 640 keys); 64 x 4k, with only 128 such programs, 20%
        # slower, and head dim 128 gained nothing (docs/kernels/ragged_paged_attention.md).
        while (H <= 64 and kh < 4 and K % (2 * kh) == 0 and keys // (2 * kh) >= G
               and items * K // (2 * kh) >= 3 * _num_sms()):
            kh *= 2
        ppb = _pages_per_block(keys // kh, G, P_max)
        bq = max(1, min(rows // (kh * q_per_kv), T))
    return BlockSizes(q_tokens_per_block=bq, kv_pages_per_block=ppb, kv_heads_per_block=kh, kv_splits=splits,
                      num_warps=4, num_stages=2)


def pages_fit(G: int, P_max: int) -> bool:
    """Whether pages of G tokens in tables of P_max pages make the key blocks the kernel needs (a
    power of two >= 16 keys) at every size default_block_sizes picks (16 keys at the least): not
    for G = 24, nor for G = 8 with one page a sequence."""
    return G & (G - 1) == 0 and G * _pages_per_block(16, G, P_max) >= 16


def _pages_per_block(keys: int, G: int, P_max: int) -> int:
    """Pages per key block for about `keys` keys: a power of two (Triton's key block must be one), at
    most the page table's width (a 40-token prompt's table of 3 pages takes 2, not 3)."""
    return 1 << (max(1, min(P_max, keys // G)).bit_length() - 1)


def check_block_sizes(bs: BlockSizes, q, kv_pages, page_indices) -> tuple[int, int, int, int]:
    """(q tokens, keys, KV heads, splits) per program, or ValueError naming the size that does not fit."""
    T, N, H = q.shape
    G, K = kv_pages.shape[1], kv_pages.shape[2] // 2
    P_max = page_indices.shape[1]
    bkv = bs.kv_pages_per_block * G
    if bs.kv_pages_per_block > P_max:
        raise ValueError(f"kv_pages_per_block={bs.kv_pages_per_block} exceeds page_indices.shape[1]={P_max}")
    if bkv & (bkv - 1) or bkv < 16:
        raise ValueError(f"kv_pages_per_block * page size = {bs.kv_pages_per_block} * {G} = {bkv} keys; "
                         "Triton needs a power of two >= 16")
    check_head_dim(H)
    default = None
    if bs.kv_splits is None or bs.kv_heads_per_block is None:
        default = default_block_sizes(q, kv_pages, page_indices)
    splits = bs.kv_splits if bs.kv_splits is not None else default.kv_splits
    kh = bs.kv_heads_per_block if bs.kv_heads_per_block is not None else default.kv_heads_per_block
    if K % kh or kh & (kh - 1):
        raise ValueError(f"kv_heads_per_block={kh} must be a power of two that divides K={K}")
    return min(bs.q_tokens_per_block, T), bkv, kh, splits


def _kernel(
    items_ref,  # i32[5 * W + 2]: each work item's sequence (-1 if unused), first query token, and its
    #             sequence's cu_q_lens[s], cu_q_lens[s + 1] and kv_lens[s], W items a field; then the
    #             real tokens' bounds cu_q_lens[0], cu_q_lens[num_seqs] (_item_table)
    page_indices_ref,  # i32[S * P_max]
    q_ref,  # [T * N, H]; with decode_write, the merged projection's rows [qkv_parts * T * K * (R + 2), H]
    kv_ref,  # [P * G * 2K, H]
    *refs,  # (cos, sin f32[T, H/2])? o, (lse,)?, (pool out, aliased to kv_ref)?
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_heads: int,
    num_kv_heads: int,
    kv_heads: int,
    page_size: int,
    pages_per_seq: int,
    q_tokens: int,
    rows: int,
    kv_block: int,
    kv_splits: int,
    unmasked_full_blocks: bool,
    decode_write: bool,
    qkv_parts: int,
    early_launch: bool,
):
    # o_ref: [T * N, H] q.dtype (kv_splits == 1), else f32[kv_splits, T * N, H]; lse_refs: () or
    # (f32[kv_splits, T * N] log2-sum-exp2 per row,)
    if decode_write:
        cos_ref, sin_ref, *refs, kv_out_ref = refs
    o_ref, *lse_refs = refs
    i, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_per_kv = num_heads // num_kv_heads
    num_tokens = o_ref.shape[-2] // num_heads
    # The item's fields in one round trip to memory: none of these loads waits on another.
    W = (items_ref.shape[0] - 2) // 5
    s, q0, q_start, q_end, kv_len = (items_ref[f * W + i] for f in range(5))
    # Row r: token r // (kv_heads * q_per_kv) of the item, KV head row_head, q head row_q.
    r = launch_dependents(jnp.arange(rows, dtype=jnp.int32), early_launch)
    row_tok = lax.div(r, kv_heads * q_per_kv)
    row_head = hb * kv_heads + lax.rem(lax.div(r, q_per_kv), kv_heads)
    row_q = row_head * q_per_kv + lax.rem(r, q_per_kv)
    row_used = r < q_tokens * kv_heads * q_per_kv
    f32 = jnp.float32
    q_dtype = kv_ref.dtype if decode_write else q_ref.dtype  # decode_write's q: RoPE'd, rounded to the cache's
    precision = lax.Precision.HIGHEST if q_dtype == jnp.float32 else None

    if kv_splits == 1:
        # An unused item zeroes up to q_tokens padding tokens (those before cu_q_lens[0] and from
        # cu_q_lens[num_seqs] on; its token field holds its first index among them): the step's padding
        # rows come out as zeros with no select over the whole output after the call. There are
        # always enough unused items for that (_work_items).
        @pl.when(s < 0)
        def _():
            lead, tail = items_ref[5 * W], items_ref[5 * W + 1]
            p = q0 + row_tok
            tok = jnp.where(p < lead, p, p - lead + tail)
            ok = row_used & (tok < num_tokens)
            dst = jnp.where(ok, tok * num_heads + row_q, o_ref.shape[0] + r)
            cols = jnp.arange(o_ref.shape[1], dtype=jnp.int32)[None, :]
            plgpu.store(o_ref.at[dst[:, None], cols], jnp.zeros((rows, o_ref.shape[1]), o_ref.dtype),
                        mask=ok[:, None])

    @pl.when(s >= 0)
    def _():
        ctx = kv_len - (q_end - q_start)  # KV position of the sequence's first query token
        tok = q0 + row_tok
        row_ok = row_used & (tok < q_end)
        # Masked rows keep distinct (possibly out-of-range) indices: a masked store is a no-op on the
        # GPU, but interpret mode writes back every indexed row, so duplicates would clobber.
        q_rows = tok * num_heads + row_q
        q_pos = ctx + tok - q_start
        hi = ctx + jnp.minimum(q0 + q_tokens, q_end) - q_start  # keys [lo, hi) are visible to some row
        if decode_write:
            hi = ctx  # the pages hold the keys before the token's own, which comes from the projection
        lo = 0 if sliding_window is None else jnp.maximum(ctx + q0 - q_start - sliding_window + 1, 0)
        blk_lo = lax.div(lo, kv_block)
        n_blk = lax.div(hi + kv_block - 1, kv_block) - blk_lo
        per_split = lax.div(n_blk + kv_splits - 1, kv_splits)
        b0 = blk_lo + split * per_split
        b1 = jnp.minimum(b0 + per_split, blk_lo + n_blk)

        # Index arrays on every axis: interpret mode cannot mix gathers with slices.
        H = kv_ref.shape[1]
        cols = jnp.arange(H, dtype=jnp.int32)[None, :]
        # Key column c: key b * kv_block + c % kv_block of KV head col_head (the program's KV heads
        # side by side); a row sees only its own head's columns.
        # With one KV head the columns are the keys and the head a scalar: no column arithmetic.
        c = jnp.arange(kv_heads * kv_block, dtype=jnp.int32)
        if kv_heads > 1:
            col_head, col_key = hb * kv_heads + lax.div(c, kv_block), lax.rem(c, kv_block)
            head_mask = row_head[:, None] == col_head[None, :]
        else:
            col_head, col_key, head_mask = hb, c, None

        def load_block(b, *, masked: bool):
            """Key block b's positions, their mask and its K and V tiles (masked keys: no load)."""
            pos = b * kv_block + col_key
            pos_ok = ((pos >= lo) & (pos < hi)) if masked else None
            page = plgpu.load(page_indices_ref.at[s * pages_per_seq + lax.div(pos, page_size)],
                              mask=pos_ok, other=0 if masked else None)
            kv_row = (page * page_size + lax.rem(pos, page_size)) * (2 * num_kv_heads) + 2 * col_head
            kv_ok, zero = (pos_ok[:, None], 0.0) if masked else (None, None)
            k = plgpu.load(kv_ref.at[kv_row[:, None], cols], mask=kv_ok, other=zero)
            v = plgpu.load(kv_ref.at[kv_row[:, None] + 1, cols], mask=kv_ok, other=zero)
            return pos, pos_ok, k, v

        def attend(carry, block, *, masked: bool):
            """The online softmax's update by one loaded key block (a no-op where every key is masked)."""
            m, l, acc = carry
            pos, pos_ok, k, v = block
            logits = plgpu.dot(q, k, trans_b=True, precision=precision)  # [rows, kv_block]
            # Scaled after the dot, in f32: folding the scale into bf16 q would round it.
            if soft_cap is None:
                logits = logits * (sm_scale * _LOG2E)
            else:
                logits = (soft_cap * _LOG2E) * jnp.tanh(logits * (sm_scale / soft_cap))
            mask = head_mask
            if masked:
                mask = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
                if sliding_window is not None:
                    mask &= pos[None, :] > q_pos[:, None] - sliding_window
                if head_mask is not None:
                    mask &= head_mask
            if mask is not None:
                logits = jnp.where(mask, logits, MASK_VALUE)
            m_next = jnp.maximum(m, jnp.max(logits, axis=1))
            p = jnp.exp2(logits - m_next[:, None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp2(m - m_next)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
            return m_next, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

        def body(b, carry, *, masked: bool):
            return attend(carry, load_block(b, masked=masked), masked=masked)

        init = (jnp.full((rows,), MASK_VALUE, f32), jnp.zeros((rows,), f32), jnp.zeros((rows, H), f32))
        # Splits (small decode batches, latency-bound): the first key block's loads go with the
        # projection's. Without splits (large batches, bandwidth-bound) the loop's pipeline has them.
        peel_first_block = decode_write and kv_splits > 1
        if decode_write:
            # The row's query head, its KV head's k and v in the merged projection's rows; RoPE on q
            # and k as write_qkv applies it (rounded to the projection's dtype), k and v of the
            # token's own position kept for the softmax's first term and the write below.
            # Every load is issued before any arithmetic on a loaded value and before the KV write's
            # store: the projection's parts, the write slot's page and (peel_first_block) the first
            # key block's page and K/V tiles travel at once, rather than one round trip after another.
            group = (tok * num_kv_heads + row_head) * (q_per_kv + 2)
            hc = jnp.arange(H, dtype=jnp.int32)
            partner = jnp.where(hc < H // 2, hc + H // 2, hc - H // 2)[None, :]
            sign = jnp.where(hc < H // 2, -1.0, 1.0)[None, :]
            freq = lax.rem(hc, H // 2)[None, :]
            cos, sin = (plgpu.load(ref.at[tok[:, None], freq], mask=row_ok[:, None], other=0.0)
                        for ref in (cos_ref, sin_ref))

            def parts(src, cc):
                # The projection's rows; from partial products (qkv_parts > 1), summed later (sum_parts)
                # in f32 and rounded to the cache's dtype, which is the model's.
                return load_part_tiles(q_ref, src[:, None], cc, parts=qkv_parts,
                                       part_rows=q_ref.shape[0] // qkv_parts, mask=row_ok[:, None])

            q_src, k_src = group + lax.rem(r, q_per_kv), group + q_per_kv
            q_parts, k_parts = (parts(q_src, cols), parts(q_src, partner)), (parts(k_src, cols), parts(k_src, partner))
            v_parts = parts(k_src + 1, cols)
            # Split 0 writes the token's k and v (one row of each query group) to its page slot.
            writes = row_ok & (split == 0) & (lax.rem(r, q_per_kv) == 0)
            w_page = plgpu.load(page_indices_ref.at[s * pages_per_seq + jnp.clip(lax.div(q_pos, page_size), 0,
                                                                                pages_per_seq - 1)],
                                mask=writes, other=0)
            if peel_first_block:
                first = load_block(b0, masked=True)  # keys before the token's own: not the slot written below

            def rope(x_parts, xp_parts):
                x, xp = sum_parts(x_parts, kv_ref.dtype), sum_parts(xp_parts, kv_ref.dtype)
                return (x * cos + sign * xp * sin).astype(q_ref.dtype).astype(kv_ref.dtype)

            q = rope(*q_parts)
            k_new = rope(*k_parts)
            v_new = sum_parts(v_parts, kv_ref.dtype).astype(kv_ref.dtype)
            # The token's own key starts the softmax of split 0 (every split's keys are before it).
            own = row_ok & (split == 0)
            s_own = jnp.sum(q.astype(f32) * k_new.astype(f32), axis=1)
            if soft_cap is None:
                s_own = s_own * (sm_scale * _LOG2E)
            else:
                s_own = (soft_cap * _LOG2E) * jnp.tanh(s_own * (sm_scale / soft_cap))
            init = (jnp.where(own, s_own, MASK_VALUE), jnp.where(own, 1.0, 0.0),
                    jnp.where(own[:, None], v_new.astype(f32), 0.0))

            @pl.when(split == 0)
            def _():
                slot = w_page * page_size + lax.rem(q_pos, page_size)
                num_slots = kv_ref.shape[0] // (2 * num_kv_heads)
                w_ok = writes & (slot >= 0) & (slot < num_slots)
                # masked rows get distinct rows past the pool (interpret mode writes back every index)
                dst = jnp.where(w_ok, slot * (2 * num_kv_heads) + 2 * row_head, kv_ref.shape[0] + 2 * r)
                plgpu.store(kv_out_ref.at[dst[:, None], cols], k_new, mask=w_ok[:, None])
                plgpu.store(kv_out_ref.at[dst[:, None] + 1, cols], v_new, mask=w_ok[:, None])
        else:
            q = plgpu.load(q_ref.at[q_rows[:, None], cols], mask=row_ok[:, None], other=0.0)

        # unmasked_full_blocks (no window): blocks whose keys every row may see (all at or before the
        # item's first query position) skip the mask and the masked loads, in a loop of their own:
        # those below the diagonal of a prefill chunk. Rows past the item's tokens then hold q = 0
        # and finite sums, and are never stored.
        # Decode-shaped buckets keep one loop: a second pipelined loop made 64 x 4k (H = 128) 22%
        # slower on an H200 and 256 x 512 (H = 64) no faster (docs/kernels/ragged_paged_attention.md).
        full, carry = b0, init
        if peel_first_block:
            full, carry = b0 + 1, attend(init, first, masked=True)
        elif unmasked_full_blocks:
            full = jnp.clip(lax.div(ctx + q0 - q_start + 1, kv_block), b0, b1)
            carry = lax.fori_loop(b0, full, functools.partial(body, masked=False), init)
        m, l, acc = lax.fori_loop(full, b1, functools.partial(body, masked=True), carry)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        if kv_splits == 1:
            plgpu.store(o_ref.at[q_rows[:, None], cols], out.astype(o_ref.dtype), mask=row_ok[:, None])
        else:
            (lse_ref,) = lse_refs
            plgpu.store(o_ref.at[split, q_rows[:, None], cols], out, mask=row_ok[:, None])
            lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            plgpu.store(lse_ref.at[split, q_rows], lse, mask=row_ok)


def _item_table(cu_q_lens, num_seqs, kv_lens, q_tokens: int, num_items: int):
    """The kernels' `items` input, i32[5 * num_items + 2]: field by field, each work item's sequence (-1
    unused) and first token (_work_items), then its sequence's cu_q_lens[s], cu_q_lens[s + 1] and
    kv_lens[s] (those of sequence 0 for unused items); last, the real tokens' bounds cu_q_lens[0] and
    cu_q_lens[num_seqs]. A program then loads what it needs to start in one round trip to memory,
    where it loaded the sequence's fields after the item's (and the split merge num_seqs before
    cu_q_lens[num_seqs]): llama3_2_1b's batch-1 step 0.925-0.931 -> 0.906-0.913 ms on an H200 with
    the first key block loaded ahead (docs/benchmarks.md, thirty-eighth session)."""
    seq, tok = _work_items(cu_q_lens, num_seqs, q_tokens, num_items)
    s = jnp.maximum(seq, 0)
    bounds = jnp.stack([cu_q_lens[0], cu_q_lens[num_seqs[0]]])
    return jnp.concatenate([seq, tok, cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s], bounds]).astype(jnp.int32)


def _work_items(cu_q_lens, num_seqs, q_tokens: int, num_items: int):
    """(sequence, first token) of each work item of <= q_tokens tokens of one sequence; -1 unused.
    Unused item j gets j * q_tokens as its token: the first of the padding tokens it zeroes, counted
    over the padding (those before cu_q_lens[0], then those from cu_q_lens[num_seqs] on). Unused
    items always cover the padding: with num_items = cdiv(T, q) + S, used <= real / q + S, so
    unused >= (T - real) / q; with num_items = T, each used item holds a token, so unused >= T - real."""
    S = cu_q_lens.shape[0] - 1
    live = jnp.arange(S, dtype=jnp.int32) < num_seqs[0]
    n_items = jnp.where(live, (cu_q_lens[1:] - cu_q_lens[:-1] + q_tokens - 1) // q_tokens, 0)
    ends = jnp.cumsum(n_items)
    idx = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: searchsorted's default (a scan) is a while loop, which splits the step's CUDA
    # graph and runs as host-paced launches on the GPU (7 iterations at 64 slots).
    seq = jnp.minimum(jnp.searchsorted(ends, idx, side="right", method="compare_all"), S - 1).astype(jnp.int32)
    tok = cu_q_lens[seq] + (idx - (ends[seq] - n_items[seq])) * q_tokens
    used = idx < ends[-1]
    return (jnp.where(used, seq, -1).astype(jnp.int32),
            jnp.where(used, tok, (idx - ends[-1]) * q_tokens).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes",
                                             "interpret"))
def _ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, rope, *, sm_scale,
                            sliding_window, soft_cap, block_sizes, interpret):
    """The launch and, with splits, the merge: o [T, N, H]. With `rope` (cos, sin), q is the merged
    projection [T, K, R + 2, H] of a step whose sequences have at most one token each, and the
    result is (o, kv_pages with those tokens' k and v written): write_qkv_attention."""
    P, G, K2, H = kv_pages.shape
    K = K2 // 2
    S, P_max = page_indices.shape
    if rope is None:
        T, N, _ = q.shape
        q_in, dtype = q.reshape(T * N, H), q.dtype
    else:  # the merged projection [T, K, R + 2, H], or its f32 partial products [parts, T, K, R + 2, H]
        T, _, R2, _ = q.shape[-4:]
        N = K * (R2 - 2)
        q_in, dtype = q.reshape(-1, H), kv_pages.dtype
    q_shape = jax.ShapeDtypeStruct((T, N, H), dtype)
    bq, bkv, kh, splits = check_block_sizes(block_sizes, q_shape, kv_pages, page_indices)
    rows = max(16, next_pow2(bq * kh * (N // K)))
    num_items = min(T, pl.cdiv(T, bq) + S)  # every item holds a token: no more items than tokens
    items = _item_table(cu_q_lens, num_seqs, kv_lens, bq, num_items)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((T * N, H), dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, T * N, H), jnp.float32),
                     jax.ShapeDtypeStruct((splits, T * N), jnp.float32)]
    inputs = [items, page_indices.reshape(-1), q_in, kv_pages.reshape(P * G * K2, H)]
    aliases = {}
    if rope is not None:
        aliases = {len(inputs) - 1: len(out_shape)}  # the pool, updated in place
        inputs += list(rope)
        out_shape.append(jax.ShapeDtypeStruct((P * G * K2, H), kv_pages.dtype))
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        num_heads=N, num_kv_heads=K, kv_heads=kh, page_size=G, pages_per_seq=P_max, q_tokens=bq, rows=rows,
        kv_block=bkv, kv_splits=splits, decode_write=rope is not None, qkv_parts=q.shape[0] if q.ndim == 5 else 1,
        unmasked_full_blocks=prefill_shaped(T, S) and sliding_window is None and rope is None,
        early_launch=early_launch_enabled(interpret))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, K // kh, splits),
        in_specs=[any_spec] * len(inputs),
        out_specs=[any_spec] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                             num_stages=block_sizes.num_stages),
        cost_estimate=ref_cost_estimate(q_shape, kv_pages, page_indices, soft_cap=soft_cap),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*inputs)
    if splits > 1:  # the merge writes every token, zeros for padding ones
        o = _merge_splits(*outs[:2], items, num_heads=N, dtype=dtype, interpret=interpret)
    else:
        o = outs[0]  # padding rows zeroed by the unused items
    o = o.reshape(T, N, H)
    return o if rope is None else (o, outs[-1].reshape(P, G, K2, H))


def _merge_kernel(items_ref, o_ref, lse_ref, out_ref, *, num_heads: int, splits: int,
                  splits_pow2: int, early_launch: bool):
    """One output row (a token's q head): its kv_splits partial outputs weighted by their
    exp2(log-sum-exp). Every load is issued at once, none waiting on another: every split program of a
    real token stored its partial (zeros and lse = -inf where it saw no key), and a padding token's
    partials (never written) are read but replaced by zeros at the end, so the kernel's dependent
    round trips are the loads, then the store."""
    row = pl.program_id(0)
    t = lax.div(row, num_heads)
    sp = launch_dependents(jnp.arange(splits_pow2, dtype=jnp.int32), early_launch)
    src = sp * (lse_ref.shape[0] // splits) + row  # row `row` of each split in the flat [splits * T * N] partials
    cols = jnp.arange(o_ref.shape[1], dtype=jnp.int32)
    lse = plgpu.load(lse_ref.at[src], mask=sp < splits, other=-jnp.inf)
    o = plgpu.load(o_ref.at[src[:, None], cols[None, :]], mask=(sp < splits)[:, None], other=0.0)
    n = items_ref.shape[0]
    real = (t >= items_ref[n - 2]) & (t < items_ref[n - 1])  # the real tokens' bounds (_item_table)
    used = real & (lse > -jnp.inf)
    m = jnp.max(jnp.where(used, lse, -jnp.inf))
    w = jnp.where(used, jnp.exp2(lse - jnp.where(m > -jnp.inf, m, 0.0)), 0.0)
    out = jnp.sum(jnp.where(used[:, None], w[:, None] * o, 0.0), axis=0) / jnp.maximum(jnp.sum(w), 1e-30)
    plgpu.store(out_ref.at[row * o_ref.shape[1] + cols], out.astype(out_ref.dtype))


def _merge_splits(o_part, lse, items, *, num_heads: int, dtype, interpret: bool):
    """One launch, a program per output row: [kv_splits, T * N, H] f32 partials -> [T * N, H]
    dtype, where XLA's merge read and reduced every split in three or four kernels
    (docs/benchmarks.md). Loading every split's partial with the log-sum-exps, rather than after them
    and only where they hold keys, took the kernel from 1.65 to 1.43 us at llama3_2_1b's batch 1 over
    512 keys (10 splits; H200, docs/benchmarks.md "thirty-second session")."""
    splits, TN, H = o_part.shape
    kernel = functools.partial(_merge_kernel, num_heads=num_heads, splits=splits, splits_pow2=next_pow2(splits),
                               early_launch=early_launch_enabled(interpret))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid=(TN,),
        in_specs=[any_spec] * 3,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((TN * H,), dtype),
        # 2 warps for the [16, 64] tile measured (16 f32 a thread); wider tiles (64 splits x H = 128)
        # get more warps rather than more registers a thread
        compiler_params=plgpu.CompilerParams(num_warps=min(8, max(2, next_pow2(splits) * H // 512)),
                                             num_stages=1),
        interpret=interpret,
        name="merge_attention_splits_gpu",
    )(items, o_part.reshape(splits * TN, H), lse.reshape(splits * TN))
    return out.reshape(TN, H)


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
    interpret: bool = False,
) -> jax.Array:  # [T, N, H], q.dtype
    """Pallas Triton kernel; same contract as reference.ref_ragged_paged_attention.

    q of another dtype than kv_pages is cast to the KV dtype; the output has q's dtype.

    interpret: True runs the kernel body as jnp on the host (CPU tests).
    """
    validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    out_dtype = q.dtype
    q = q.astype(kv_pages.dtype)  # matmuls run in the cache's dtype (f32 activations, bf16 KV)
    if block_sizes is None:
        block_sizes = default_block_sizes(q, kv_pages, page_indices)
    out = _ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, None,
                                  sm_scale=float(sm_scale), sliding_window=sliding_window,
                                  soft_cap=None if soft_cap is None else float(soft_cap),
                                  block_sizes=block_sizes, interpret=interpret)
    return out.astype(out_dtype)


def write_qkv_attention(
    kv_pages: jax.Array,  # [P, G, 2K, H]
    qkv: jax.Array,  # [T, K, R + 2, H]: per KV head, its R query heads, then its k, then its v
    cos: jax.Array,  # f32[T, H/2]
    sin: jax.Array,  # f32[T, H/2]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [T, K * R, H] kv_pages.dtype, kv_pages)
    """write_qkv then ragged_paged_attention in one launch, for steps whose sequences have at most
    one token each (decode; the caller guarantees it: the engine's decode-only steps and bursts). Each program
    RoPEs its query rows and its KV heads' new k from the merged projection, takes the token's own
    key from there (the pages hold the ones before it, so no program reads what another writes)
    and, in split 0, writes k and v to the token's page slot (in place when kv_pages is donated).
    The result equals the two calls' up to rounding (the own key's term is summed in f32, outside
    the PV matmul); the write kernel's launch is gone (~2.8 us a layer at 256
    sequences of llama3_2_1b on an H100, docs/kernels/ragged_paged_attention.md).

    qkv may instead be f32[P, T, K, R + 2, H] partial products of the projection (dispatch.gemv_partials):
    each program sums its rows' P parts and rounds them to kv_pages' dtype as it loads them, so no
    reduce kernel runs between the GEMV and this one.

    interpret: True runs the kernel body as jnp on the host (CPU tests)."""
    if qkv.ndim == 5 and qkv.dtype != jnp.float32:
        raise ValueError(f"qkv partial products {qkv.shape} must be float32, got {qkv.dtype}")
    one = jax.ShapeDtypeStruct(qkv.shape[1:], qkv.dtype) if qkv.ndim == 5 else qkv  # a part's shape: no slice traced
    T, K, R2, H = check_qkv(kv_pages, one, cos, sin)
    q_shape = jax.ShapeDtypeStruct((T, K * (R2 - 2), H), kv_pages.dtype)
    validate_inputs(q_shape, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    if block_sizes is None:
        block_sizes = default_block_sizes(q_shape, kv_pages, page_indices)
    o, pool = _ragged_paged_attention(qkv, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      (cos.astype(jnp.float32), sin.astype(jnp.float32)),
                                      sm_scale=float(sm_scale), sliding_window=sliding_window,
                                      soft_cap=None if soft_cap is None else float(soft_cap),
                                      block_sizes=block_sizes, interpret=interpret)
    return o, pool

