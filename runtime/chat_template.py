"""HF chat templates: the jinja2 environment they render in (as transformers sets it up), their
compilation (cached, with errors that name the line) and transformers' continue_final_message cut.
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


def cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`text` up to the end of the last message's content, as transformers' continue_final_message
    cuts it (a template that trims the content's trailing spaces is allowed for)."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    content = messages[-1].get("content")
    if isinstance(content, (list, tuple)):  # content parts: the last text part
        texts = [p.get("text") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip() or content.strip() not in text:
        raise ValueError("continue_final_message is set, but the chat template does not write the last message's "
                         "content (or it is empty)")
    at = text.rindex(content.strip())
    if text[at : at + len(content.lstrip())] == content.lstrip():
        return text[: at + len(content.lstrip())]
    return text[: at + len(content.strip())]


@functools.lru_cache(maxsize=16)
def compile_chat_template(text: str):
    """`text` parsed in chat_template_environment(); a syntax error is a ValueError that names
    its line, so a server can refuse a broken template at start-up instead of at the first chat."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return chat_template_environment().from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


def chat_template_environment():
    """The jinja2 environment HF chat templates render in (as transformers sets it up): sandboxed,
    trim_blocks/lstrip_blocks, `{% generation %}`, loop controls, HF's `tojson`, `raise_exception`,
    `strftime_now`. Tokenizer.apply_chat_template and the servers' --chat-template both use it."""
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
    return env
