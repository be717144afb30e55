"""scripts/eval_perplexity.py: its window plan, its argument checks, and its perplexity against an
independent computation over the same windows (stories260K, shared data)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_perplexity.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("n, context, stride", [(1000, 64, 48), (1000, 64, 1), (50, 64, 16), (640, 64, 32),
                                                (641, 64, 63), (2, 64, 32)])
def test_windows_score_every_token_after_the_first_once(n, context, stride):
    from eval_perplexity import windows

    scored = [i for _, end, first in windows(n, context, stride) for i in range(first, end)]
    assert sorted(scored) == list(range(1, n))
    for begin, end, first in windows(n, context, stride):  # each scored token's history lies in its window
        assert begin < first and end - begin <= context


def test_windows_at_stride_equal_to_context_skip_each_windows_first_token():
    """HF's recipe, which the docs now state: with stride == context a window's first token has no
    history in its window and is not scored (the docs claimed every token was)."""
    from eval_perplexity import windows

    scored = {i for _, end, first in windows(300, 64, 64) for i in range(first, end)}
    assert sorted(set(range(1, 300)) - scored) == [64, 128, 192, 256]


def test_max_tokens_below_two_is_refused(tmp_path):
    """0 and 1 divided by zero tokens scored; a negative count sliced the corpus from its end."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("Once upon a time")
    for bad in ("1", "0", "-5"):
        p = _script("--model", "stories260k", "--corpus", str(corpus), "--max-tokens", bad)
        assert p.returncode == 2 and f"--max-tokens {bad} must be at least 2" in p.stderr


def test_perplexity_equals_an_independent_computation(tmp_path):
    """The script's perplexity on stories260K over 3 windows equals exp(mean NLL) of the same scored
    tokens, each from the logits of a plain forward over its own window (tests/testing/greedy)."""
    from tests.testing.data import shared_data_dir

    data = shared_data_dir()
    model = data / "stories260k" / "stories260K.bin"
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. " * 4
    corpus = tmp_path / "c.txt"
    corpus.write_text(text)
    out = tmp_path / "ppl.json"
    p = _script("--model", str(model), "--corpus", str(corpus), "--context", "64", "--stride", "48",
                "--page-size", "16", "--dtype", "float32", "--max-tokens", "150", "--json", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())

    from eval_perplexity import windows

    from runtime.checkpoint import load_model
    from runtime.tokenizer import load_tokenizer
    from tests.testing.greedy import greedy_generate

    loaded = load_model(model, dtype="float32", progress=False)
    ids = load_tokenizer(loaded.tokenizer_path).encode(text)[:150]
    nll = []
    for begin, end, first in windows(len(ids), 64, 48):
        logits = greedy_generate(loaded, ids[begin:end], 1).prompt_logits.astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        nll += [-logp[i - 1 - begin, ids[i]] for i in range(first, end)]
    assert res["scored_tokens"] == len(nll) == len(ids) - 1
    np.testing.assert_allclose(res["perplexity"], np.exp(np.mean(nll)), rtol=1e-5)


def test_a_corpus_of_one_token_is_refused(tmp_path):
    from tests.testing.data import shared_data_dir

    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    p = _script("--model", str(shared_data_dir() / "stories260k" / "stories260K.bin"), "--corpus", str(corpus),
                "--context", "64", "--stride", "32")
    assert p.returncode == 1 and "at least 2 are needed to score one" in p.stderr
