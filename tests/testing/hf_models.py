"""Tiny random-weight transformers models, the reference side of the model and checkpoint tests.
Callers importorskip torch and transformers first."""

from __future__ import annotations

import numpy as np


def random_hf_model(cfg_cls: str, model_cls: str, seed: int | None = None, **config):
    """transformers' `model_cls` on a `cfg_cls`(**config) with eager attention, its weights random
    (seed: a fresh one when None), biases and norm weights too (HF initialises them to 0 and 1, which
    would leave them untested)."""
    import torch
    import transformers

    cfg = getattr(transformers, cfg_cls)(**config, attn_implementation="eager")
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)) if seed is None else seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model
