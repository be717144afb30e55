"""HF chat templates: the jinja2 environment they render in (as transformers sets it up), their
compilation (cached, with errors that name the line), which of a model's named templates to use,
the messages as transformers hands them to the template, and its continue_final_message cut.
Tokenizer.apply_chat_template and the servers' --chat-template use them."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # transformers' tojson: unlike jinja2's, it does not HTML-escape and keeps non-ASCII as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# transformers' continue_final_message marker: appended to the final message's content, rendered,
# and cut at, so the cut cannot land inside the template's own closing tokens (content "<" or "im"
# with ChatML). The same text as transformers', so that both render exactly the same string.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning is passed under; templates read the first (Qwen3) or `thinking` (gpt-oss).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def select_chat_template(templates: Mapping[str, str], chat_template: str | None, tools: Any, source: str) -> str:
    """The template text to render, as transformers' get_chat_template picks it: `chat_template` names
    one of a model's several templates (or is template text), else `tool_use` when tools are given
    (an empty list included), else `default`. A model with one template keeps it as text, as
    transformers does, so `chat_template` is then always template text."""
    named = len(templates) > 1 or (len(templates) == 1 and "default" not in templates)
    if chat_template is not None:
        return templates[chat_template] if named and chat_template in templates else chat_template
    if not templates:
        raise ValueError(f"{source} has no chat template")
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" not in templates:
        raise ValueError(f"{source} has chat templates {sorted(templates)} but no 'default'; pass one of their "
                         "names as chat_template")
    return templates["default"]


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fresh message dicts as transformers gives them to the template: keys whose value is None
    dropped (the OpenAI SDK's `tool_calls: null` sends Llama 3's template down its tool-call branch),
    and a message's reasoning, under any of `reasoning_content`/`thinking`/`reasoning` (the first set
    wins), also under `reasoning_content` and, when absent, `thinking`."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a mapping with role and content, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], context: Mapping[str, Any], *,
                         continue_final_message: bool = False) -> str:
    """`template` rendered with normalize_messages(messages) and `context`. continue_final_message
    (transformers' rule): the text ends where the final message's content does; a ValueError if the
    message has no content, or the template does not write it."""
    chat = normalize_messages(messages)
    final = _mark_final_message(chat, template) if continue_final_message else None
    text = compile_chat_template(template).render({**context, "messages": chat})
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set, but the chat template does not write the last message's "
                         f"content {final.strip()!r} (or drops part of it)")
    at = text.rindex(tag)
    # a template that trims the content drops the marker's space, and the content's trailing spaces too
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def _mark_final_message(chat: list[dict[str, Any]], template: str) -> str:
    """Appends _CONTINUE_TAG to the final message's content (its last text part, for content parts)
    in `chat`, a fresh copy; returns the content it marked."""
    if not chat:
        raise ValueError("continue_final_message is set, but there is no message to continue")
    last = chat[-1]
    content = last.get("content")
    if content is None:
        raise ValueError("continue_final_message is set, but the final message has no content to continue")
    if "content" not in template:
        raise ValueError("continue_final_message is set, but the chat template never reads a message's content")
    if isinstance(content, (list, tuple)):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for p in reversed(parts):
            if isinstance(p, dict) and "text" in p:
                final, p["text"] = p["text"], f"{p['text']}{_CONTINUE_TAG}"
                break
        else:
            raise ValueError("continue_final_message is set, but the final message has no text part to continue")
        chat[-1] = {**last, "content": parts if isinstance(content, list) else tuple(parts)}
    elif isinstance(content, str):
        final = content
        chat[-1] = {**last, "content": content + _CONTINUE_TAG}
    else:
        raise ValueError(f"continue_final_message is set, but the final message's content is a "
                         f"{type(content).__name__}, not a string or content parts")
    if not isinstance(final, str):
        raise ValueError(f"continue_final_message is set, but the final text part is a {type(final).__name__}")
    return final


@functools.lru_cache(maxsize=16)
def content_format(template: str) -> str:
    """How `template` reads a message's content, as vLLM's content-format detection decides it:
    "openai" where it loops over the content (`{% for part in message['content'] %}`, directly or
    through a variable set from it), so the content must be a list of parts; else "string". An
    OpenAI-style server gives the first its parts and the second their text."""
    from jinja2 import nodes

    ast = chat_template_environment().parse(template)

    def unfiltered(node):  # x | selectattr(...) | list -> x
        while isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        return node

    def content_of(node) -> bool:  # x['content'] / x.content
        node = unfiltered(node)
        return ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")
                or (isinstance(node, nodes.Getattr) and node.attr == "content"))

    names = {a.target.name for a in ast.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and content_of(a.node)}

    def loops_over_content(node) -> bool:
        node = unfiltered(node)
        return content_of(node) or (isinstance(node, nodes.Name) and node.name in names)

    return "openai" if any(loops_over_content(f.iter) for f in ast.find_all(nodes.For)) else "string"


@functools.lru_cache(maxsize=16)
def compile_chat_template(text: str):
    """`text` parsed in chat_template_environment(); a syntax error is a ValueError that names
    its line, so a server can refuse a broken template at start-up instead of at the first chat."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return chat_template_environment().from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


@functools.cache
def chat_template_environment():
    """The jinja2 environment HF chat templates render in (as transformers sets it up; one, shared):
    sandboxed, trim_blocks/lstrip_blocks, `{% generation %}`, loop controls, HF's `tojson`,
    `raise_exception`, `strftime_now`, and transformers' restricted `dict` and `namespace`.
    Tokenizer.apply_chat_template and the servers' --chat-template both use it."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        transformers; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # jinja's own `dict` is the type: `dict.update(messages[0], ...)` would edit the caller's messages
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _template_namespace_class()
    return env


class _TemplateDict:
    """The `dict` templates see (transformers' TemplateDict): building dicts only."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    from jinja2.exceptions import SecurityError

    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                            f"{name!r}")


@functools.cache
def _template_namespace_class():
    """jinja's `namespace` refusing underscore-prefixed attributes, as transformers' TemplateNamespace
    does: they could reach the namespace's own internals (`_Namespace__attrs`)."""
    from jinja2.utils import Namespace

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # jinja's signature, so that `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_namespace_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_namespace_name(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace
