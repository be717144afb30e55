"""OpenAI API request parsing and response building (completions and chat completions).

Parsing is strict about types and ranges and names the offending parameter (`param` in the error
envelope); parameters we cannot honour (echo, suffix, tools, ...) are refused with a
400 rather than silently ignored. Beyond OpenAI's parameters, vLLM's extensions are accepted in
the body (the openai client's `extra_body`): top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, priority, cache_salt. A completions `prompt` may be a batch (a list of
strings and token id lists): one engine request per prompt, answered as one response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.request import MAX_LOGIT_BIAS, SamplingParams, is_finite
from serving.core import ChatOptions
from serving.errors import InvalidRequest, NotFound

_MISSING = object()


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM)
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list | None = None
    priority: int = 0
    cache_salt: str | None = None
    chat_logprobs: bool = False  # chat: logprobs were asked for (top_logprobs may be 0)
    chat: ChatOptions = field(default_factory=ChatOptions)
    # completions with a batch of 2 or more prompts: each a string or token ids (text/token_ids unset)
    prompts: list[str | list[int]] | None = None
    max_tokens_param: str = "max_tokens"  # the field that gave params.max_tokens (chat: max_completion_tokens too)


# vLLM's structured-output request fields (guided decoding); none is supported
_STRUCTURED_OUTPUT = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                      "structured_outputs")
# vLLM's other request fields that change the result, and the values that leave it as it is here
_VLLM_UNSUPPORTED = {"prompt_logprobs": (None,), "allowed_token_ids": (None,), "bad_words": (None,),
                     "truncate_prompt_tokens": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
                     "detokenize": (None, True), "return_tokens_as_token_ids": (None, False),
                     "spaces_between_special_tokens": (None, True), "logits_processors": (None,)}


# names the chat template's context holds already (Tokenizer.apply_chat_template): a client's
# chat_template_kwargs may not replace them
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "chat_template",
                                       "tools", "documents", "bos_token", "eos_token", "unk_token", "pad_token"})


# -- field readers -------------------------------------------------------------------------------
def _number(body, name, default, *, lo=None, hi=None, lo_open=False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {v!r}", param=name)
    if not is_finite(v):
        shown = v if isinstance(v, float) else "an integer past the range of floats"
        raise InvalidRequest(f"{name} must be a finite number, got {shown}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise InvalidRequest(f"{name} is {v}; it must be {'>' if lo_open else '>='} {lo}", param=name)
    if hi is not None and v > hi:
        raise InvalidRequest(f"{name} is {v}; it must be <= {hi}", param=name)
    return float(v)


def _integer(body, name, default, *, lo=None, hi=None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, float) and v.is_integer():  # 2.0: an integer, as pydantic (vLLM) reads it
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"{name} must be an integer, got {v!r}", param=name)
    if lo is not None and v < lo:
        raise InvalidRequest(f"{name} is {v}; it must be >= {lo}", param=name)
    if hi is not None and v > hi:
        raise InvalidRequest(f"{name} is {v}; it must be <= {hi}", param=name)
    return v


def _boolean(body, name, default):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"{name} must be true or false, got {v!r}", param=name)
    return v


def _string(body, name, default):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, str):
        raise InvalidRequest(f"{name} must be a string, got {v!r}", param=name)
    return v


def _stop(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {v!r}", param="stop")
    return v


def _int_list(body, name) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise InvalidRequest(f"{name} must be a list of integers >= 0, got {v!r}", param=name)
    return v


def _logit_bias(body) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"<token id>": bias in [-100, 100], ...} (JSON keys are strings)."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise InvalidRequest(f"logit_bias must be an object mapping token ids to biases, got {v!r}",
                             param="logit_bias")
    out = {}
    for k, b in v.items():
        # (at most 10 digits: no vocabulary is larger, and int() refuses strings of over 4,300)
        if not (isinstance(k, str) and k.isdigit() and k.isascii() and len(k) <= 10):
            shown = repr(k) if not isinstance(k, str) or len(k) <= 40 else f"a key of {len(k)} characters"
            raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0 as strings), got {shown}",
                                 param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise InvalidRequest(f"logit_bias[{k!r}] must be a number in [-100, 100], got {b!r}", param="logit_bias")
        out[int(k)] = float(b)
    if len(out) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(out)} token ids; at most {MAX_LOGIT_BIAS} are supported",
                             param="logit_bias")
    return out or None


def _refuse(body, name, allowed=(None,), why="is not supported", empty_ok=True):
    """A 400 naming `name` unless its value is one of `allowed` or (empty_ok) an empty list or object."""
    v = body.get(name)
    if v not in allowed and not (empty_ok and isinstance(v, (list, dict)) and not v):
        raise InvalidRequest(f"{name} {why} by this server (got {v!r})", param=name)


def check_model(body: dict, served: str) -> None:
    """The request's model names the served one; left out or null it means it (as in vLLM)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string naming the served model "
                             f"({served!r})", param="model")
    if model != served:
        raise NotFound(f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")


def _stream_opts(body, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options: a usage chunk before [DONE], and
    the usage so far on every chunk, with vLLM's defaults: include_usage true once stream_options is
    given, continuous_usage_stats false and only with include_usage."""
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not isinstance(so, dict):
        raise InvalidRequest(f"stream_options must be an object, got {so!r}", param="stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    include = _boolean(so, "include_usage", True)
    return include, include and _boolean(so, "continuous_usage_stats", False)


def _common(body: dict, *, max_tokens, logprobs, seed_default=None) -> tuple[SamplingParams, int, str | None]:
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise InvalidRequest(f"response_format {rf!r} is not supported (only {{'type': 'text'}})",
                             param="response_format")
    for name in _STRUCTURED_OUTPUT:  # vLLM's: silently ignored, they would give unconstrained text
        _refuse(body, name, why="(structured output) is not supported", empty_ok=False)  # ({}: any JSON)
    # refused on both routes, whichever API names them (vLLM's chat has echo too)
    if _boolean(body, "echo", False):
        raise InvalidRequest("echo is not supported by this server", param="echo")
    _refuse(body, "suffix")
    for name in ("tools", "functions"):
        _refuse(body, name, why="(tool calling) is not supported")
    _refuse(body, "tool_choice", allowed=(None, "none"), why="(tool calling) is not supported")
    _refuse(body, "function_call", allowed=(None, "none"), why="(tool calling) is not supported")
    for name, allowed in _VLLM_UNSUPPORTED.items():
        _refuse(body, name, allowed=allowed)
    n = _integer(body, "n", 1, lo=1)
    best_of = _integer(body, "best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise InvalidRequest(f"best_of ({best_of}) different from n ({n}) is not supported", param="best_of")
    logit_bias = _logit_bias(body)
    try:
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0, lo=0.0),
            top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=_integer(body, "top_k", 0, lo=-1),
            min_p=_number(body, "min_p", 0.0, lo=0.0, hi=1.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True),
            presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
            seed=_integer(body, "seed", seed_default, lo=-(2**63), hi=2**63 - 1),
            logprobs=logprobs,
            stop=_stop(body),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            min_tokens=_integer(body, "min_tokens", 0, lo=0),
            max_tokens=max_tokens,
            ignore_eos=_boolean(body, "ignore_eos", False),
            n=n,
            skip_special_tokens=_boolean(body, "skip_special_tokens", True),
            include_stop_str_in_output=_boolean(body, "include_stop_str_in_output", False),
            logit_bias=logit_bias,
        )
    except ValueError as e:  # SamplingParams' own checks (min_tokens <= max_tokens, float32's range, ...)
        name = str(e).split(" ", 1)[0]  # (its messages start with the field's name)
        raise InvalidRequest(str(e), param=name if name in body else None) from None
    priority = _integer(body, "priority", 0, lo=-(2**31), hi=2**31 - 1)
    cache_salt = _string(body, "cache_salt", None)
    if cache_salt == "":  # (as vLLM: an empty salt would name a cache of its own by mistake)
        raise InvalidRequest("cache_salt must be a non-empty string if given", param="cache_salt")
    return params, priority, cache_salt


def parse_completion(body: dict, served: str) -> ParsedRequest:
    check_model(body, served)
    stream = _boolean(body, "stream", False)
    include_usage, continuous = _stream_opts(body, stream)
    prompt = body.get("prompt", _MISSING)
    text = ids = batch = None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        for i, p in enumerate(prompt):  # a batch: strings and token id lists
            if isinstance(p, list) and not _token_ids(p):
                raise InvalidRequest(f"prompt[{i}] must be a string or a non-empty list of token ids",
                                     param="prompt")
        if len(prompt) > 1:
            batch = prompt
        else:
            prompt = prompt[0]  # a batch of one
    if batch is None:
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and _token_ids(prompt):
            ids = prompt
        else:
            raise InvalidRequest("prompt must be a string, a list of token ids, or a list of those (a batch)",
                                 param="prompt")
    max_tokens = _integer(body, "max_tokens", 16, lo=1)
    logprobs = _integer(body, "logprobs", None, lo=0)
    params, priority, salt = _common(body, max_tokens=max_tokens, logprobs=logprobs)
    return ParsedRequest("completion", params, stream, include_usage, continuous, text=text, token_ids=ids,
                         priority=priority, cache_salt=salt, prompts=batch)


def _token_ids(v: list) -> bool:
    """A non-empty list of ints (not bools): a prompt given as token ids."""
    return bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_chat(body: dict, served: str) -> ParsedRequest:
    check_model(body, served)
    _refuse(body, "audio")
    stream = _boolean(body, "stream", False)
    include_usage, continuous = _stream_opts(body, stream)
    messages = chat_messages(body)
    max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    max_tokens_param = "max_tokens" if max_tokens is None else "max_completion_tokens"
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None, lo=1)
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, lo=0)
    if top is not None and not want:
        raise InvalidRequest("top_logprobs needs logprobs to be true", param="top_logprobs")
    params, priority, salt = _common(body, max_tokens=max_tokens, logprobs=(top or 0) if want else None)
    return ParsedRequest("chat", params, stream, include_usage, continuous, messages=messages, priority=priority,
                         cache_salt=salt, chat_logprobs=want, chat=parse_chat_options(body),
                         max_tokens_param=max_tokens_param)


def chat_messages(body: dict) -> list:
    """The request's messages: a non-empty list (each message is checked where it is rendered)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    return messages


def parse_chat_options(body: dict) -> ChatOptions:
    """vLLM's chat rendering fields (the chat route and /tokenize with messages). A request's own
    chat_template is refused, as vLLM does by default: a template runs code on the server."""
    _refuse(body, "chat_template", why="(a request's own template) is not accepted; start the server with "
                                       "--chat-template")
    cont = _boolean(body, "continue_final_message", False)
    gen = _boolean(body, "add_generation_prompt", not cont)
    if cont and gen:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                             param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"chat_template_kwargs must be an object, got {kwargs!r}", param="chat_template_kwargs")
    taken = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if taken:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields)",
                             param="chat_template_kwargs")
    return ChatOptions(add_generation_prompt=gen, continue_final_message=cont, template_kwargs=kwargs)


# -- responses -----------------------------------------------------------------------------------
class TokenText:
    """Token id -> its own text and bytes for logprobs (the vocabulary piece, leading space kept;
    a piece that is not whole UTF-8, such as one byte of a multi-byte character, shows U+FFFD)."""

    def __init__(self, tokenizer) -> None:
        self._pieces = tokenizer.piece_table.pieces if tokenizer is not None else None
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self.bytes_of(token_id).decode("utf-8", "replace") if self._pieces is not None else f"token_id:{token_id}"
            self._cache[token_id] = s
        return s

    def bytes_of(self, token_id: int) -> bytes:
        if self._pieces is None:
            return self(token_id).encode()
        return self._pieces[token_id]


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _top_sorted(row: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(row.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(token_ids, rows, k: int, text_of: TokenText, offset: int = 0) -> dict:
    """The completions API `logprobs` object for tokens with their engine rows ({id: logprob},
    the sampled id first). Each top_logprobs entry holds the k most likely tokens and, as OpenAI's
    do, always the sampled one: up to k + 1 (just the sampled one with logprobs 0)."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, row in zip(token_ids, rows):
        s = text_of(t)
        tokens.append(s)
        lps.append(row.get(t))
        top = {text_of(i): v for i, v in _top_sorted(row, k)}
        if t in row:
            top.setdefault(s, row[t])
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids, rows, k: int, text_of: TokenText) -> dict:
    content = []
    for t, row in zip(token_ids, rows):
        s = text_of(t)
        content.append({
            "token": s, "logprob": row.get(t), "bytes": list(text_of.bytes_of(t)),
            "top_logprobs": [{"token": text_of(i), "logprob": v, "bytes": list(text_of.bytes_of(i))}
                             for i, v in _top_sorted(row, k)],
        })
    return {"content": content}


def new_rows(co) -> list:
    """The logprob rows of the tokens new in this CompletionOutput."""
    if co.logprobs is None or not co.new_token_ids:
        return []
    n = len(co.token_ids)
    return co.logprobs[n - len(co.new_token_ids) : n]
