"""One Flax NNX decoder for Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 and Qwen3.

Differences between the families are flags on ModelConfig: GQA/MQA/MHA via num_kv_heads, head_dim
independent of D/N, RoPE scaling (llama3, linear), QKV bias (Qwen2), per-head QK RMSNorm (Qwen3),
sliding-window attention (Mistral), tied embeddings. q/k/v and gate/up are each one merged weight
(one GEMM each; docs/design.md "Merged projections"). RoPE is the half-split ("rotate_half") form HF
checkpoints use; loaders of interleaved-RoPE formats (GGUF, llama2.c) permute q/k weights to it.

Parameters carry logical axis names only (metadata `logical_axes`); sharding/rules.py maps them to
mesh axes. Layers are a Python list of modules with their own arrays rather than a scan over stacked
weights: on GPU, dynamic slicing of stacked weights cost 2.2x in decode (../shared/JAX_NOTES.md).

Seam (ARCHITECTURE.md): forward(params, tokens, positions, kv_pages, attn_meta) -> (logits, kv_pages).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import AttentionMetadata
from models.config import ModelConfig, rope_inv_freq
from pallas_kernels import dispatch
from pallas_kernels.greedy_head import head_logits
from pallas_kernels.rms_norm import rms_norm
from sharding.rules import shard_over_heads


def _precision(dtype):
    """f32 models get f32 matmuls: XLA's GPU default for f32 is TF32, which changes greedy output."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _dot_output(gemm_impl: str):
    """The model's dots' preferred_element_type: f32 where its GEMMs run on CPUs
    (dispatch.f32_dot_outputs; the caller rounds the product to its dtype once), else None (the
    operands' dtype, as before: GPU and TPU programs are unchanged)."""
    return jnp.float32 if dispatch.f32_dot_outputs(gemm_impl) else None


def _param(rngs: nnx.Rngs, shape, axes, dtype, init=None) -> nnx.Param:
    init = init or nnx.initializers.normal(0.02)
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str, *, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, (dim,), (axis_name,), param_dtype, nnx.initializers.ones)

    def __call__(self, x):
        return rms_norm(x, self.scale[...], eps=self.eps)

    def add(self, x, r, implementation: str):
        """(x + r, this norm of it): a residual add and the norm after it (one launch on GPU). x, a
        projection, may be its f32 partial products (dispatch.gemv_partials), r the residual stream."""
        return dispatch.add_rms_norm(x, r, self.scale[...], eps=self.eps, implementation=implementation)

    def embed(self, table, ids, rows: int, dtype, implementation: str):
        """(table[ids] cast to dtype, this norm of it), [rows, D] (rows past the ids: id 0's): the
        model's entry (one launch on one Hopper GPU; implementation: the model's gemm_impl,
        dispatch.embed_rms_norm)."""
        return dispatch.embed_rms_norm(table, ids, self.scale[...], eps=self.eps, dtype=dtype, rows=rows,
                                       implementation=implementation)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, kv_repeat: int, attn_impl: str, head_mesh, gemm_impl: str, dtype,
                 param_dtype, rngs: nnx.Rngs, window: int | None):
        D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg, self.attn_impl, self.gemm_impl, self.dtype = cfg, attn_impl, gemm_impl, dtype
        self.window = window  # this layer's sliding window (ModelConfig.window_of), None: full attention
        self.head_mesh = head_mesh  # sharding.rules.head_parallel_mesh: write + attention per tensor shard
        # q, k and v as one [D, K', R'+2, H] matrix: per stored KV head, its R' query heads, then k,
        # then v (qkv_layout). One GEMM, no per-step concatenation of three weights.
        Kr, Rr = qkv_groups(cfg, kv_repeat)
        self.qkv_proj = _param(rngs, (D, Kr, Rr + 2, H), ("embed", "kv_heads", None, "head_dim"), param_dtype)
        self.o_proj = _param(rngs, (N, H, D), ("q_heads", "head_dim", "embed"), param_dtype)
        if cfg.attention_bias:
            self.qkv_bias = _param(rngs, (Kr, Rr + 2, H), ("kv_heads", None, "head_dim"), param_dtype,
                                   nnx.initializers.zeros)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype, rngs=rngs)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_pages, meta: AttentionMetadata, decode_only: bool = False):
        # x: [T, D]; cos, sin: f32[T, H/2]; kv_pages: [P, G, 2K', H]; decode_only: every sequence has at
        # most one token in this step (decode-only steps and bursts), so the KV write may run inside the attention.
        # Returns the o projection [T, D], or its f32 partial products [P, T, D] (dispatch.gemv_parts).
        cfg, dt, prec = self.cfg, self.dtype, _precision(self.dtype)
        T, D = x.shape
        parts = partial(dispatch.gemv_parts, decode_only=decode_only, attn_impl=self.attn_impl,
                        gemm_impl=self.gemm_impl)
        w = self.qkv_proj[...].astype(dt)
        if not (cfg.attention_bias or cfg.qk_norm) and (n := parts("qkv", T, D, D)) > 1:
            qkv = dispatch.gemv_partials(x, w, n, precision=prec)  # summed in the attention kernel
        else:
            qkv = jnp.einsum("td,dgrh->tgrh", x, w, precision=prec,
                             preferred_element_type=_dot_output(self.gemm_impl)).astype(dt)
        if cfg.attention_bias:
            qkv = qkv + self.qkv_bias[...].astype(dt)
        if cfg.qk_norm:
            R = qkv.shape[2] - 2
            qkv = jnp.concatenate([self.q_norm(qkv[:, :, :R]), self.k_norm(qkv[:, :, R:R + 1]), qkv[:, :, R + 1:]],
                                  axis=2)
        o, kv_pages = self._write_and_attend(kv_pages, qkv, cos, sin, *meta, decode_only=decode_only)
        o, w = o.reshape(T, -1), self.o_proj[...].astype(dt).reshape(-1, D)
        if (n := parts("o", T, o.shape[1], D)) > 1:
            return dispatch.gemv_partials(o, w, n, precision=prec), kv_pages  # summed in add_rms_norm
        return jnp.matmul(o, w, precision=prec, preferred_element_type=_dot_output(self.gemm_impl)).astype(dt), kv_pages

    def _write_and_attend(self, kv_pages, qkv, cos, sin, *meta, decode_only: bool):
        def run(kv_pages, qkv, cos, sin, *meta):
            # RoPE, the KV write and the attention: on GPU two launches, one for decode-only steps
            return dispatch.write_qkv_attention(
                kv_pages, qkv, cos, sin, *meta, sm_scale=self.cfg.head_dim**-0.5, decode_only=decode_only,
                sliding_window=self.window, implementation=self.attn_impl)

        if self.head_mesh is not None:
            run = shard_over_heads(run, self.head_mesh)
        return run(kv_pages, qkv, cos, sin, *meta)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, gemm_impl: str, dtype, param_dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.dtype, self.gemm_impl = dtype, gemm_impl
        # gate and up as one [D, 2, F] matrix: one GEMM (sharded over F, each shard's two halves local)
        self.gate_up_proj = _param(rngs, (D, 2, F), ("embed", None, "mlp"), param_dtype)
        self.down_proj = _param(rngs, (F, D), ("mlp", "embed"), param_dtype)

    def __call__(self, x, down_parts: int = 1):
        """x [T, D] -> [T, D], or with down_parts > 1 the down projection's f32 partial products
        [down_parts, T, D] (dispatch.gemv_partials)."""
        dt, prec = self.dtype, _precision(self.dtype)
        h = dispatch.swiglu(x, self.gate_up_proj[...].astype(dt), precision=prec, implementation=self.gemm_impl)
        w = self.down_proj[...].astype(dt)
        if down_parts > 1:
            return dispatch.gemv_partials(h, w, down_parts, precision=prec)
        return jnp.matmul(h, w, precision=prec, preferred_element_type=_dot_output(self.gemm_impl)).astype(dt)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, kv_repeat: int, attn_impl: str, head_mesh, gemm_impl: str,
                 dtype, param_dtype, rngs: nnx.Rngs):
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps, "embed", param_dtype=param_dtype, rngs=rngs)
        self.attn = Attention(cfg, kv_repeat=kv_repeat, attn_impl=attn_impl, head_mesh=head_mesh, gemm_impl=gemm_impl,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs, window=cfg.window_of(layer))
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, "embed", param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, gemm_impl=gemm_impl, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, h, cos, sin, kv_pages, meta, next_norm: RMSNorm, decode_only: bool = False):
        """x: the residual stream, h: input_norm(x) (the previous layer computed it with its last
        add). Returns the new stream, next_norm of it (the next layer's input norm, or the model's
        final norm after the last layer) and the pages."""
        a, kv_pages = self.attn(h, cos, sin, kv_pages, meta, decode_only)
        impl = self.attn.attn_impl  # the kernels for the platform the model lives on
        x, h = self.post_attn_norm.add(a, x, impl)
        F, D = self.mlp.down_proj.shape
        m = self.mlp(h, dispatch.gemv_parts("down", h.shape[0], F, D, decode_only=decode_only, attn_impl=impl,
                                            gemm_impl=self.mlp.gemm_impl))
        x, h = next_norm.add(m, x, impl)
        return x, h, kv_pages


class LlamaModel(nnx.Module):
    """Decoder over a ragged token batch. `dtype` is the compute dtype, `param_dtype` the storage.

    `attn_impl` is the attention implementation for the platform the model lives on (chosen by
    pallas_kernels.dispatch.select_attention_impl); it is static, part of the graph, not of the params.
    So is `head_mesh` (sharding.rules.head_parallel_mesh): when set, each layer's KV write and
    attention run per shard of its `tensor` axis (shard_map), every device on its own heads. And
    `gemm_impl` (dispatch.select_gemm_impl): the GEMMs with fused epilogues (the MLP's SwiGLU, the
    greedy head) as Mosaic GPU kernels on one Hopper GPU, or XLA.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=None,
                 kv_repeat: int = 1, attn_impl: str = "reference", head_mesh=None, gemm_impl: str = "reference"):
        param_dtype = param_dtype or dtype
        self.cfg, self.dtype, self.gemm_impl = cfg, dtype, gemm_impl
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype)
        self.layers = nnx.List(
            DecoderLayer(cfg, i, kv_repeat=kv_repeat, attn_impl=attn_impl, head_mesh=head_mesh, gemm_impl=gemm_impl,
                         dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for i in range(cfg.num_layers)
        )
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)

    def __call__(
        self,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_pages: tuple[jax.Array, ...],  # L x [P, G, 2K', H]
        meta: AttentionMetadata,
        logits_indices: jax.Array | None = None,  # i32[R]: rows to compute logits for (default: all)
        greedy: bool = False,  # return each row's argmax (i32[T or R]) instead of its logits
        decode_only: bool = False,  # every sequence has at most one token (the caller guarantees it)
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:  # f32[T or R, V] (or the argmax), kv_pages
        if len(kv_pages) != self.cfg.num_layers:
            raise ValueError(f"kv_pages has {len(kv_pages)} layers; the model has {self.cfg.num_layers}")
        if tokens.shape[0] == 1:
            # With one row, XLA's GPU simplifier rewrites each vector-matrix dot whose matrix has
            # fewer than 10M elements into a multiply that writes a weight-sized product, then a
            # reduction: three times the weight traffic. A second, padding token (past
            # cu_q_lens[num_seqs], so attention and the KV writer ignore it) keeps every
            # projection a GEMM: batch-1 decode of llama3_2_1b 1.57 -> ~0.95 ms per step on an H200
            # (docs/benchmarks.md). Its embedding row is id 0's (the embedding pads the ids).
            positions = jnp.pad(positions, (0, 1))
            if logits_indices is None:
                logits_indices = jnp.zeros((1,), jnp.int32)
        # The tokens' embedding rows and the first layer's input norm of them (one launch on one Hopper GPU)
        x, h = self.layers[0].input_norm.embed(self.embed[...], tokens, positions.shape[0], self.dtype, self.gemm_impl)
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(self.cfg))[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        new_pages = []
        for i, (layer, pages) in enumerate(zip(self.layers, kv_pages)):
            # Each residual add is fused with the norm that reads it (RMSNorm.add), the last one with the
            # final norm: at batch 1 on an H200 one launch where XLA ran three (the add, the norm's
            # reduction and its scaling: 4.3 us of a ~0.91 ms step), while a prefill step normalises
            # rows it takes no logits for (~30 us an 8,192-token step of llama3_2_1b).
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h, pages = layer(x, h, cos, sin, pages, meta, next_norm, decode_only)
            new_pages.append(pages)
        x = h
        tied = self.cfg.tie_word_embeddings
        head = (self.embed if tied else self.lm_head)[...].astype(self.dtype)
        if greedy:  # the logits' argmax without writing them, where a kernel runs (dispatch.greedy_head)
            out = dispatch.greedy_head(x, head, transposed=tied, rows=logits_indices, precision=_precision(self.dtype),
                                       implementation=self.gemm_impl)
        else:
            if logits_indices is not None:
                x = jnp.take(x, logits_indices, axis=0)
            out = head_logits(x, head, transposed=tied, precision=_precision(self.dtype),
                              fold_transpose=dispatch.f32_dot_outputs(self.gemm_impl))
        return out, tuple(new_pages)


def qkv_groups(cfg: ModelConfig, kv_repeat: int = 1) -> tuple[int, int]:
    """(K', R'): the merged qkv projection's groups (one per stored KV head, K' = K * kv_repeat) and
    the query heads in each (R' = N / K'). Query head i = g * R' + r reads KV head g // kv_repeat,
    the standard GQA mapping."""
    Kr = cfg.num_kv_heads * kv_repeat
    if cfg.num_heads % Kr:
        raise ValueError(f"{cfg.num_heads} query heads do not split into {Kr} groups (kv_repeat {kv_repeat})")
    return Kr, cfg.num_heads // Kr


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def qkv_layout(q, k, v):
    """The canonical merged qkv weight (or bias) from HF-shaped parts: q [..., N, H], k and v
    [..., K, H] -> [..., K, N/K + 2, H]: per KV head its query heads, then k, then v."""
    xp = _xp(q)
    *lead, N, H = q.shape
    K = k.shape[-2]
    return xp.concatenate([q.reshape(*lead, K, N // K, H), k[..., None, :], v[..., None, :]], axis=-2)


def repeat_qkv(w, kv_repeat: int):
    """Canonical [..., K, R+2, H] -> [..., K*kv_repeat, R/kv_repeat + 2, H]: each KV head's query heads
    split over kv_repeat groups, each with its own copy of k and v (so every tensor shard holds whole
    groups when the tensor axis is larger than K; sharding.rules.attention_layout)."""
    if kv_repeat == 1:
        return w
    xp = _xp(w)
    *lead, K, R2, H = w.shape
    R = R2 - 2
    q = w[..., :R, :].reshape(*lead, K, kv_repeat, R // kv_repeat, H)
    kv = xp.broadcast_to(w[..., None, R:, :], (*lead, K, kv_repeat, 2, H))
    return xp.concatenate([q, kv], axis=-2).reshape(*lead, K * kv_repeat, R // kv_repeat + 2, H)


def unrepeat_qkv(w, kv_repeat: int):
    """The inverse of repeat_qkv (the first copy of each k and v)."""
    if kv_repeat == 1:
        return w
    xp = _xp(w)
    *lead, Kr, Rr2, H = w.shape
    g = w.reshape(*lead, Kr // kv_repeat, kv_repeat, Rr2, H)
    q = g[..., :Rr2 - 2, :].reshape(*lead, Kr // kv_repeat, kv_repeat * (Rr2 - 2), H)
    return xp.concatenate([q, g[..., 0, Rr2 - 2:, :]], axis=-2)


def is_qkv_param(path) -> bool:
    """The params whose layout depends on kv_repeat (repeat_qkv)."""
    return str(path[-1]) in ("qkv_proj", "qkv_bias")


def make_forward(graphdef: nnx.GraphDef) -> Callable:
    """The functional seam: forward(params, tokens, positions, kv_pages, attn_meta) -> (logits, kv_pages);
    with greedy=True, (each logits row's argmax i32, kv_pages). decode_only=True promises that every
    sequence has at most one token in the step (the engine's decode-only steps and bursts): the GPU then writes
    K/V inside the attention kernel (dispatch.write_qkv_attention): the same result up to rounding."""

    def forward(params, tokens, positions, kv_pages, attn_meta, logits_indices=None, greedy=False,
                decode_only=False):
        return nnx.merge(graphdef, params)(tokens, positions, kv_pages, attn_meta, logits_indices, greedy,
                                           decode_only)

    return forward


def abstract_model(cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, kv_repeat: int = 1,
                   attn_impl: str = "reference", head_mesh=None, gemm_impl: str = "reference") -> LlamaModel:
    """The model with ShapeDtypeStruct leaves: shapes for loaders, no memory allocated."""
    return nnx.eval_shape(
        lambda: LlamaModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, kv_repeat=kv_repeat,
                           attn_impl=attn_impl, head_mesh=head_mesh, gemm_impl=gemm_impl)
    )


def param_logical_axes(state: nnx.State) -> dict:
    """Map each Param path (tuple) to its logical axis names (None for non-sharded variables)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        out[tuple(path)] = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Param) else None
    return out

