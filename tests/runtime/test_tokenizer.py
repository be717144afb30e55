"""Tokenizers (runtime/tokenizer.py, gguf_tokenizer.py, detokenizer.py) against real vocabularies
and the libraries they come from: llama.cpp's tokenizer test vectors, sentencepiece, HF tokenizers
and transformers, and llama2.c's own expected tokens."""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import example, HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.detokenizer import StripMode
from runtime.gguf_tokenizer import PRE_TOKENIZERS, load_gguf_tokenizer, read_gguf_metadata
from runtime.tokenizer import Tokenizer, load_tokenizer
from tests.testing.data import shared_data_dir, smollm2_gguf_path, write_bpe_gguf

GGML_VOCABS = ("llama-bpe", "llama-spm", "qwen2")
GGML_CASES = 46  # strings per .inp file (shared/data/README.md)
SEPARATOR = "\n__ggml_vocab_test__\n"


def _ggml_path(name: str) -> Path:
    return shared_data_dir() / "tokenizers" / "ggml-vocab" / f"ggml-vocab-{name}.gguf"


def _llama2_model_path() -> Path:
    return shared_data_dir() / "tokenizers" / "llama2_tokenizer.model"


def _tok512_path() -> Path:
    return shared_data_dir() / "stories260k" / "tok512.bin"


@functools.cache
def _ggml_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(_ggml_path(name))


@functools.cache
def _ggml_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 format: convert_hf_to_gguf_update.py writes each string followed
    by "\\n__ggml_vocab_test__\\n" (so the newline before a separator is not part of the string),
    and one line of space-separated ids per string."""
    path = _ggml_path(name)
    # bytes, not read_text: "\r" and "\r\n" inside strings must stay as written
    inp = Path(f"{path}.inp").read_bytes().decode("utf-8")
    out = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    texts = inp.split(SEPARATOR)
    assert texts[-1] == "" and out[-1] == "", "both files end with a separator / newline"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts[:-1], out[:-1], strict=True)]


@functools.cache
def _llama2() -> Tokenizer:
    return load_tokenizer(_llama2_model_path())


@functools.cache
def _llama2_sp() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(_llama2_model_path()))


@functools.cache
def _tok512() -> Tokenizer:
    return load_tokenizer(_tok512_path())


# --- llama.cpp's vocabulary test vectors -----------------------------------------------------------


@pytest.mark.parametrize("name", GGML_VOCABS)
def test_ggml_vocab_files_have_all_cases(name):
    cases = _ggml_cases(name)
    assert len(cases) == GGML_CASES
    assert cases[2] == ("", [])  # the third string is empty: the parser must not eat neighbours
    assert cases[7][0] == "\n" and cases[8][0] == "\n\n"  # strings that are only newlines


@pytest.mark.parametrize("index", range(GGML_CASES))
@pytest.mark.parametrize("name", GGML_VOCABS)
def test_ggml_vocab_encode_matches_reference(name, index):
    text, expected = _ggml_cases(name)[index]
    assert _ggml_tokenizer(name).encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize("name", GGML_VOCABS)
def test_ggml_vocab_decode_inverts_encode(name):
    tok = _ggml_tokenizer(name)
    for text, expected in _ggml_cases(name):
        assert tok.decode(expected) == text


def test_ggml_vocab_special_tokens():
    llama3, qwen2, spm_ = (_ggml_tokenizer(n) for n in ("llama-bpe", "qwen2", "llama-spm"))
    assert llama3.bos_id == 128000 and llama3.add_bos_token
    assert llama3.eos_ids == (128001, 128009)  # <|end_of_text|>, then <|eot_id|> that ends a turn
    assert llama3.encode("hi") == [128000, 6151]
    assert llama3.encode("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False) == [128006, 882, 128007]
    assert qwen2.eos_ids == (151643, 151645) and not qwen2.add_bos_token and qwen2.pad_id == 151643
    assert qwen2.encode("<|im_start|>user", add_special_tokens=True) == [151644, 872]
    assert spm_.encode("Hello world") == [1, 15043, 3186] and spm_.eos_ids == (2,)
    assert {1, 2} <= spm_.special_ids and 0 not in spm_.special_ids
    assert qwen2.chat_template.startswith("{% for message in messages %}")
    assert "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n" in qwen2.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_gguf_metadata_reader_matches_gguf_package(tmp_path, endian):
    import gguf

    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian[endian])
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcode ▁ 🦙")
    w.add_array("t.strings", ["a", "ß", "", "Ġab"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [1.5, -2.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    ours = read_gguf_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert ours.keys() == theirs.keys() and len(ours) == 18
    for k, v in theirs.items():
        if k != "t.nested":  # GGUFReader.contents() flattens arrays of arrays
            assert np.array_equal(np.asarray(ours[k], dtype=object), np.asarray(v, dtype=object)), k
    assert ours["t.str"] == "ünïcode ▁ 🦙" and ours["t.nested"] == [[1, 2], [3]] and ours["t.u64"] == 2**63


def test_gguf_spm_equals_sentencepiece_model():
    """The ModelProto rebuilt from GGUF metadata tokenizes like the original Llama 2 model."""
    ours, sp = _ggml_tokenizer("llama-spm"), _llama2_sp()
    for text in ["Hello world", "  lead", "tab\there", "naïve café 東京 🦙", "<s> not special", "x" * 40]:
        assert ours.encode(text, add_special_tokens=False) == _encode_sp_split(sp, text)


def _encode_sp_split(sp, text):
    # sentencepiece leaves "<s>" as characters; our tokenizer (like llama.cpp and HF) matches it as BOS
    ids = []
    for k, part in enumerate(text.split("<s>")):
        if k:
            ids.append(1)
        if part:
            ids.extend(sp.encode(part))
    return ids


# --- Llama 2 SentencePiece model -----------------------------------------------------------------


def test_llama2_hello_world():
    tok = _llama2()
    assert tok.encode("Hello world") == [1, 15043, 3186]
    assert tok.encode("Hello world", add_special_tokens=False) == [15043, 3186]
    assert tok.decode([1, 15043, 3186]) == "Hello world"
    assert tok.decode([1, 15043, 3186], skip_special_tokens=False) == "<s> Hello world"
    assert (tok.bos_id, tok.eos_ids, tok.vocab_size, tok.pad_id) == (1, (2,), 32000, None)
    assert tok.id_to_piece(15043) == "▁Hello" and tok.id_to_piece(13) == "<0x0A>"


LLAMA2_TEXTS = [
    "Hello world",
    " leading space",
    "   three leading",
    "trailing  ",
    "line one\nline two\n\n",
    "\ttabbed\r\nCRLF",
    "naïve café — 東京 🦙 emoji 👍🏽",
    "Ελληνικά and русский",
    "numbers 3.14159 and 1,000,000",
    " ",
    "",
    "<s>[INST] a chat turn [/INST]",
]


@pytest.mark.parametrize("text", LLAMA2_TEXTS)
def test_llama2_roundtrip_and_matches_sentencepiece(text):
    tok, sp = _llama2(), _llama2_sp()
    ids = tok.encode(text)
    assert ids[0] == 1
    assert ids[1:] == _encode_sp_split(sp, text)
    assert tok.decode(ids) == text.replace("<s>", "")
    assert tok.decode(ids, skip_special_tokens=False).replace("<s> ", "<s>", 1) == "<s>" + text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 31999) | st.integers(0, 300) | st.sampled_from([29871, 259, 35, 13]), max_size=16))
@example(ids=[197, 1, 131])  # a skipped BOS between two byte pieces ends the byte run
def test_llama2_decode_matches_sentencepiece(ids):
    """Including invalid byte runs (one U+FFFD per byte) and the dummy-prefix rules."""
    assert _llama2().decode(ids) == _llama2_sp().decode(ids)


# --- llama2.c tokenizer ----------------------------------------------------------------------------


def test_tok512_decode_known_ids():
    tok = _tok512()
    # BOS ends a generation too: llama2.c's models end stories with it and run.c stops there
    assert tok.vocab_size == 512 and tok.bos_id == 1 and tok.eos_ids == (2, 1)
    assert [tok.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<0x00>"]
    ids = [1, 403, 407, 261, 378]
    assert tok.decode(ids) == "Once upon a time"
    assert [tok.id_to_piece(i) for i in ids[1:]] == [" Once", " upon", " a", " time"]
    assert tok.decode([1, 403, 2]) == "Once" and tok.decode([403]) == "Once"
    assert tok.decode([3 + 0xE2, 3 + 0x82, 3 + 0xAC]) == "€"  # byte-fallback tokens


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time",
        "Once upon a time, there was a little girl named Lily. She loved to play.",
        "Lily's mom said, \"Hi!\"\n",
        "héllo 🙂",
        "  two spaces",
    ],
)
def test_tok512_encode_roundtrip(text):
    tok = _tok512()
    ids = tok.encode(text)
    assert ids[0] == 1 and all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) or text == "héllo 🙂"  # merges happened


def test_tok512_once_upon_a_time_ids():
    assert _tok512().encode("Once upon a time") == [1, 403, 407, 261, 378]


@pytest.fixture(scope="module")
def llama2c_32k(tmp_path_factory) -> Tokenizer:
    """The Llama 2 model exported the way llama2.c's tokenizer.py writes tokenizer.bin."""
    sp = _llama2_sp()
    records, longest = [], 0
    for i in range(sp.get_piece_size()):
        piece = {sp.bos_id(): "\n<s>\n", sp.eos_id(): "\n</s>\n"}.get(i, sp.id_to_piece(i))
        b = piece.replace("▁", " ").encode("utf-8")
        longest = max(longest, len(b))
        records.append(struct.pack("<fi", sp.get_score(i), len(b)) + b)
    path = tmp_path_factory.mktemp("llama2c") / "tokenizer.bin"
    path.write_bytes(struct.pack("<i", longest) + b"".join(records))
    return Tokenizer.from_llama2c(path, vocab_size=32000)


def test_llama2c_encode_matches_run_c_test(llama2c_32k):
    # llama2.c's test.c expectations for its tokenizer.bin
    assert llama2c_32k.encode("I believe the meaning of life is") == [1, 306, 4658, 278, 6593, 310, 2834, 338]
    assert llama2c_32k.encode("") == [1]


@pytest.mark.parametrize("text", [t for t in LLAMA2_TEXTS if "<s>" not in t])
def test_llama2c_merges_match_sentencepiece(llama2c_32k, text):
    assert llama2c_32k.encode(text) == [1, *_llama2_sp().encode(text)]
    assert llama2c_32k.decode(llama2c_32k.encode(text)) == text


# --- streaming detokenization --------------------------------------------------------------------

STREAM_TOKENIZERS = {
    "llama2-spm": lambda: _llama2(),
    "llama-bpe": lambda: _ggml_tokenizer("llama-bpe"),
    "qwen2": lambda: _ggml_tokenizer("qwen2"),
    "tok512": lambda: _tok512(),
}
MULTIBYTE_TEXT = "naïve café 東京 🦙👍🏽 Ελληνικά ⁇ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "


@functools.cache
def _stream_material(name: str) -> tuple[Tokenizer, list[int], list[int]]:
    """(tokenizer, ids that are incomplete UTF-8 on their own, ids of multi-byte text)."""
    tok = STREAM_TOKENIZERS[name]()
    partial = []
    for i in range(tok.vocab_size):
        piece = tok.piece_table.pieces[i]
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            partial.append(i)
    text_ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert len(partial) >= 128 and len(text_ids) > 10
    return tok, partial, text_ids


def _stream(tok, ids, cuts, skip, prompt=()):
    det = tok.incremental_detokenizer(prompt_ids=prompt, skip_special_tokens=skip)
    out, start = [], 0
    for c in cuts:
        out.append(det.step(ids[start : start + c]))
        start += c
    out.append(det.step(ids[start:]))
    out.append(det.flush())
    return out


STREAM_LEN = 24


@pytest.mark.parametrize("name", list(STREAM_TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streaming_equals_full_decode(name, data):
    tok, partial, text_ids = _stream_material(name)
    n = tok.vocab_size
    specials = sorted(tok.special_ids)[:50]
    # spans of real multi-byte text (characters split across tokens), mixed with random ids
    span = data.draw(st.integers(0, len(text_ids) - 8))
    ids = data.draw(
        st.lists(
            st.integers(0, n - 1) | st.sampled_from(partial) | st.sampled_from(specials) | st.sampled_from(text_ids),
            min_size=STREAM_LEN - 8,
            max_size=STREAM_LEN - 8,
        )
    )
    at = data.draw(st.integers(0, len(ids)))
    ids = ids[:at] + text_ids[span : span + 8] + ids[at:]
    cuts = data.draw(st.lists(st.integers(0, 4), max_size=STREAM_LEN))
    skip = data.draw(st.booleans())
    full = tok.decode(ids, skip_special_tokens=skip)
    pieces = _stream(tok, ids, cuts, skip)
    assert "".join(pieces) == full
    # Nothing is emitted that a later token could still change: every prefix of the stream is a
    # prefix of the final text.
    assert all(full.startswith("".join(pieces[:k])) for k in range(len(pieces)))

    k = data.draw(st.integers(0, len(ids)))
    streamed = "".join(_stream(tok, ids[k:], cuts, skip, prompt=ids[:k]))
    assert full.endswith(streamed)
    prompt_text = tok.decode(ids[:k], skip_special_tokens=skip)
    if not prompt_text.endswith("\ufffd"):
        assert prompt_text + streamed == full


@pytest.mark.parametrize("name", list(STREAM_TOKENIZERS))
def test_streaming_holds_back_split_characters(name):
    tok = STREAM_TOKENIZERS[name]()
    text = "🦙 東京 é"
    ids = tok.encode(text, add_special_tokens=False)
    det = tok.incremental_detokenizer()
    deltas = [det.step([i]) for i in ids] + [det.flush()]
    assert "".join(deltas) == text
    split_at = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert split_at  # some character's bytes span tokens
    for k in range(1, len(ids) + 1):
        # what has streamed is the text so far, less the character still incomplete
        assert "".join(deltas[:k]) == tok.decode(ids[:k]).rstrip("\ufffd")


def test_streaming_after_prompt_keeps_leading_space():
    tok = _llama2()
    prompt = tok.encode("The capital of France is")
    det = tok.incremental_detokenizer(prompt_ids=prompt)
    assert det.step(tok.encode(" Paris", add_special_tokens=False)[-1:]) == " Paris"
    fresh = tok.incremental_detokenizer()
    assert fresh.step([1]) + fresh.step(tok.encode("Paris", add_special_tokens=False)) == "Paris"


def test_streaming_flush_emits_dangling_bytes_once():
    tok = _llama2()
    det = tok.incremental_detokenizer()
    assert det.step([3 + 0xF0, 3 + 0x9F]) == ""
    assert det.flush() == "\ufffd\ufffd" == tok.decode([3 + 0xF0, 3 + 0x9F])
    with pytest.raises(ValueError, match="flushed"):
        det.step([15043])


@pytest.mark.parametrize("name", list(STREAM_TOKENIZERS))
def test_streaming_after_a_prompt_cut_inside_a_character(name):
    """A prompt of ids that ends inside a character: output that completes it emits it whole; output
    that does not leaves it to the prompt (decode shows it there as U+FFFD) and starts afresh. The
    prompt's bytes came out as U+FFFD at the output's start, even when it was only EOS."""
    tok = STREAM_TOKENIZERS[name]()
    ids = tok.encode("Hi 𝔘", add_special_tokens=False)
    cut = max(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    more = tok.encode(" world", add_special_tokens=False)[-1:]
    for out in (more, ids[cut:] + more, ids[cut:-1], []):
        det = tok.incremental_detokenizer(prompt_ids=ids[:cut])
        streamed = "".join(det.step([i]) for i in out) + det.flush()
        complete = out[:len(ids) - cut] == ids[cut:]
        want = tok.decode(ids + more)[len(tok.decode(ids[:cut]).rstrip("\ufffd")):] if complete else \
            tok.decode(ids[:cut] + out)[len(tok.decode(ids[:cut])):]
        assert streamed == want, (out, streamed)


# --- tokenizer.json folders, compared with transformers --------------------------------------------

CHAT_TEMPLATE = """{%- set ns = namespace(sys=none) -%}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.sys = messages[0]['content'] | trim %}
{%- endif %}
{{- bos_token }}
{%- if tools %}
TOOLS: {{ tools | tojson(indent=2) }}
{% endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if loop.first and ns.sys is not none %}
<<SYS>>{{ ns.sys }}<</SYS>>
    {% endif %}
    {%- if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {%- elif message['role'] == 'user' %}
<|im_start|>user {{ message['content'] | tojson }}
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant{% if date %} ({{ date }}){% endif %}
{% endif %}"""

CHAT = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Grüße, \"quoted\" <b>tag</b> 東京"},
    {"role": "assistant", "content": "Hallo!"},
    {"role": "user", "content": "Again"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich"}}}]


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen2_dir")
    load_gguf_tokenizer(_ggml_path("qwen2")).hf_tokenizer.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643], "bos_token_id": 151643}))
    return d


@pytest.fixture(scope="module")
def qwen2_pair(qwen2_dir, transformers_mod):
    return Tokenizer.from_pretrained_dir(qwen2_dir), transformers_mod.AutoTokenizer.from_pretrained(qwen2_dir)


def test_pretrained_dir_tokenizer_json(qwen2_pair):
    ours, hf = qwen2_pair
    assert ours.eos_ids == (151645, 151643) and ours.pad_id == 151643 and ours.bos_id is None
    for text in ["Hello world", *[t for t, _ in _ggml_cases("qwen2")[::5]], "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text)
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    # gguf and folder forms of the same vocabulary agree
    assert ours.encode(MULTIBYTE_TEXT) == _ggml_tokenizer("qwen2").encode(MULTIBYTE_TEXT)


@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_matches_transformers(qwen2_pair, gen_prompt, tools):
    ours, hf = qwen2_pair
    kwargs = {"tools": tools, "date": "26 Jul 2024"}
    expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen_prompt, **kwargs)
    got = ours.apply_chat_template(CHAT, add_generation_prompt=gen_prompt, **kwargs)
    assert got == expected
    assert '"Grüße, \\"quoted\\" <b>tag</b> 東京"' in got  # tojson: no HTML escaping, no \\u escapes


@pytest.mark.parametrize("last", ["The capital of France is", "Paris   ", "  spaced\n"])
def test_continue_final_message_matches_transformers(qwen2_pair, last):
    ours, hf = qwen2_pair
    chat = [{"role": "user", "content": "Where is the Eiffel Tower?"}, {"role": "assistant", "content": last}]
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    got = ours.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and not got.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(chat, continue_final_message=True)
    with pytest.raises(ValueError, match="does not write the last message's content"):
        ours.apply_chat_template(chat[:1] + [{"role": "assistant", "content": "x"}], add_generation_prompt=False,
                                 continue_final_message=True, chat_template="{{ messages[0].content }}")
    # an empty or blank message is continued too (tests/runtime/test_chat_template.py), as in transformers


def test_chat_template_errors(tmp_path):
    from jinja2.exceptions import SecurityError, TemplateError

    (tmp_path / "tokenizer.model").symlink_to(_llama2_model_path())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    ours = Tokenizer.from_pretrained_dir(tmp_path)
    assert ours.apply_chat_template(CHAT[1:2]).startswith('<s><|im_start|>user "Grüße')
    with pytest.raises(TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        _llama2().apply_chat_template(CHAT)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    (tmp_path / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(SecurityError):  # the sandbox forbids mutating the caller's list
        Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template(CHAT)
    (tmp_path / "chat_template.jinja").write_text("{{ strftime_now('%Y') | length }}")
    assert Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template(CHAT) == "4"
    (tmp_path / "chat_template.jinja").write_text("{% if messages %}\n{{ messages[0].content }}")  # no endif
    broken = Tokenizer.from_pretrained_dir(tmp_path)  # loading does not need the template
    with pytest.raises(ValueError, match=r"does not parse: .*endif.* \(line 2\)"):
        broken.apply_chat_template(CHAT)
    # a template given to the call replaces the model's (transformers' chat_template=)
    assert broken.apply_chat_template(CHAT[1:2], chat_template="{{ eos_token }}{{ messages | length }}") == "</s>1"


def test_pretrained_dir_llama_style_tokenizer_json(tmp_path, transformers_mod):
    """transformers' own Llama tokenizer.json: Metaspace pre-tokenizer, and the Replace/ByteFallback/
    Fuse/Strip decoder that strips the leading space of the output."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.model").symlink_to(_llama2_model_path())
    transformers_mod.LlamaTokenizer.from_pretrained(src).save_pretrained(tmp_path / "out")
    ours = Tokenizer.from_pretrained_dir(tmp_path / "out")
    hf = transformers_mod.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert ours.piece_table.strip is StripMode.OUTPUT
    for text in LLAMA2_TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert "".join(_stream(ours, ids, [1] * len(ids), True)) == ours.decode(ids)


def test_a_skipped_special_token_inside_a_byte_run(tmp_path, transformers_mod):
    """SentencePiece ends a byte-fallback run at a skipped control token (<0xC3> </s> <0xA9> is two
    invalid bytes); HF tokenizers (a tokenizer.json) and llama.cpp (a GGUF) drop the token first,
    so the run goes on to "é". Streamed, the same."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.model").symlink_to(_llama2_model_path())
    transformers_mod.LlamaTokenizer.from_pretrained(src).save_pretrained(tmp_path / "out")
    hf = transformers_mod.AutoTokenizer.from_pretrained(tmp_path / "out")
    cases = {".model": (_llama2(), "\ufffd\ufffd"), "gguf": (_ggml_tokenizer("llama-spm"), "é"),
             "tokenizer.json": (Tokenizer.from_pretrained_dir(tmp_path / "out"), "é")}
    for name, (tok, want) in cases.items():
        ids = [tok.piece_to_id("<0xC3>"), tok.eos_id, tok.piece_to_id("<0xA9>")]
        assert tok.decode(ids) == want, name
        for cuts in ([1, 1], [2], [1]):
            assert "".join(_stream(tok, ids, cuts, True)) == want, (name, cuts)
        assert tok.decode(ids, skip_special_tokens=False) == "\ufffd</s>\ufffd", name
        if name == ".model":
            assert _llama2_sp().decode(ids) == want
        elif name == "tokenizer.json":
            assert hf.decode(ids, skip_special_tokens=True) == want


def test_pretrained_dir_sentencepiece_with_config(tmp_path):
    (tmp_path / "tokenizer.model").symlink_to(_llama2_model_path())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "add_eos_token": True,
                "bos_token": {"content": "<s>", "special": True},
                "eos_token": "</s>",
                "added_tokens_decoder": {"32000": {"content": "<pad>", "special": True}},
                "pad_token": "<pad>",
                "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}],
            }
        )
    )
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.vocab_size == 32001 and tok.pad_id == 32000 and 32000 in tok.special_ids
    assert tok.encode("Hello world<pad>") == [1, 15043, 3186, 32000, 2]
    assert tok.decode([1, 15043, 32000, 2]) == "Hello"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"


# --- SmolLM2 GGUF, compared with transformers' GGUF loader ----------------------------------------


@pytest.fixture(scope="module")
def smollm2(transformers_mod):
    path = smollm2_gguf_path()
    ours = Tokenizer.from_gguf(path)
    hf = transformers_mod.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, hf


SMOLLM2_TEXTS = [
    "Hello world",
    "The Eiffel Tower is located in the city of",
    " 12345 abc 3.14",
    "x=1234;\n\n\tindent",
    "<|im_start|>user\nhi<|im_end|>\n",
    "naïve café 東京 🦙👍🏽",
    "I'm sure you'll see they'd",
    "def f(x):\n    return x**2  # comment",
    "",
]


@pytest.mark.slow  # transformers parses the 93 MB GGUF (~5 s)
@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_encode_matches_transformers(smollm2, text):
    ours, hf = smollm2
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2):
    ours, hf = smollm2
    chat = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]
    for gen_prompt in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=gen_prompt) == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen_prompt
        )
    assert not ours.add_bos_token and ours.eos_ids == (2, 0) and ours.pad_id == 2
    assert ours.encode(ours.apply_chat_template(chat), add_special_tokens=False)[:1] == [1]  # <|im_start|>


# --- bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        load_tokenizer,
        Tokenizer.from_sentencepiece,
        Tokenizer.from_gguf,
        Tokenizer.from_llama2c,
        Tokenizer.from_pretrained_dir,
    ],
)
def test_missing_file(tmp_path, make):
    with pytest.raises(FileNotFoundError, match="nope"):
        make(tmp_path / "nope")


def test_corrupt_files(tmp_path):
    garbage = bytes(range(256)) * 8
    for name in ["x.model", "x.gguf", "x.bin"]:
        (tmp_path / name).write_bytes(garbage)
        with pytest.raises(ValueError, match=name):
            load_tokenizer(tmp_path / name)
    constructors = {"y.model": Tokenizer.from_sentencepiece, "y.gguf": Tokenizer.from_gguf, "y.bin": Tokenizer.from_llama2c}
    for name, make in constructors.items():
        (tmp_path / name).write_bytes(garbage)
        with pytest.raises(ValueError, match=name):
            make(tmp_path / name)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_ggml_path("llama-spm").read_bytes()[:50000])
    with pytest.raises(ValueError, match="truncated|past the end"):
        Tokenizer.from_gguf(truncated)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "d")
    (tmp_path / "mystery.txt").write_text("hello")
    with pytest.raises(ValueError, match="mystery.txt"):
        load_tokenizer(tmp_path / "mystery.txt")


def test_unknown_gguf_pre_tokenizer(tmp_path):
    write_bpe_gguf(tmp_path / "odd.gguf", "made-up-pre")
    with pytest.raises(ValueError, match="'made-up-pre'.*not supported") as e:
        Tokenizer.from_gguf(tmp_path / "odd.gguf")
    assert "llama-bpe" in str(e.value) and set(PRE_TOKENIZERS) >= {"llama-bpe", "qwen2", "smollm", "default"}


def test_small_bpe_gguf(tmp_path):
    write_bpe_gguf(tmp_path / "ok.gguf", None)  # no tokenizer.ggml.pre: GPT-2's split
    tok = Tokenizer.from_gguf(tmp_path / "ok.gguf")
    assert tok.encode("ab ab<|end|>") == [2, 4, 5] and tok.eos_ids == (5,)
    assert tok.decode([2, 4, 5]) == "ab ab" and tok.decode([2, 4, 5], skip_special_tokens=False) == "ab ab<|end|>"


def test_gguf_special_ids_outside_the_vocabulary_are_ignored(tmp_path, caplog):
    """As llama.cpp does (a padding_token_id equal to the vocabulary size is common): a warning, not
    a file that cannot load."""
    write_bpe_gguf(tmp_path / "pad.gguf", pad_id=6)
    tok = Tokenizer.from_gguf(tmp_path / "pad.gguf")
    assert tok.pad_id is None and tok.eos_ids == (5,) and tok.encode("ab ab") == [2, 4]
    assert "tokenizer.ggml.padding_token_id is 6, outside the vocabulary of 6; ignored" in caplog.text


def test_tokenizer_json_saved_truncation_and_padding_are_ignored(tmp_path):
    """tokenizers saves truncation/padding settings in the file; applied, they cut and padded every
    prompt (transformers ignores them too)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.enable_truncation(max_length=2)
    hf.enable_padding(length=6, pad_id=0, pad_token="[UNK]")
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.encode("a b a b") == [1, 2, 1, 2] and tok.encode("b") == [2] and not tok.add_bos_token


def test_bad_ids_and_types():
    tok = _llama2()
    with pytest.raises(ValueError, match="32000.*32000 ids"):
        tok.decode([15043, 32000])
    with pytest.raises(ValueError, match="-1"):
        tok.incremental_detokenizer().step([-1])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    assert tok.decode(np.array([15043, 3186])) == "Hello world"
    d = tok.incremental_detokenizer()
    assert d.step(np.int64(15043)) + d.step(np.array(3186)) + d.step(np.array([3186])) == "Hello world world"


def test_tokenizer_json_without_a_decoder_joins_with_spaces(tmp_path):
    """HF tokenizers joins the tokens with spaces when the file has no decoder (they were run
    together); streamed after a prompt, each piece keeps its space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "<eos>": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<eos>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    for ids in ([1, 2, 1], [3, 1, 2], [1, 3, 2], [2]):
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    d = tok.incremental_detokenizer(prompt_ids=[1])
    assert d.step(2) + d.step(1) + d.flush() == hf.decode([1, 2, 1])[len("hello"):] == " world hello"


def test_unsupported_tokenizer_json_decoder(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    hf = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    hf.decoder = decoders.WordPiece()
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="decoder.*WordPiece.*not supported"):
        Tokenizer.from_pretrained_dir(tmp_path)
    # HF decoders act token by token until a Fuse: these orders decode otherwise than the usual ones
    # (Strip strips every token; ByteFallback and Metaspace act on the joined text), so are refused
    strip = decoders.Strip(" ", 1, 0)
    for chain, why in (([decoders.Replace("\u2581", " "), decoders.ByteFallback(), strip], "before a Fuse"),
                       ([strip, decoders.ByteFallback(), decoders.Fuse()], "before a Fuse"),
                       ([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()], "after Fuse")):
        hf.decoder = decoders.Sequence(chain)
        hf.save(str(tmp_path / "tokenizer.json"))
        with pytest.raises(ValueError, match=f"{why} is not supported"):
            Tokenizer.from_pretrained_dir(tmp_path)


@pytest.mark.parametrize("scheme", ["always", "first", "never"])
def test_tokenizer_json_metaspace_decoder_matches_hf(tmp_path, scheme):
    """HF's Metaspace decoder drops every "▁" of the first token (not one leading space, as
    SentencePiece does), unless prepend_scheme is "never"; the streamed text after a prompt keeps
    them."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "▁▁": 2, "▁a": 3, "b▁c": 4, "▁": 5, "d": 6, "<0x20>": 7}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    hf.add_special_tokens(["<s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    cases = ([2, 3], [3, 4], [4, 3], [5, 5, 6], [1, 2, 6], [1, 5], [6, 2], [7, 3], [2])
    for ids in cases:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
        for cut in range(1, len(ids)):
            d = tok.incremental_detokenizer(prompt_ids=ids[:cut])
            streamed = "".join(d.step(i) for i in ids[cut:]) + d.flush()
            assert tok.decode(ids[:cut]) + streamed == tok.decode(ids), (ids, cut)
