"""`xlaserve generate` / `convert` as a user runs them (subprocess, real console script)."""

import json
import shutil
import struct
import subprocess
import sys

import pytest

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


def test_generate_text_prompt_and_convert_roundtrip(tmp_path):
    model = shared_data_dir() / "stories260k" / "stories260K.bin"
    args = ["--prompt", "Once upon a time", "--max-tokens", "8", "--json"]
    first = xlaserve("generate", "--model", str(model), *args)
    assert first.returncode == 0, first.stderr
    r = xlaserve("convert", str(model), str(tmp_path / "orbax"))
    assert r.returncode == 0, r.stderr
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
])
def test_bad_input_gives_one_clear_line(args, message):
    r = xlaserve(*args)
    assert r.returncode != 0 and message in r.stderr, r.stderr
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
