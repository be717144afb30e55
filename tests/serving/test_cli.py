"""`xlaserve generate` / `convert` as a user runs them (subprocess, real console script)."""

import json
import shutil
import socket
import struct
import subprocess
import sys

import pytest
import yaml

from tests.testing.data import shared_data_dir

GOLDEN_START = "Once upon a time, there was a little girl named Lily. She loved"  # data README


def xlaserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "xlaserve", "--compile-cache", "none", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_json_contract_on_stories260k():
    model = shared_data_dir() / "stories260k" / "stories260K.bin"
    r = xlaserve("generate", "--model", str(model), "--prompt-ids", "1", "--max-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason"}
    assert out["prompt_token_ids"] == [1] and len(out["token_ids"]) == 16 and out["finish_reason"] == "length"
    assert out["text"] == "Once upon a time, there was a little girl named Lily. She" and GOLDEN_START.startswith(out["text"])


def test_generate_without_a_prompt_on_a_model_without_a_chat_template():
    """The demo question goes in as plain text where there is no chat template to put it in."""
    from runtime.tokenizer import load_tokenizer

    model = shared_data_dir() / "stories260k" / "stories260K.bin"
    r = xlaserve("generate", "--model", str(model), "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(shared_data_dir() / "stories260k" / "tok512.bin")
    assert json.loads(r.stdout.splitlines()[-1])["prompt_token_ids"] == tok.encode("What is the capital of France?")


def test_serve_names_the_embedded_model_as_the_docs_do():
    """Without --model the default model is served as "SmolLM2-135M-Instruct" (the README's requests
    name it so), not as its file's stem; a --served-model-name or a --model of one's own is kept."""
    from serving.cli import DEFAULT_MODEL_NAME, default_model_path, with_model
    from serving.config import ServerConfig, ServeSettings

    settings, model = with_model(ServeSettings())
    assert (settings.server.served_model_name, model) == (DEFAULT_MODEL_NAME, str(default_model_path()))
    named = ServeSettings(server=ServerConfig(served_model_name="mine"))
    assert with_model(named)[0].server.served_model_name == "mine"
    assert with_model(ServeSettings(model="m.gguf")) == (ServeSettings(model="m.gguf"), "m.gguf")


def test_generate_text_prompt_and_convert_roundtrip(tmp_path):
    """The converted checkpoint holds its own copy of the llama2.c tokenizer: it still works once the
    source is gone."""
    shutil.copytree(shared_data_dir() / "stories260k", tmp_path / "src")
    model = tmp_path / "src" / "stories260K.bin"
    args = ["--prompt", "Once upon a time", "--max-tokens", "8", "--json"]
    first = xlaserve("generate", "--model", str(model), *args)
    assert first.returncode == 0, first.stderr
    r = xlaserve("convert", str(model), str(tmp_path / "orbax"))
    assert r.returncode == 0, r.stderr
    shutil.rmtree(tmp_path / "src")
    again = xlaserve("generate", "--model", str(tmp_path / "orbax"), *args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == json.loads(first.stdout.splitlines()[-1])


@pytest.mark.parametrize("args,message", [
    (["generate", "--model", "/no/such/model"], "checkpoint /no/such/model does not exist"),
    (["generate", "--model", "stories260k", "--prompt", "hi"], "has no tokenizer; pass --prompt-ids"),
    (["generate", "--model", "stories260k", "--prompt-ids", "1,99999"], "outside the vocabulary [0, 512)"),
    (["generate", "--model", "stories260k", "--prompt-ids", "1", "--max-tokens", "600"], "exceeds the model's context of 512"),
    (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
    # sampling flags are checked before the model loads (this one does not exist)
    (["generate", "--model", "/no/such/model", "--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["generate", "--model", "/no/such/model", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--model", "/no/such/model", "--chat", "--prompt-ids", "1"], "cannot be used with --prompt-ids"),
    (["--compile-cache", "/proc/no/such", "generate", "--model", "/no/such/model"], "--compile-cache /proc/no/such: "),
    (["convert", "stories260k", "/proc/version/sub"], "is a file"),
])
def test_bad_input_gives_one_clear_line(args, message):
    r = xlaserve(*args)
    assert r.returncode == 2 and message in r.stderr.splitlines()[-1], r.stderr  # (argparse's: usage, then the line)
    assert "Traceback" not in r.stderr


def test_generate_on_a_context_that_is_not_a_power_of_two(tmp_path):
    """The engine is sized to the prompt + --max-tokens rounded up to a power of two, but never past
    the model's context: stories260K cut to a context of 300 runs 1 + 270 tokens."""
    src = shared_data_dir() / "stories260k"
    data = bytearray((src / "stories260K.bin").read_bytes())
    dim, _, _, n_heads, _, _, seq_len = struct.unpack_from("<7i", data)
    assert seq_len == 512
    struct.pack_into("<i", data, 24, 300)
    # llama2.c's legacy RoPE tables end the file: seq_len x head_size / 2 floats, twice
    cut = (seq_len - 300) * (dim // n_heads // 2) * 2 * 4
    (tmp_path / "stories260K.bin").write_bytes(data[:-cut])
    shutil.copy(src / "tok512.bin", tmp_path / "tok512.bin")
    r = xlaserve("generate", "--model", str(tmp_path / "stories260K.bin"), "--prompt-ids", "1", "--max-tokens", "270",
                 "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 270 or out["finish_reason"] == "stop"
    assert out["text"].startswith(GOLDEN_START)


# -- `xlaserve serve` start-up errors: one line, before the model loads ------------------------------

def _serve_error(*args, timeout=120) -> str:
    """`xlaserve serve ARGS` must fail at once with one `xlaserve: error:` line; returns that line."""
    r = xlaserve("serve", *args, timeout=timeout)
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("xlaserve: error: ")]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("which", ["--port", "--grpc-port"])
def test_serve_on_a_taken_port_names_it(taken_port, which):
    other = "--grpc-port" if which == "--port" else "--port"
    # the model does not exist: the port must be refused first
    line = _serve_error("--model", "/no/such/model", which, str(taken_port), other, "0")
    kind = "HTTP" if which == "--port" else "gRPC"
    assert f"cannot bind the {kind} port 127.0.0.1:{taken_port}: Address already in use" in line, line


@pytest.mark.parametrize("host", ["12345", "256.1.1.1"])
def test_serve_on_a_host_of_another_machine_names_it(host):
    line = _serve_error("--model", "/no/such/model", "--host", host, "--port", "0", "--grpc-port", "0")
    assert f"cannot bind the HTTP port {host}:0" in line, line


@pytest.mark.parametrize("config,message", [
    # (the type, not the value: a number meant as a key is a secret all the same)
    ({"server": {"api_keys": 123}}, "api_keys must be a list of non-empty strings, got int"),
    ({"server": {"api_keys": ["k", 5]}}, "api_keys[1] must be a non-empty string, got int"),
    ({"server": {"log_level": 10}}, "log_level must be one of debug, info, warning, error, got 10"),
    ({"server": {"log_level": "verbose"}}, "log_level must be one of debug, info, warning, error, got 'verbose'"),
    ({"server": {"host": 12345}}, "host must be an address or host name (a string), got 12345"),
    ({"server": {"port": 9000, "grpc_port": 9000}}, "port and grpc_port are both 9000"),
    ({"server": {"chat_template": "/nonexistent/t.jinja"}}, "chat_template /nonexistent/t.jinja is not a file"),
    ({"engine": {"mesh": {"tensr": 2}}}, "unknown mesh axes ['tensr']; allowed: replica, tensor, context"),
    ({"engine": {"mesh": 2}}, "mesh must be a mapping such as {tensor: 2}, got 2"),
    ({"engine": {"kv_memory_fraction": "x"}}, "kv_memory_fraction must be a number, got 'x'"),
    # (a quoted "false" is a string, which is truthy: prefix caching stayed on)
    ({"engine": {"enable_prefix_caching": "false"}}, "enable_prefix_caching must be True or False, got 'false'"),
    ({"server": {"drain_timeout_s": float("nan")}}, "drain_timeout_s must be a finite number >= 0, got nan"),
])
def test_serve_bad_config_value_is_one_line_before_the_model_loads(tmp_path, config, message):
    config = {**config, "server": {"port": 0, "grpc_port": 0, **config.get("server", {})}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    # a model that does not exist: reaching the load would say so instead
    line = _serve_error("--config", str(tmp_path / "c.yaml"), "--model", "/no/such/model")
    assert message in line, line


def test_serve_mesh_errors_come_before_the_ports(tmp_path):
    """A file's mesh that is not a mapping, with a mesh flag merged into it, was a TypeError
    traceback; a mesh of more devices than the machine has failed only after both ports were bound."""
    (tmp_path / "c.yaml").write_text("engine: {mesh: 2}\n")
    line = _serve_error("--config", str(tmp_path / "c.yaml"), "--tensor", "2", "--model", "/no/such/model")
    assert "engine.mesh must be a mapping such as {tensor: 2}, got 2" in line, line
    r = xlaserve("serve", "--tensor", "64", "--model", "/no/such/model", "--port", "0", "--grpc-port", "0")
    assert "needs 64 devices" in r.stderr and "listening" not in r.stderr, r.stderr


def test_serve_missing_chat_template_flag_is_one_line():
    line = _serve_error("--chat-template", "/nonexistent/t.jinja", "--model", "/no/such/model")
    assert "chat_template /nonexistent/t.jinja is not a file" in line, line


def test_serve_refuses_a_tokenizer_larger_than_the_model(stories_path):
    tok = shared_data_dir() / "tokenizers" / "llama2_tokenizer.model"
    if not tok.is_file():
        pytest.skip(f"{tok} is missing")
    r = xlaserve("serve", "--model", str(stories_path), "--tokenizer", str(tok), "--port", "0", "--grpc-port", "0")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"tokenizer {tok} has 32000 tokens; the model {stories_path} has a vocabulary of 512" in r.stderr, r.stderr
    assert "compiling" not in r.stderr, "refused only after the warmup compiles:\n" + r.stderr


def test_generate_text_through_a_mismatched_tokenizer_names_the_flag(tmp_path):
    """The model's own tokenizer has a token (id 512) the 512-row model lacks: --prompt text that
    encodes to it is the tokenizer's fault, not --prompt-ids'."""
    src = shared_data_dir() / "stories260k"
    shutil.copy(src / "stories260K.bin", tmp_path / "stories260K.bin")
    piece = "☃".encode()
    extra = struct.pack("<fi", 0.0, len(piece)) + piece  # llama2.c format: score, length, bytes
    (tmp_path / "tok513.bin").write_bytes((src / "tok512.bin").read_bytes() + extra)
    r = xlaserve("generate", "--model", str(tmp_path / "stories260K.bin"), "--prompt", "Hello ☃", "--max-tokens", "4")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "--prompt encodes to ids outside the model's vocabulary [0, 512): [512]" in r.stderr, r.stderr
    assert "tokenizer (513 tokens) does not match the model" in r.stderr and "--prompt-ids" not in r.stderr, r.stderr
