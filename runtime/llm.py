"""Offline API: `LLM(model=..., **engine_config).generate(prompts, params) -> list[RequestOutput]`,
and the output types every engine API returns.

    from xlaserve import LLM, SamplingParams
    llm = LLM(model="/path/to/model", max_num_seqs=64)
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.8, max_tokens=64))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import numbers
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tqdm.auto import tqdm

from runtime.request import SamplingParams, validate_cache_salt

if TYPE_CHECKING:
    from runtime.checkpoint import LoadedModel
    from runtime.engine import Engine
    from runtime.tokenizer import Tokenizer

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

# H200, llama3_2_1b: a burst of 8 decode steps took 1.0-3.2 ms of host time to launch against
# 0.5-1.0 ms for one step, with the same device time per step (docs/benchmarks.md).
OFFLINE_DECODE_STEPS = 8


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (`n` of them per request).

    text, token_ids and logprobs are cumulative (the whole sequence so far), except in the outputs
    of a running request whose SamplingParams.output_kind is "delta": there they hold only what
    this output adds, as new_text and new_token_ids do in every output (new_* are what this output
    added to the previous output of the same stream; the whole sequence in a final offline result).
    A final output (finished) is always cumulative.
    token_ids include the EOS or stop token that ended the sequence; text excludes a matched stop
    string and anything after it.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were requested
    logprobs: list[dict[int, float]] | None  # per token: sampled id and the top-n ids -> logprob
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the same list in every output of a request
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission


class LLM:
    """A model plus an engine, for batch generation in one process.

    `model` is anything `runtime.checkpoint.load_model` takes (a path or a preset name) or an
    already loaded model; keyword arguments are EngineConfig fields. Offline, throughput counts and
    nothing arrives mid-run, so decode_steps defaults to OFFLINE_DECODE_STEPS here (decode bursts,
    runtime/scheduler.py) rather than EngineConfig's 1.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel,
        *,
        tokenizer: str | Path | Tokenizer | None = None,
        **engine_config,
    ) -> None:
        from runtime.checkpoint import LoadedModel, load_model
        from runtime.config import EngineConfig
        from runtime.replicas import make_engine
        from runtime.tokenizer import Tokenizer, load_tokenizer

        config = EngineConfig(**{"decode_steps": OFFLINE_DECODE_STEPS, **engine_config})
        if isinstance(model, LoadedModel):
            loaded = model
        else:
            loaded = load_model(model, mesh=config.mesh.make_mesh(), dtype=config.dtype, seed=config.seed,
                                progress=config.progress)
        if tokenizer is None and loaded.tokenizer_path is not None:
            tokenizer = loaded.tokenizer_path
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(tokenizer)
        self.engine = make_engine(loaded, config, tokenizer=tokenizer)
        self._busy = threading.Lock()  # held by the generate call running (one at a time)

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """Wrap an existing (warmed up) engine."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._busy = threading.Lock()
        return llm

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Mapping | Sequence[Mapping],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) and return the final outputs in order.
        A prompt may also be a dict as vLLM's TextPrompt / TokensPrompt: {"prompt": text} or
        {"prompt_token_ids": ids} (its optional "prompt" the text reported back), with an optional
        "cache_salt" (the prefix cache shares its pages only with prompts of the same salt).

        A prompt that can never run raises ValueError naming it ('prompt i') before the second
        step, with every request of the call withdrawn."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params)} sampling params")
            bad = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise TypeError(f"sampling_params[{bad}] is {type(params[bad]).__name__}, not SamplingParams")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("LLM.generate is running in another thread; an LLM runs one call at a time")
        try:
            return self._generate(prompt_list, params, use_tqdm)
        finally:
            self._busy.release()

    def _generate(self, prompt_list: list, params: list[SamplingParams], use_tqdm: bool | None) -> list[RequestOutput]:
        engine = self.engine
        if engine.has_unfinished():
            raise RuntimeError("the engine has unfinished requests; LLM.generate needs it to itself")
        # Prompts are tokenized and checked in order: those the first step can take before it runs,
        # the rest while the device runs it (~25 us a prompt of 512 ids on the host: checking all
        # 256 of the offline benchmark's first left the device idle ~10 ms). A bad prompt raises
        # before the second step, with every request of the call withdrawn (the engine is left
        # empty). Checked requests are queued as the engine takes them in (`_queue`): queueing
        # costs ~0.1 ms a request on the host, which, done for every prompt up front, would leave
        # the device idle; between steps it runs while the device computes.
        unchecked = deque(enumerate(zip(prompt_list, params)))
        todo: deque = deque()
        self._check(unchecked, todo, first_step=True)
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        show = engine.config.progress if use_tqdm is None else use_tqdm
        from runtime.engine import frozen_heap

        with frozen_heap(), tqdm(total=len(prompt_list), desc="generating", unit="req", disable=not show) as bar:
            try:
                while todo or unchecked or engine.has_unfinished():
                    self._queue(todo, ids)
                    outs = engine.step(partial=False)
                    if unchecked:
                        self._check(unchecked, todo, first_step=False)
                    for out in outs:
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
            except BaseException:  # a bad prompt, Ctrl-C, an engine error: the LLM stays usable
                self._withdraw(ids)
                raise
        return [results[rid] for rid in ids]

    def _check(self, unchecked: deque, todo: deque, *, first_step: bool) -> None:
        """Move prompts from `unchecked` to `todo`, tokenized and checked (ValueError names the
        prompt): with first_step, as many as `_queue` would queue before the first step, else all."""
        engine = self.engine
        tokens = 0
        while unchecked and (not first_step or self._room(len(todo), tokens)):
            i, (p, sp) = unchecked.popleft()
            rid = f"prompt {i}"  # (named in the errors as Engine.validate names a request)
            try:
                p, given_text, salt = _prompt_fields(p)
                text, prompt_ids = engine.prepare_prompt(p)
            except ValueError as e:
                raise ValueError(f"request {rid!r}: {e}") from None
            engine.validate(prompt_ids, sp, request_id=rid)
            todo.append((prompt_ids, text if text is not None else given_text, sp, salt))
            tokens += len(prompt_ids)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """generate() for a conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered with the tokenizer's chat template (or `chat_template`, a template
        text or the name of one of the model's templates) as Tokenizer.apply_chat_template does,
        with the same options (vLLM's LLM.chat). `tools`: JSON schemas (dicts) or Python functions
        with type hints and a Google-style docstring (runtime/tool_schema.py). Each output's
        `prompt` is the rendered text."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so chat is not available; use generate() with token ids")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        options = {**(chat_template_kwargs or {}), **({} if tools is None else {"tools": tools})}
        prompts = [tok.chat_prompt(c, add_generation_prompt, continue_final_message=continue_final_message,
                                   chat_template=chat_template, **options)
                   for c in conversations]
        return self.generate([{"prompt_token_ids": ids, "prompt": text} for text, ids in prompts], sampling_params,
                             use_tqdm=use_tqdm)

    def _queue(self, todo: deque, ids: list[str]) -> None:
        """Queue prompts from `todo` until the scheduler holds two steps' worth of prompt tokens or
        max_num_seqs requests waiting: each step then fills its token budget and its free slots as
        if every prompt had been queued up front."""
        if not todo:  # every prompt is queued: nothing to count (the decode steps' path)
            return
        engine = self.engine
        waiting, tokens = engine.waiting()
        while todo and self._room(waiting, tokens):
            prompt_ids, text, sp, salt = todo.popleft()
            ids.append(engine.enqueue_checked(prompt_ids, sp, prompt_text=text, cache_salt=salt))
            waiting, tokens = waiting + 1, tokens + len(prompt_ids)

    def _room(self, requests: int, tokens: int) -> bool:
        """Whether the queue window (max_num_seqs requests, two steps' worth of prompt tokens, each
        times the engine's replicas) has room past `requests` waiting requests of `tokens` prompt tokens."""
        cfg, r = self.engine.config, self.engine.num_replicas
        return requests < r * cfg.max_num_seqs and tokens < 2 * r * cfg.max_num_batched_tokens

    def _withdraw(self, ids: list[str]) -> None:
        """Abort every request of the call and run the engine until it is empty."""
        engine = self.engine
        for rid in ids:  # the finished ones are no longer live: abort ignores them
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()


# vLLM's TextPrompt / TokensPrompt keys this engine reads (multimodal ones are refused)
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def _prompt_fields(p) -> tuple[str | Sequence[int], str | None, str | None]:
    """(the prompt for Engine.prepare_prompt, the text to report for ids, cache_salt) of a prompt;
    ValueError for a dict prompt without a prompt or with keys this engine does not read."""
    if not isinstance(p, Mapping):
        return p, None, None
    unknown = [k for k in p if k not in _PROMPT_KEYS]
    if unknown:
        raise ValueError(f"prompt keys {unknown} are not supported; a dict prompt has 'prompt' (text) or "
                         "'prompt_token_ids', and optionally 'cache_salt'")
    text = p.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
    salt = validate_cache_salt(p.get("cache_salt"))
    if p.get("prompt_token_ids") is not None:
        ids = p["prompt_token_ids"]
        if isinstance(ids, (str, bytes, Mapping)) or not (isinstance(ids, Sequence) or hasattr(ids, "tolist")):
            raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
        return (ids.tolist() if hasattr(ids, "tolist") else ids), text, salt
    if text is None:
        raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
    return text, None, salt


def _normalize_prompts(prompts) -> list[str | list[int] | Mapping]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        return []
    if all(isinstance(p, str) for p in prompts):
        return prompts
    if all(isinstance(p, numbers.Integral) for p in prompts):
        return [prompts]  # one prompt of token ids
    # Token ids are checked and copied once, by Engine.prepare_prompt (C-speed for lists of ints): an
    # id-by-id int() here took ~7 ms for 256 prompts of 512 ids, all of it before the first step,
    # and truncated floats where the check rejects them.
    out = []
    for p in prompts:
        if isinstance(p, (str, Mapping)):
            out.append(p)
        elif isinstance(p, (list, tuple)) or hasattr(p, "tolist"):
            out.append(p.tolist() if hasattr(p, "tolist") else p)
        else:
            raise TypeError(f"a prompt must be a str, a sequence of token ids or a dict (vLLM's TextPrompt / "
                            f"TokensPrompt), got {type(p).__name__}")
    return out
