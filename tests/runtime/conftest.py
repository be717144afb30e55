"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest

from runtime.llm import LLM
from tests.testing.data import shared_data_dir


@pytest.fixture(scope="module")
def llm():
    """The offline API on the real stories260K with its tokenizer (one per test module)."""
    path = shared_data_dir() / "stories260k" / "stories260K.bin"
    llm = LLM(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(64,),
              seq_buckets=(8,), max_model_len=256, strict_compile=True, progress=False)
    yield llm
    llm.engine.check_invariants()
    llm.engine.close()
