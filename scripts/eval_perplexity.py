"""Sliding-window perplexity of a model on a text corpus, through the paged forward.

The recipe is HF's "Perplexity of fixed-length models": windows of `--context` tokens whose starts
advance by `--stride`; each window scores only the tokens the previous window did not (so with a
stride below the context every token after the first is scored exactly once, with at least
context - stride tokens of history once the first window is past; with stride == context, as in
HF's recipe, each window's first token is not scored, having no history in its window). Every window is a fresh sequence at positions 0.. in the same KV
pages; the step is jitted once with fixed shapes (the last, shorter window is padded).

Corpus text is read as UTF-8 with line ends normalised to "\n", tokenized whole with the model's own
tokenizer (its default special tokens, e.g. BOS for Llama 2, none for SmolLM2).

  python scripts/eval_perplexity.py --model PATH --corpus ../shared/data/corpora/wikitext2_test.raw \
      [--context 1024 --stride 512 --max-tokens N --dtype float32 --json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models.attention import AttentionMetadata  # noqa: E402
from runtime.checkpoint import load_model  # noqa: E402
from runtime.kv_cache import init_kv_pages  # noqa: E402
from runtime.tokenizer import load_tokenizer  # noqa: E402
from sharding.rules import kv_cache_sharding  # noqa: E402


def windows(n_tokens: int, context: int, stride: int):
    """(begin, end, first_scored) per window, HF's loop: score tokens [max(prev_end, begin+1), end)."""
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == n_tokens:
            break


def make_step(loaded, context: int):
    forward = loaded.forward

    def step(params, tokens, rows, targets, weights, kv_pages, meta):
        # tokens: i32[C]; rows: i32[R] window rows to score, row i predicting token i + 1;
        # targets: i32[R] those tokens; weights: f32[R], 0 for padding rows
        logits, kv_pages = forward(params, tokens, jnp.arange(context, dtype=jnp.int32), kv_pages, meta, rows)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # f32[R, V]
        nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        return jnp.sum(nll * weights), kv_pages

    # two shapes, two compiles: R = C - 1 for the first window, R = stride for every later one
    return jax.jit(step, donate_argnums=(5,))


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint path or preset (see runtime.checkpoint.load_model)")
    ap.add_argument("--corpus", required=True, help="UTF-8 text file, scored as one document")
    ap.add_argument("--context", type=int, default=1024, help="window length in tokens")
    ap.add_argument("--stride", type=int, default=512, help="window start step; tokens scored per window")
    ap.add_argument("--max-tokens", type=int, default=None, help="evaluate only this many leading corpus tokens")
    ap.add_argument("--dtype", default="float32", help="auto, float32 or bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--progress-every", type=int, default=20, help="print a running line every N windows")
    args = ap.parse_args(argv)
    if not 0 < args.stride <= args.context:
        ap.error(f"--stride {args.stride} must be in [1, --context={args.context}]")
    if args.context % args.page_size:
        ap.error(f"--context {args.context} must be a multiple of --page-size {args.page_size}")
    if args.max_tokens is not None and args.max_tokens < 2:
        ap.error(f"--max-tokens {args.max_tokens} must be at least 2 (a token is scored given the one before it)")

    t0 = time.perf_counter()
    commit = git_commit()  # at start: the tree may move during a long run
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    cfg = loaded.config
    if args.context > cfg.max_position_embeddings:
        ap.error(f"--context {args.context} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    if loaded.tokenizer_path is None:
        sys.exit(f"{args.model}: no tokenizer found beside the checkpoint")
    tok = load_tokenizer(loaded.tokenizer_path)
    raw = Path(args.corpus).read_bytes()
    # universal newlines, as open() in text mode and HF datasets give it: our wikitext2_test.raw
    # has CRLF line ends, and a stray "\r" token before every newline costs ~1% perplexity
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    t_load = time.perf_counter()
    ids = np.asarray(tok.encode(text), np.int32)
    corpus_tokens = len(ids)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    t_tok = time.perf_counter()
    if len(ids) < 2:
        sys.exit(f"{args.corpus}: {len(ids)} tokens; at least 2 are needed to score one")
    print(f"model {cfg.name} ({loaded.dtype}), corpus {args.corpus}: {corpus_tokens} tokens"
          f"{f', evaluating the first {len(ids)}' if len(ids) < corpus_tokens else ''}; "
          f"load {t_load - t0:.1f}s, tokenize {t_tok - t_load:.1f}s", flush=True)

    C, G = args.context, args.page_size
    pages = C // G
    kv = init_kv_pages(cfg, pages, G, loaded.kv_dtype, kv_repeat=loaded.kv_repeat,
                       sharding=kv_cache_sharding(cfg, loaded.mesh), fill=float("nan"))
    step = make_step(loaded, C)
    plan = list(windows(len(ids), C, args.stride))
    nll_sum, scored = 0.0, 0
    t_start = time.perf_counter()
    t_first = None
    for w, (begin, end, first) in enumerate(plan):
        n = end - begin
        tokens = np.zeros(C, np.int32)
        tokens[:n] = ids[begin:end]
        k = end - first  # tokens scored in this window
        R = C - 1 if w == 0 else args.stride
        rows = np.full(R, n - 1, np.int32)
        rows[:k] = np.arange(first - begin - 1, n - 1)  # row i predicts corpus token begin + i + 1
        targets = np.zeros(R, np.int32)
        targets[:k] = ids[first:end]
        weights = np.zeros(R, np.float32)
        weights[:k] = 1.0
        meta = AttentionMetadata.build([n], [n], [list(range(pages))], pages_per_seq=pages)
        s, kv = step(loaded.params, tokens, rows, targets, weights, kv, meta)
        nll_sum += float(s)
        scored += k
        if t_first is None:
            t_first = time.perf_counter() - t_start  # includes the one compile
        if (w + 1) % args.progress_every == 0 or w + 1 == len(plan):
            el = time.perf_counter() - t_start
            eta = el / (w + 1) * (len(plan) - w - 1)
            print(f"  window {w + 1}/{len(plan)}  tokens scored {scored}  ppl {math.exp(nll_sum / scored):.4f}  "
                  f"elapsed {el:.0f}s  eta {eta:.0f}s", flush=True)
    wall = time.perf_counter() - t0
    eval_s = time.perf_counter() - t_start
    result = {
        "model": str(args.model), "model_name": cfg.name, "dtype": str(loaded.dtype),
        "corpus": str(args.corpus), "corpus_sha256": hashlib.sha256(raw).hexdigest(),
        "corpus_tokens": corpus_tokens, "evaluated_tokens": int(len(ids)), "scored_tokens": scored,
        "context": C, "stride": args.stride, "windows": len(plan),
        "nll_per_token": nll_sum / scored, "perplexity": math.exp(nll_sum / scored),
        "wall_s": round(wall, 1), "eval_s": round(eval_s, 1), "first_window_s": round(t_first or 0.0, 1),
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
    }
    print()
    print("| model | tokens scored | context/stride | perplexity | wall |")
    print(f"| {cfg.name} | {scored} | {C}/{args.stride} | {result['perplexity']:.4f} | {wall:.0f}s |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
