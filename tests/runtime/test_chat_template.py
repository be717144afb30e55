"""Chat templates (runtime/chat_template.py through Tokenizer.apply_chat_template and the server's
render_chat) against transformers' apply_chat_template, on a tiny word-level tokenizer folder."""

from __future__ import annotations

import copy
import json

import pytest

from runtime.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRIMMED = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}</s>{% endfor %}"
PARTS = "{% for m in messages %}<a>{% for p in m.content %}{{ p.text }} {% endfor %}</a>{% endfor %}"
REASONING = "{% for m in messages %}{{ m | tojson }}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}"
NONE_KEYS = ("{% for m in messages %}{% if 'tool_calls' in m %}CALLS {{ m.tool_calls | length }} {% endif %}"
             "{{ m.content }}{% if m.refusal is defined %} REFUSED{% endif %};{% endfor %}")


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


def _folder(path, *, chat_template=None):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4, "hello": 5}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
           "unk_token": "<unk>", "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory, transformers_mod):
    d = _folder(tmp_path_factory.mktemp("chat") / "tok", chat_template=CHATML)
    return Tokenizer.from_pretrained_dir(d), transformers_mod.AutoTokenizer.from_pretrained(d)


def _both(pair, messages, template=None, **kw):
    """(ours, transformers') rendering of `messages`, or the exception type each raised."""
    ours, hf = pair
    out = []
    for render in (lambda m: ours.apply_chat_template(m, chat_template=template, **kw),
                   lambda m: hf.apply_chat_template(m, chat_template=template, tokenize=False, **kw)):
        try:
            out.append(render(copy.deepcopy(messages)))
        except Exception as e:  # the kind of error is compared, not its words
            out.append(ValueError if isinstance(e, ValueError) else type(e))
    return tuple(out)


# --- continue_final_message ----------------------------------------------------------------------


@pytest.mark.parametrize("content", ["<", "im", "end", "_", "|>", "\n", "Paris  ", "  spaced\n"])
def test_continue_final_message_cuts_at_the_message_not_in_the_closing_tokens(pair, content):
    """The content also appears in the template's closing `<|im_end|>`: the cut is where the final
    message ends (transformers' marker), not at the content's last occurrence."""
    chat = [{"role": "user", "content": "Write XML"}, {"role": "assistant", "content": content}]
    ours, hf = _both(pair, chat, add_generation_prompt=False, continue_final_message=True)
    assert ours == hf == "<|im_start|>user\nWrite XML<|im_end|>\n<|im_start|>assistant\n" + content


@pytest.mark.parametrize("content", ["", " ", "\n", "Paris   "])
@pytest.mark.parametrize("template", [CHATML, TRIMMED])
def test_continue_final_message_accepts_an_empty_or_blank_message(pair, template, content):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
    ours, hf = _both(pair, chat, template, add_generation_prompt=False, continue_final_message=True)
    assert isinstance(ours, str) and ours == hf


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.role }}{% endfor %}",  # never reads a message's content
    "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}",  # reads it, but not the final message's
    "{% for m in messages %}{{ m.content[:2] }}{% endfor %}",  # drops the marker
])
def test_continue_final_message_refuses_what_transformers_refuses(pair, template):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert _both(pair, chat, template, add_generation_prompt=False, continue_final_message=True) == (ValueError,) * 2
    no_content = [chat[0], {"role": "assistant", "content": None}]
    assert _both(pair, no_content, CHATML, add_generation_prompt=False, continue_final_message=True) == (
        ValueError,) * 2


def test_continue_final_message_continues_the_last_text_part(pair):
    parts = [{"type": "text", "text": "One"}, {"type": "image"}, {"type": "text", "text": "<a"}, {"type": "image"}]
    chat = [{"role": "assistant", "content": parts}]
    ours, hf = _both(pair, chat, PARTS, add_generation_prompt=False, continue_final_message=True)
    assert ours == hf == "<a>One  <a"
    assert parts[2] == {"type": "text", "text": "<a"}  # the caller's parts are left alone


# --- the messages the template sees --------------------------------------------------------------


def test_keys_whose_value_is_none_are_dropped(pair):
    """The OpenAI SDK's model_dump() writes tool_calls=None, refusal=None: transformers drops them."""
    chat = [{"role": "user", "content": "Hi", "name": None},
            {"role": "assistant", "content": "Hello", "tool_calls": None, "function_call": None, "refusal": None},
            {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]
    before = copy.deepcopy(chat)
    ours, hf = _both(pair, chat, NONE_KEYS)
    assert ours == hf == "Hi;Hello;CALLS 1 x;"
    assert pair[0].apply_chat_template(chat, chat_template=NONE_KEYS) == ours and chat == before


@pytest.mark.parametrize("fields", [
    {"reasoning": "r"},
    {"thinking": "t"},
    {"reasoning": "r", "thinking": "t"},
    {"reasoning_content": "c", "reasoning": "r"},
    {"reasoning_content": None, "thinking": None, "reasoning": "r"},
    {"thinking": "t", "reasoning_content": "c"},
])
def test_reasoning_fields_are_aliased_as_transformers_does(pair, fields):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", **fields}]
    ours, hf = _both(pair, chat, REASONING)
    assert ours == hf
    wins = next(fields[k] for k in ("reasoning_content", "thinking", "reasoning") if fields.get(k) is not None)
    assert f"[{wins}|" in ours


def test_the_server_renders_the_messages_as_transformers_does(pair):
    from serving.config import ServerConfig
    from serving.core import ServingCore

    core = ServingCore(ServerConfig())
    core.tokenizer = pair[0]  # render_chat needs the tokenizer alone, not an engine
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "tool_calls": None, "reasoning": "be polite"}]
    assert core.render_chat(chat) == pair[1].apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    core._chat_template = template = "{% for m in messages %}[{{ m.reasoning_content }}]{% endfor %}" + NONE_KEYS
    assert core.render_chat(chat) == _both(pair, chat, template)[1] == "[][be polite]Hi;Hello;"


# --- the sandbox ---------------------------------------------------------------------------------


@pytest.mark.parametrize("template", [
    "{{ dict.update(messages[0], {'content': 'PWNED'}) }}{{ messages[0].content }}",
    "{{ dict.clear(messages[0]) }}{{ messages[0].content }}",
    "{% set ns = namespace(_x=1) %}ok",
    "{% set ns = namespace(a=1) %}{% set ns._y = 2 %}ok",
])
def test_sandbox_refuses_what_transformers_refuses(pair, template):
    from jinja2.exceptions import TemplateError

    chat = [{"role": "user", "content": "original"}]
    with pytest.raises(TemplateError):
        pair[0].apply_chat_template(chat, chat_template=template)
    assert chat == [{"role": "user", "content": "original"}]
    assert all(isinstance(r, type) for r in _both(pair, chat, template))  # both raise


def test_sandbox_keeps_dict_and_namespace_working(pair):
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "{{ ns.n }} {{ dict(a=1, b=messages[0].content) | tojson }} {{ dict.fromkeys(['x'], 2) | tojson }}")
    ours, hf = _both(pair, [{"role": "user", "content": "c"}], template)
    assert ours == hf == '1 {"a": 1, "b": "c"} {"x": 2}'


# --- named templates -----------------------------------------------------------------------------

NAMED = {"default": "DEFAULT{% for m in messages %}{{ m.content }}{% endfor %}",
         "tool_use": "TOOL_USE{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}",
         "rag": "RAG{{ documents | tojson }}"}


@pytest.fixture(scope="module")
def named_pair(tmp_path_factory, transformers_mod):
    """A folder as transformers 5 saves several templates: chat_template.jinja and
    additional_chat_templates/<name>.jinja (the config's own chat_template is not read then)."""
    src = _folder(tmp_path_factory.mktemp("named") / "src", chat_template="CONFIG")
    hf = transformers_mod.AutoTokenizer.from_pretrained(src)
    hf.chat_template = dict(NAMED)
    d = src.parent / "saved"
    hf.save_pretrained(d)
    assert sorted(p.name for p in (d / "additional_chat_templates").iterdir()) == ["rag.jinja", "tool_use.jinja"]
    return Tokenizer.from_pretrained_dir(d), transformers_mod.AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("tools", [None, [], [{"type": "function", "function": {"name": "f", "parameters": {}}}]])
def test_named_templates_from_additional_chat_templates(named_pair, tools):
    chat = [{"role": "user", "content": "hi"}]
    ours, hf = _both(named_pair, chat, tools=tools)
    assert ours == hf and ours.startswith("DEFAULT" if tools is None else "TOOL_USE")  # an empty list counts
    assert named_pair[0].chat_template == NAMED["default"]


@pytest.mark.parametrize("name, expected", [
    ("rag", 'RAG[{"title": "t", "text": "x"}]'),
    ("tool_use", "TOOL_USEnullhi"),
    ("default", "DEFAULThi"),
    ("{{ messages | length }} rag", "1 rag"),  # not a name: template text
])
def test_chat_template_names_one_of_the_models_templates(named_pair, name, expected):
    chat = [{"role": "user", "content": "hi"}]
    assert _both(named_pair, chat, name, documents=[{"title": "t", "text": "x"}]) == (expected, expected)


def test_template_files_replace_the_configs_templates(tmp_path, transformers_mod):
    chat = [{"role": "user", "content": "hi"}]
    d = _folder(tmp_path / "only_named", chat_template="CONFIG")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(NAMED["tool_use"])
    pair = Tokenizer.from_pretrained_dir(d), transformers_mod.AutoTokenizer.from_pretrained(d)
    assert _both(pair, chat) == (ValueError,) * 2  # no default: the config's template is not used
    ours, hf = _both(pair, chat, tools=[])
    assert ours == hf == "TOOL_USE[]hi"
    # a model with one template takes chat_template as template text, even "default"
    single = _folder(tmp_path / "single", chat_template=NAMED["default"])
    pair = Tokenizer.from_pretrained_dir(single), transformers_mod.AutoTokenizer.from_pretrained(single)
    assert _both(pair, chat, "default") == ("default", "default")
