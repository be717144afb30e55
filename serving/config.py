"""Serving settings: ServerConfig (network, limits, security), and the YAML file that `xlaserve
serve --config` reads. Read once at start-up; the servers get frozen objects.

A config file has three parts; every `xlaserve serve` flag has a key here, and a flag given on the
command line wins over the file:

    model: /path/to/model-or-preset     # --model (default: the embedded SmolLM2-135M-Instruct)
    tokenizer: null                     # --tokenizer (default: the one that comes with the model)
    server:                             # ServerConfig fields (--host, --port, --grpc-port, ...)
      host: 127.0.0.1
      port: 8000
    engine:                             # runtime.config.EngineConfig fields (--max-num-seqs, ...)
      max_num_seqs: 32
      mesh: {tensor: 1}
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import yaml

from runtime.request import is_finite

# EngineConfig.decode_steps of `xlaserve serve` unless set (the engine's own default is 1): when no request
# waits, one device program samples 4 tokens of every running sequence. On H200s with llama3_2_1b this took
# the time per output token from 1.40-1.41 to 0.83-1.08 ms at one request in flight and from 2.99-3.38 to
# 0.99-1.12 ms at 32 requests/s; a request that arrives during a burst waits for it (a few ms). 8 bought
# little more (docs/serving.md, "Decode bursts and latency").
SERVE_DECODE_STEPS = 4

LOG_LEVELS = ("debug", "info", "warning", "error")  # ServerConfig.log_level, the names logging knows


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets (`[::1]:8000`), as gRPC and logs write addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int | None = 8000  # HTTP (OpenAI API, /health, /metrics); None: no HTTP server; 0: any free port
    grpc_port: int | None = 50051  # None: no gRPC server; 0: any free port
    served_model_name: str | None = None  # the `model` clients send; default: the checkpoint's name
    chat_template: str | None = None  # a jinja file (or inline template) replacing the model's own
    api_keys: tuple[str, ...] = ()  # when set, every route except health needs one of them
    # browser origins the HTTP API answers cross-origin (CORS), e.g. "https://app.example.com"; "*": any.
    # None by default: a page in a browser cannot call the server (vLLM allows any origin by default)
    allowed_origins: tuple[str, ...] = ()
    tls_certfile: str | None = None  # PEM certificate chain: HTTPS and gRPC over TLS
    tls_keyfile: str | None = None
    tls_ca_certfile: str | None = None  # with TLS: require client certificates signed by this CA (mTLS)
    max_waiting_requests: int = 256  # requests accepted but not yet started; beyond: 429 / RESOURCE_EXHAUSTED
    max_waiting_tokens: int = 262144  # prompt tokens of those requests
    max_body_bytes: int = 4 * 2**20  # HTTP request body
    max_n: int = 16  # sequences per request (n; with a batch of prompts, prompts x n)
    max_stop: int = 16  # stop strings plus stop token ids per request
    max_prompt_chars: int = 1_000_000  # text before tokenizing (tokenizing is linear in it)
    retry_after_s: float = 1.0  # Retry-After sent with 429
    drain_timeout_s: float = 30.0  # on SIGTERM: time in-flight requests get before they are aborted
    health_stall_s: float = 30.0  # /health fails when the engine has work but made no step for this long
    status_interval_s: float = 10.0  # one-line status log period; 0 turns it off
    log_level: str = "info"

    def __post_init__(self) -> None:
        keys = self.api_keys
        if isinstance(keys, str):  # (a YAML file's `api_keys: KEY`)
            keys = (keys,)
        # api_keys errors name the type, not the value: a number meant as a key is still a secret
        if keys is not None and not isinstance(keys, (list, tuple)):
            raise ValueError(f"api_keys must be a list of non-empty strings, got {type(keys).__name__}")
        object.__setattr__(self, "api_keys", tuple(keys or ()))
        origins = (self.allowed_origins,) if isinstance(self.allowed_origins, str) else self.allowed_origins
        if not isinstance(origins, (list, tuple)) or not all(isinstance(o, str) and o for o in origins):
            raise ValueError(f"allowed_origins must be a list of origins such as 'https://app.example.com' "
                             f"(or '*'), got {self.allowed_origins!r}")
        object.__setattr__(self, "allowed_origins", tuple(origins))
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an address or host name (a string), got {self.host!r}")
        for name in ("served_model_name", "chat_template", "tls_certfile", "tls_keyfile", "tls_ca_certfile"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if not isinstance(self.log_level, str) or self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.lower())
        for name in ("port", "grpc_port"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= 65535):
                raise ValueError(f"{name} must be None or an int in [0, 65535], got {v!r}")
        if self.port and self.port == self.grpc_port:
            raise ValueError(f"port and grpc_port are both {self.port}; HTTP and gRPC need a port each")
        for name in ("max_waiting_requests", "max_waiting_tokens", "max_body_bytes", "max_n", "max_prompt_chars"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not _is_int(self.max_stop) or self.max_stop < 0:
            raise ValueError(f"max_stop must be an int >= 0, got {self.max_stop!r}")
        for name in ("retry_after_s", "drain_timeout_s", "health_stall_s", "status_interval_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (is_finite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        for i, k in enumerate(self.api_keys):
            if not isinstance(k, str) or not k:
                raise ValueError(f"api_keys[{i}] must be a non-empty string, got "
                                 f"{'an empty string' if k == '' else type(k).__name__}")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("TLS needs both tls_certfile and tls_keyfile")
        if self.tls_ca_certfile is not None and self.tls_certfile is None:
            raise ValueError("tls_ca_certfile (client certificates) needs tls_certfile and tls_keyfile")
        for name in ("tls_certfile", "tls_keyfile", "tls_ca_certfile"):
            v = getattr(self, name)
            if v is not None and not Path(v).is_file():
                raise ValueError(f"{name} {v} is not a file")
        if self.port is None and self.grpc_port is None:
            raise ValueError("both port and grpc_port are None: nothing would be served")
        if self.chat_template_text is not None:  # a missing or broken template fails now, not after the model loads
            from runtime.chat_template import compile_chat_template

            compile_chat_template(self.chat_template_text)

    @property
    def tls(self) -> bool:
        return self.tls_certfile is not None

    @functools.cached_property
    def chat_template_text(self) -> str | None:
        """The chat_template setting as template text: a file's contents (read once), or the inline template."""
        t = self.chat_template
        if t is None:
            return None
        if "{" not in t:  # no jinja syntax: a path
            p = Path(t)
            if not p.is_file():
                raise ValueError(f"chat_template {t} is not a file (inline templates contain jinja '{{' tags)")
            try:
                return p.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"chat_template {t} cannot be read: {e}") from None
        return t


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Everything `xlaserve serve` needs: what to load, the engine, the servers."""

    model: str | None = None
    tokenizer: str | None = None
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # EngineConfig keyword arguments
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)

    def engine_config(self, **overrides):
        """The runtime.config.EngineConfig these settings describe (`mesh` may be a mapping)."""
        from runtime.config import EngineConfig
        from sharding.mesh import MeshConfig

        kw = {"decode_steps": SERVE_DECODE_STEPS, **self.engine, **overrides}
        mesh = kw.get("mesh")
        if isinstance(mesh, dict):
            axes = [f.name for f in dataclasses.fields(MeshConfig)]
            bad = sorted(set(mesh) - set(axes), key=str)
            if bad:
                raise ValueError(f"engine settings: unknown mesh axes {bad}; allowed: {', '.join(axes)}")
            kw["mesh"] = MeshConfig(**mesh)
        elif mesh is not None and not isinstance(mesh, MeshConfig):
            raise ValueError(f"engine settings: mesh must be a mapping such as {{tensor: 2}}, got {mesh!r}")
        for name in ("token_buckets", "seq_buckets"):
            if isinstance(kw.get(name), list):
                kw[name] = tuple(kw[name])
        try:
            return EngineConfig(**kw)
        except TypeError as e:
            raise ValueError(f"engine settings: {e}") from None


_TOP_KEYS = ("model", "tokenizer", "server", "engine")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The config file as a dict with keys among model, tokenizer, server, engine (checked)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} {'is a folder' if p.is_dir() else 'does not exist'}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:  # (PyYAML's message spans lines: the problem and where, on one)
        raise ValueError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level must be a mapping with keys {', '.join(_TOP_KEYS)}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise ValueError(f"{p}: unknown top-level keys {unknown}; allowed: {', '.join(_TOP_KEYS)}")
    for section in ("server", "engine"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ValueError(f"{p}: '{section}' must be a mapping")
    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    bad = sorted(set(data.get("server") or {}) - server_fields)
    if bad:
        raise ValueError(f"{p}: unknown server settings {bad}; allowed: {', '.join(sorted(server_fields))}")
    from runtime.config import EngineConfig

    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    bad = sorted(set(data.get("engine") or {}) - engine_fields)
    if bad:
        raise ValueError(f"{p}: unknown engine settings {bad}; allowed: {', '.join(sorted(engine_fields))}")
    mesh = (data.get("engine") or {}).get("mesh")
    if mesh is not None and not isinstance(mesh, dict):  # (--tensor/--replica merge into it)
        raise ValueError(f"{p}: engine.mesh must be a mapping such as {{tensor: 2}}, got {mesh!r}")
    return data


def build_settings(file_data: dict[str, Any] | None, overrides: dict[str, dict[str, Any]]) -> ServeSettings:
    """Merge a loaded config file with command-line values: overrides = {"top": {...}, "server":
    {...}, "engine": {...}}, holding only the flags the user actually gave."""
    data = file_data or {}
    top = {k: data.get(k) for k in ("model", "tokenizer")}
    top.update(overrides.get("top", {}))
    server = {**(data.get("server") or {}), **overrides.get("server", {})}
    engine = {**(data.get("engine") or {}), **overrides.get("engine", {})}
    for name in ("model", "tokenizer"):
        if top[name] is not None and (not isinstance(top[name], str) or not top[name]):
            raise ValueError(f"{name} must be a path or preset name (a string), got {top[name]!r}")
    return ServeSettings(model=top["model"], tokenizer=top["tokenizer"], engine=engine, server=ServerConfig(**server))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
