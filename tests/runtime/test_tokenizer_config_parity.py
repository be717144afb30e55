"""What a tokenizer's configuration adds to its vocabulary, read as the library it comes from reads it.

A HF model folder's tokenizer.json, as transformers 5 reads it: BOS and EOS come from the file's
post-processor (the config's add_bos_token / add_eos_token are not consulted where there is a
tokenizer.json), and the tokens it adds are BOS and EOS where the config names none. A GGUF
SentencePiece vocabulary's user-defined tokens, as llama.cpp encodes them."""

from __future__ import annotations

import json

import pytest

from runtime.tokenizer import Tokenizer, load_tokenizer
from tests.testing.data import shared_data_dir

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "[CLS]": 3, "[SEP]": 4, "hello": 5, "world": 6}


def _folder(path, post_processor, config, specials=("<unk>", "<s>", "</s>", "[CLS]", "[SEP]")):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    if post_processor is not None:
        tok.post_processor = post_processor
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _processors():
    from tokenizers import processors

    bos = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    eos = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 2)])
    cls = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                        special_tokens=[("[CLS]", 3), ("[SEP]", 4)])
    return {"bos": bos, "eos": eos, "cls": cls, "roberta": processors.RobertaProcessing(("</s>", 2), ("<s>", 1)),
            "none": None}


NAMED = {"bos_token": "<s>", "eos_token": "</s>"}
CASES = {
    "bos_template_no_config": ("bos", None),
    "bos_template_config_names_only_eos": ("bos", {"eos_token": "</s>"}),
    "cls_sep_template": ("cls", {"unk_token": "<unk>"}),
    "roberta_with_add_eos_false": ("roberta", {**NAMED, "add_eos_token": False}),
    "bos_template_with_add_eos_true": ("bos", {**NAMED, "add_eos_token": True}),
    "eos_template_with_add_bos_true": ("eos", {**NAMED, "add_bos_token": True}),
    "no_post_processor_with_add_bos_true": ("none", {**NAMED, "add_bos_token": True}),
    "bos_template_with_add_bos_false": ("bos", {**NAMED, "add_bos_token": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_special_tokens_added_as_transformers_adds_them(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    processor, config = CASES[case]
    folder = _folder(tmp_path / "t", _processors()[processor], config)
    ours, hf = Tokenizer.from_pretrained_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in ("hello world", "world"):
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    if case == "bos_template_no_config":  # a bare tokenizer.json too (load_tokenizer of the file)
        assert load_tokenizer(folder / "tokenizer.json").encode("hello world") == [1, 5, 6]
        assert ours.bos_id == 1



def test_tokens_the_config_declares_are_added_as_transformers_adds_them(tmp_path):
    """tokenizer_config.json's added_tokens_decoder entries tokenizer.json lacks (or holds with other
    flags), and named special tokens it does not list, are matched in text as transformers matches them."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken

    decl = {"content": "<tok>", "special": True, "normalized": False, "lstrip": True, "rstrip": True,
            "single_word": False}
    texts = ("hello <s> world </s>", "hello <tok> world", " <tok>hello", "<unk>")
    for i, in_json in enumerate((False, True)):  # the entry missing from tokenizer.json; there, with other flags
        folder = _folder(tmp_path / f"t{i}", None, {**NAMED, "added_tokens_decoder": {"7": decl}})
        if in_json:
            from tokenizers import Tokenizer as HFTokenizer

            tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            tok.add_special_tokens([AddedToken("<tok>", special=True, normalized=False)])
            tok.save(str(folder / "tokenizer.json"))
        ours, hf = Tokenizer.from_pretrained_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
        assert ours.vocab_size == len(hf) == 8
        for text in texts:
            assert ours.encode(text) == hf.encode(text), (in_json, text)
        assert ours.decode(ours.encode("hello <tok> world")) == hf.decode(hf.encode("hello <tok> world"),
                                                                         skip_special_tokens=True)
    # named special tokens tokenizer.json does not list as added tokens
    folder = _folder(tmp_path / "named", None, {**NAMED, "additional_special_tokens": ["[CLS]"]}, specials=())
    ours, hf = Tokenizer.from_pretrained_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in ("hello <s> [CLS] world</s>", "[SEP] <s>"):
        assert ours.encode(text) == hf.encode(text) and (1 in ours.encode(text)) == ("<s>" in text), text
    folder = _folder(tmp_path / "bad", None, {"added_tokens_decoder": {"9": decl}})  # 9 would leave a gap
    with pytest.raises(ValueError, match="declares '<tok>' as token 9, but the vocabulary gives it id 7"):
        Tokenizer.from_pretrained_dir(folder)

def test_split_special_tokens_encodes_them_as_text(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path / "t", _processors()["bos"], {**NAMED, "split_special_tokens": True})
    ours, hf = Tokenizer.from_pretrained_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "hello </s> world<s>"
    assert ours.encode(text) == hf.encode(text) and 2 not in ours.encode(text)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"")
    with pytest.raises(ValueError, match="split_special_tokens is supported with a tokenizer.json"):
        Tokenizer.from_pretrained_dir(folder)

def test_gguf_sentencepiece_user_defined_tokens_split_as_llama_cpp_splits_them(tmp_path):
    """llama.cpp splits USER_DEFINED tokens (a converter's non-special added tokens) out of the text
    as it does CONTROL ones, and the text after one starts afresh with its own space prefix; they
    decode as written and are not skipped as special."""
    import gguf
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    from runtime.gguf_tokenizer import read_gguf_metadata

    meta = read_gguf_metadata(shared_data_dir() / "tokenizers" / "ggml-vocab" / "ggml-vocab-llama-spm.gguf")
    tokens = [*meta["tokenizer.ggml.tokens"], "<|im_start|>", "<|im_end|>"]
    w = gguf.GGUFWriter(str(tmp_path / "chat.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([*meta["tokenizer.ggml.scores"], 0.0, 0.0])
    w.add_token_types([*meta["tokenizer.ggml.token_type"], gguf.TokenType.USER_DEFINED, gguf.TokenType.CONTROL])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = Tokenizer.from_gguf(tmp_path / "chat.gguf")
    # llama.cpp runs SentencePiece on each piece of text between them, a space put before each
    proto = sp_pb2.ModelProto()
    proto.ParseFromString((shared_data_dir() / "tokenizers" / "llama2_tokenizer.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    start, end = 32000, 32001
    cases = {"<|im_start|>user\nHi<|im_end|>": [start, *sp.encode(" user\nHi"), end],
             "Hello<|im_start|>world": [*sp.encode(" Hello"), start, *sp.encode(" world")],
             "a <|im_start|> b": [*sp.encode(" a "), start, *sp.encode("  b")]}
    for text, want in cases.items():
        assert tok.encode(text, add_special_tokens=False) == want, text
    # not special (a CONTROL token is skipped); the pieces after it keep their spaces, as in llama.cpp
    assert tok.decode([start, *sp.encode(" Hi"), end]) == "<|im_start|> Hi"


def test_tokenizer_model_folder_added_tokens_take_the_whitespace_their_flags_say(tmp_path):
    """A folder with a tokenizer.model only: added_tokens_decoder's lstrip / rstrip take the
    whitespace beside the token, as transformers' tokenizer built from the model does."""
    transformers = pytest.importorskip("transformers")

    def entry(content, **flags):
        return {"content": content, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                "special": True, **flags}

    model = shared_data_dir() / "tokenizers" / "llama2_tokenizer.model"
    (tmp_path / "tokenizer.model").write_bytes(model.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "added_tokens_decoder": {"0": entry("<unk>"), "1": entry("<s>"), "2": entry("</s>"),
                                 "32000": entry("<|im_start|>", lstrip=True),
                                 "32001": entry("<|im_end|>", rstrip=True)}}))
    ours, hf = Tokenizer.from_pretrained_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a   <|im_start|>b", "a<|im_end|>   b",
                 "a <|im_end|> <|im_start|> b"):
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text


@pytest.fixture(scope="module")
def tiny_spm_model() -> bytes:
    """A SentencePiece BPE model as Llama's (byte fallback, dummy prefix, no normalization), trained here."""
    import io

    import sentencepiece as spm

    sents = ["Hello world, this is a test.", "[INST] Hello [/INST] Hi there!", "Bye now.\nSee you.",
             "the quick brown fox jumps"] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sents), model_writer=buf, vocab_size=340, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   add_dummy_prefix=True, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", minloglevel=2)
    return buf.getvalue()


@pytest.mark.parametrize("config", [{}, {"legacy": True}, {"legacy": False}, {"add_prefix_space": False},
                                    {"legacy": True, "add_prefix_space": False}])
def test_llama_tokenizer_model_folders_place_the_prefix_space_as_transformers(tmp_path, tiny_spm_model, config):
    """A folder with a tokenizer.model alone: transformers 5's LlamaTokenizer prepends SentencePiece's
    space at the text's start only (legacy false, its default), before every stretch after a special
    token with legacy true, never before a space, and nowhere with add_prefix_space false. Every
    stretch got one, as sentencepiece gives it: `<s>[INST]` encoded `▁[` where transformers has `[`."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / "tokenizer.model").write_bytes(tiny_spm_model)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **config}))
    hf, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)
    for text in ("<s>[INST] Hello [/INST]Hi!</s>\nBye  now </s> the", "Hi <s> Hello", " Hi there", "Hello", ""):
        want = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == hf.decode(want, skip_special_tokens=True), text


@pytest.mark.parametrize("config", [{"tokenizer_class": "LlamaTokenizer"}, {"tokenizer_class": "LlamaTokenizer",
                                                                            "add_prefix_space": False}, {},
                                    {"add_prefix_space": False}])
def test_tokenizer_model_folders_decode_as_transformers(tmp_path, tiny_spm_model, config):
    """Any ids of a tokenizer.model folder decode (and stream) as transformers 5's tokenizer built from
    it: <unk> is a special token written "<unk>" (sentencepiece's " ⁇ " was never skipped), and
    LlamaTokenizer strips one leading space however it was written (a <0x20> byte too)."""
    import numpy as np

    transformers = pytest.importorskip("transformers")
    (tmp_path / "tokenizer.model").write_bytes(tiny_spm_model)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **config}))
    hf, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)
    words = ours.encode("Hello world, the quick fox", add_special_tokens=False)
    pool = [0, 1, 2, 3 + 0x20, 3 + ord("a"), 3 + 0xC3, 3 + 0xA9, *words]  # <unk> <s> </s>, bytes, words
    rng = np.random.default_rng(0)
    for k in range(300):
        ids = [int(i) for i in rng.choice(pool, size=int(rng.integers(1, 7)))]
        for skip in (True, False):
            want = hf.decode(ids, skip_special_tokens=skip)
            if "\ufffd" in want:  # invalid byte runs: HF replaces the whole run (a known difference)
                continue
            det = ours.incremental_detokenizer(skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == want, (ids, skip)
            assert "".join(det.step([i]) for i in ids) + det.flush() == want, (ids, skip)
