"""The serving core both adapters (HTTP, gRPC) call: request preparation off the event loop,
limits, the bounded waiting queue, the engine stream of each request, metrics, health and drain.

Each accepted request's engine stream is consumed by a pump task that the core owns, not by the
client's handler. When a client goes away (HTTP disconnect, gRPC cancel, deadline) the handler
stops reading and the core cancels the engine request; the pump keeps reading until the engine
confirms the end (an "abort" output, after the pages are released), so `in_flight` counts a
request until the engine is done with it. Drain and the tests wait on that count.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from runtime.chat_template import content_format
from runtime.request import FINISH_ABORT, FINISH_LENGTH, OUTPUT_DELTA, SamplingParams
from serving.admission import AdmissionQueue, Ticket
from serving.config import ServerConfig
from serving.errors import DeadlineExceeded, InternalError, InvalidRequest, ServingError, Unavailable
from serving.metrics import ServingMetrics

if TYPE_CHECKING:  # (the engine's modules import JAX; the core loads them only to build an engine)
    from runtime.async_engine import OutputStream

logger = logging.getLogger("xlaserve.serving")

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_REQUEST_ID_LEN = 256  # characters of a client-chosen request id


class State(enum.Enum):
    STARTING = "starting"  # loading the model and compiling: nothing is served but health
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: in-flight requests finish, new ones are refused
    STOPPED = "stopped"


@dataclass(frozen=True)
class ChatOptions:
    """How chat messages become the prompt (vLLM's request fields, transformers' arguments):
    add_generation_prompt opens the assistant's reply; continue_final_message instead continues the
    last message (a prefilled reply); template_kwargs (chat_template_kwargs) are passed to the
    template, e.g. {"enable_thinking": false}."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)



@dataclass
class GenerationSpec:
    """A request as the adapters hand it over; exactly one of text, token_ids, messages is set."""

    params: SamplingParams
    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    chat: ChatOptions = field(default_factory=ChatOptions)  # for messages
    add_special_tokens: bool = True  # for text: BOS etc. as the tokenizer adds them
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    timeout_s: float | None = None  # the client's deadline, from now
    arrival: float = field(default_factory=time.monotonic)
    logprobs_param: str = "logprobs"  # what the client's API calls params.logprobs (OpenAI chat: top_logprobs)
    max_tokens_param: str = "max_tokens"  # and params.max_tokens (OpenAI chat: max_completion_tokens too)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool
    has_chat_template: bool
    dtype: str
    max_num_seqs: int
    page_size: int
    num_pages: int
    max_logprobs: int
    max_n: int
    max_stop: int
    created: int


@dataclass(eq=False)
class _Live:
    request_id: str
    ticket: Ticket
    arrival: float
    num_prompt_tokens: int
    engine_stream: OutputStream  # the AsyncEngine's stream of the request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)  # by sequence (output index)
    generated: int = 0
    # How the request was counted in the metrics (once): "finished" (request_success_total, by its
    # finish reason) or a failure reason (request_failure_total), whichever came first.
    counted: str | None = None


_END = object()


class ServingCore:
    def __init__(self, config: ServerConfig, model_name: str = "") -> None:
        self.config = config
        self.model_name = model_name
        self.state = State.STARTING
        self.engine = None  # runtime.async_engine.AsyncEngine, once attached
        self.tokenizer = None
        self.model_info: ModelInfo | None = None
        self.metrics = ServingMetrics(model_name, self._engine_stats)
        self.admission = AdmissionQueue(config.max_waiting_requests, config.max_waiting_tokens,
                                        retry_after_s=config.retry_after_s)
        self._chat_template: str | None = None  # the server's template replacing the model's
        self._chat_unavailable: str | None = None  # why chat is refused, when the model's template is broken
        self._live: dict[str, _Live] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy_since = time.monotonic()
        self._last_steps = -1
        self._last_step_change = time.monotonic()
        self._state_listeners: list = []

    # -- lifecycle ------------------------------------------------------------------------------
    def attach(self, engine, *, tokenizer=None, source: str = "", chat_template: str | None = None) -> None:
        """Serve `engine` (an AsyncEngine over a warmed-up Engine or ReplicatedEngine); health turns SERVING."""
        eng = engine.engine
        cfg, mcfg = eng.config, eng.model.config
        self.engine, self.tokenizer = engine, tokenizer
        from runtime.chat_template import compile_chat_template

        self._chat_template, self._chat_unavailable = chat_template, None
        if chat_template is not None:
            compile_chat_template(chat_template)  # ServerConfig checked it; a direct caller gets the ValueError
        elif tokenizer is not None and tokenizer.chat_template is not None:
            try:
                compile_chat_template(tokenizer.chat_template)
            except ValueError as e:  # completions still work; chat requests are refused with the reason
                self._chat_unavailable = f"model {self.model_name!r}: {e}"
                logger.warning("%s; chat requests will be refused (--chat-template replaces it)", self._chat_unavailable)
        self.model_info = ModelInfo(
            name=self.model_name, source=source or str(getattr(eng.model, "source", "")),
            architecture=mcfg.architecture, vocab_size=mcfg.vocab_size, max_model_len=cfg.max_model_len,
            eos_token_ids=tuple(eng.eos_ids), has_tokenizer=tokenizer is not None,
            has_chat_template=chat_template is not None or (
                tokenizer is not None and tokenizer.chat_template is not None and self._chat_unavailable is None),
            dtype=getattr(eng.model.dtype, "__name__", str(eng.model.dtype)),
            # an engine per replica (runtime/replicas.py): the limits of all of them
            max_num_seqs=cfg.max_num_seqs * eng.num_replicas, page_size=cfg.page_size,
            num_pages=cfg.num_pages * eng.num_replicas,
            max_logprobs=cfg.max_logprobs, max_n=self.config.max_n, max_stop=self.config.max_stop,
            created=int(time.time()),
        )
        self._set_state(State.READY)

    def on_state_change(self, fn) -> None:
        """fn(state) is called on every state change (the gRPC health service listens)."""
        self._state_listeners.append(fn)
        fn(self.state)

    def _set_state(self, state: State) -> None:
        self.state = state
        for fn in self._state_listeners:
            fn(state)

    @property
    def in_flight(self) -> int:
        return len(self._live)

    async def wait_idle(self) -> None:
        """Return once no request is in flight (every engine stream has ended)."""
        await self._idle.wait()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Stop accepting, let in-flight requests finish for up to timeout_s, then abort the rest.
        Returns how many were aborted."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        if self.state is State.READY or self.state is State.STARTING:
            self._set_state(State.DRAINING)
        logger.info("draining: %d requests in flight, up to %.1f s", self.in_flight, timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except TimeoutError:
            pass
        aborted = list(self._live.values())
        logger.warning("drain timeout: aborting %d requests", len(aborted))
        for live in aborted:
            live.engine_stream.cancel()
        # Aborts take effect before the engine's next step; a dead engine ends every stream itself.
        await self._idle.wait()
        return len(aborted)

    def stop(self) -> None:
        self._set_state(State.STOPPED)

    # -- health ---------------------------------------------------------------------------------
    def _engine_stats(self):
        return self.engine.stats() if self.engine is not None else None

    def health(self) -> tuple[bool, str]:
        """(healthy, reason). Unhealthy while starting or draining, when the engine loop died, and
        when it has work but has not finished a step for health_stall_s."""
        if self.state is State.STARTING:
            return False, "warming up"
        if self.state is not State.READY:
            return False, self.state.value
        h = self.engine.health()
        if not h.healthy:
            return False, f"engine loop is not running ({h.error or 'stopped'})"
        now = time.monotonic()
        steps = self.engine.stats().num_steps
        if steps != self._last_steps:
            self._last_steps, self._last_step_change = steps, now
        busy = self._live or h.num_unfinished
        if busy:
            stalled = now - max(self._last_step_change, self._busy_since)
            if stalled > self.config.health_stall_s:
                return False, (f"engine made no step for {stalled:.1f} s with {max(len(self._live), h.num_unfinished)} "
                               f"requests in flight; health_stall_s is {self.config.health_stall_s}")
        return True, "ok"

    def _check_accepting(self) -> None:
        if self.state is State.STARTING:
            raise Unavailable("the server is warming up; retry shortly", code="warming_up", retry_after=1)
        if self.state is not State.READY:
            raise Unavailable("the server is shutting down", code="draining")
        h = self.engine.health()
        if not h.healthy:
            raise Unavailable(f"the engine loop is not running ({h.error or 'stopped'})", code="engine_dead")

    # -- preparation ----------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions = ChatOptions()) -> str:
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequest("this model has no tokenizer, so chat is not available; send token ids",
                                 param="messages")
        if self._chat_template is None and (tok.chat_template is None or self._chat_unavailable is not None):
            why = self._chat_unavailable or f"model {self.model_name!r} has no chat template"
            raise InvalidRequest(f"{why}; use /v1/completions or start the server with --chat-template",
                                 param="messages")
        try:
            template = tok.resolve_chat_template(self._chat_template, options.template_kwargs.get("tools"))
        except ValueError as e:
            raise InvalidRequest(str(e), param="messages") from None
        msgs = _check_messages(messages, parts=content_format(template) == "openai")
        try:
            return tok.apply_chat_template(msgs, add_generation_prompt=options.add_generation_prompt,
                                           continue_final_message=options.continue_final_message,
                                           chat_template=template, **options.template_kwargs)
        except Exception as e:  # the template parsed at start-up; raise_exception in it and the like are the messages' fault
            raise InvalidRequest(f"the chat template rejected the messages: {e}", param="messages") from None

    def _prompt_ids(self, spec: GenerationSpec) -> list[int]:
        """Token ids of the prompt (runs in a worker thread: tokenizing is CPU work)."""
        if spec.token_ids is not None:
            ids = list(spec.token_ids)
            if not ids:
                raise InvalidRequest("prompt has 0 tokens; at least 1 is needed", param="prompt")
            V = self.model_info.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                    raise InvalidRequest(f"prompt token id {t!r} is out of range; the vocabulary has {V} ids",
                                         param="prompt")
            return ids
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer; send the prompt as token ids", param="prompt")
        if spec.messages is not None:
            text = self.render_chat(spec.messages, spec.chat)
            add_special = False  # the template writes BOS itself
        else:
            text, add_special = spec.text, spec.add_special_tokens
        if len(text) > self.config.max_prompt_chars:
            raise InvalidRequest(f"prompt has {len(text)} characters; max_prompt_chars is "
                                 f"{self.config.max_prompt_chars}", param="prompt")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special)
        except ValueError as e:  # text that is not valid Unicode
            raise InvalidRequest(f"prompt: {e}", param="prompt") from None
        if not ids:
            raise InvalidRequest("prompt has 0 tokens; at least 1 is needed", param="prompt")
        return ids

    def check_limits(self, num_prompt_tokens: int, params: SamplingParams, logprobs_param: str = "logprobs",
                     max_tokens_param: str = "max_tokens") -> None:
        """The server's limits, each error naming the value and the limit (the engine checks the rest)."""
        info, cfg = self.model_info, self.config
        L = info.max_model_len
        if params.n > cfg.max_n:
            raise InvalidRequest(f"n is {params.n}; max_n is {cfg.max_n}", param="n")
        nstop = len(params.stop) + len(params.stop_token_ids)
        if nstop > cfg.max_stop:
            raise InvalidRequest(f"{nstop} stop strings and stop token ids given; max_stop is {cfg.max_stop}",
                                 param="stop")
        if params.logprobs is not None and params.logprobs > info.max_logprobs:
            raise InvalidRequest(f"{logprobs_param} is {params.logprobs}; max_logprobs is {info.max_logprobs}",
                                 param=logprobs_param)
        if num_prompt_tokens >= L:
            raise InvalidRequest(f"prompt has {num_prompt_tokens} tokens; max_model_len is {L} (room is needed "
                                 f"for at least one generated token)", param="prompt", code="context_length_exceeded")
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > L:
            raise InvalidRequest(f"prompt has {num_prompt_tokens} tokens + {max_tokens_param} {params.max_tokens} = "
                                 f"{num_prompt_tokens + params.max_tokens} tokens; max_model_len is {L}",
                                 param=max_tokens_param, code="context_length_exceeded")
        if params.max_tokens is None and params.min_tokens > L - num_prompt_tokens:
            raise InvalidRequest(f"min_tokens {params.min_tokens} is more than the {L - num_prompt_tokens} tokens the "
                                 f"request can generate (max_model_len {L} - prompt {num_prompt_tokens})",
                                 param="min_tokens", code="context_length_exceeded")
        V = info.vocab_size
        for what, param, ids in (("stop token id", "stop_token_ids", params.stop_token_ids),
                                 ("logit_bias token id", "logit_bias", params.logit_bias or ())):
            bad = next((t for t in ids if t >= V), None)
            if bad is not None:
                raise InvalidRequest(f"{what} {bad} is out of range; the vocabulary has {V} ids", param=param)

    async def tokenize(self, *, text: str | None = None, messages=None, add_special_tokens: bool = True,
                       chat: ChatOptions = ChatOptions()) -> list[int]:
        self.check_ready_for_info()
        spec = GenerationSpec(params=SamplingParams(), text=text, messages=messages, chat=chat,
                              add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self._prompt_ids, spec)

    def check_ready_for_info(self) -> None:
        """Unavailable (503 / UNAVAILABLE) while warming up: what the model is, is known once it loaded."""
        if self.model_info is None:
            raise Unavailable("the server is warming up; retry shortly", code="warming_up", retry_after=1)

    # -- generation -----------------------------------------------------------------------------
    async def submit(self, spec: GenerationSpec) -> RequestStream:
        """Validate, admit and submit `spec`, or raise the ServingError that refuses it. The
        returned stream yields the engine's RequestOutput snapshots (the last has finished=True);
        the caller must close() it when it stops reading early (that cancels the request). The
        request runs with output_kind "delta": a running request's outputs carry only what is new
        (the new_* fields; a cumulative copy would cost the engine's host O(length) per request per
        step), the final output the whole sequence."""
        try:
            ids, ticket = await self._prepare(spec)
        except ServingError as e:
            self.metrics.request_failed(_failure_reason(e))
            raise
        return self._start(spec, ids, ticket)

    async def _prepare(self, spec: GenerationSpec) -> tuple[list[int], Ticket]:
        """The request's checks, its prompt's ids and its place in the admission queue."""
        self._check_accepting()
        if spec.request_id is not None:
            check_request_id(spec.request_id)
        ids = await asyncio.to_thread(self._prompt_ids, spec)
        self.check_limits(len(ids), spec.params, spec.logprobs_param, spec.max_tokens_param)
        self._check_accepting()  # the state may have changed while tokenizing
        return ids, self.admission.admit(len(ids))

    def _start(self, spec: GenerationSpec, ids: list[int], ticket: Ticket) -> RequestStream:
        from runtime.async_engine import EngineDeadError, GenerationRequest

        rid = spec.request_id or f"req-{uuid.uuid4().hex}"
        try:
            stream = self.engine.submit(GenerationRequest(
                prompt_token_ids=ids, sampling_params=replace(spec.params, output_kind=OUTPUT_DELTA),
                request_id=rid, priority=spec.priority,
                cache_salt=spec.cache_salt))
        except ValueError as e:
            ticket.release()
            self.metrics.request_failed("invalid")
            raise InvalidRequest(str(e)) from None
        except EngineDeadError as e:
            ticket.release()
            self.metrics.request_failed("unavailable")
            raise Unavailable(str(e), code="engine_dead") from None
        live = _Live(rid, ticket, spec.arrival, len(ids), stream)
        if not self._live:
            self._busy_since = time.monotonic()
            self._idle.clear()
        self._live[rid] = live
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.req_prompt_tokens.observe(len(ids))
        live.task = asyncio.create_task(self._pump(live, stream), name=f"pump-{rid}")
        return RequestStream(self, live, ids, spec.timeout_s)

    async def submit_batch(self, specs: Sequence[GenerationSpec]) -> list[RequestStream]:
        """Submit several prompts of one client request (OpenAI completions with a list of prompts),
        all or none: their sequences (n each) count against max_n together, and every prompt is
        checked before any runs; a refusal counts once, as the one failed request it is."""
        total = sum(spec.params.n for spec in specs)
        if total > self.config.max_n:
            self.metrics.request_failed("invalid")
            raise InvalidRequest(f"the {len(specs)} prompts ask for {total} sequences in all (n for each); max_n "
                                 f"is {self.config.max_n}", param="prompt")
        prepared: list[tuple[GenerationSpec, list[int], Ticket]] = []
        try:
            for spec in specs:
                prepared.append((spec, *await self._prepare(spec)))
        except BaseException as e:
            for _, _, ticket in prepared:
                ticket.release()
            if isinstance(e, ServingError):
                self.metrics.request_failed(_failure_reason(e))
            raise
        streams: list[RequestStream] = []
        try:
            for i, (spec, ids, ticket) in enumerate(prepared):
                streams.append(self._start(spec, ids, ticket))
        except BaseException:  # (the engine refused one, or died): the ones started are withdrawn
            for st in streams:
                st.withdraw()
            for _, _, ticket in prepared[i + 1:]:
                ticket.release()
            raise
        return streams

    async def _pump(self, live: _Live, stream) -> None:
        m = self.metrics
        try:
            async for out in stream:
                now = time.monotonic()
                new = 0
                for o in out.outputs:
                    if o.new_token_ids:
                        new += len(o.new_token_ids)
                        last = live.last_token_at.get(o.index)
                        if last is not None:  # a gap between tokens of one sequence (n > 1: each its own)
                            m.itl.observe(now - last)
                        live.last_token_at[o.index] = now
                if new:
                    if live.first_token_at is None:
                        live.first_token_at = now
                        m.ttft.observe(now - live.arrival)
                    live.generated += new
                    m.generation_tokens.inc(new)
                live.ticket.release()  # any output means the request left the waiting queue
                if out.finished:
                    m.e2e.observe(now - live.arrival)
                    m.req_generation_tokens.observe(live.generated)
                    longest = max((len(o.token_ids) for o in out.outputs), default=0)  # (cumulative: final)
                    if live.first_token_at is not None and longest > 1:
                        m.tpot.observe((now - live.first_token_at) / (longest - 1))
                    if live.counted is None:  # (not a failure the stream counted: its cancel's abort)
                        live.counted = "finished"
                        m.request_finished(_request_finish_reason(out))
                live.queue.put_nowait(out)
            live.queue.put_nowait(_END)
        except Exception as e:  # noqa: BLE001 - the engine died (EngineDeadError) or a bug; tell the client
            logger.error("request %s: engine stream failed: %r", live.request_id, e)
            live.queue.put_nowait(e)
        finally:
            live.ticket.release()
            if self._live.get(live.request_id) is live:  # (a new request may reuse a finished one's id)
                del self._live[live.request_id]
            if not self._live:
                self._idle.set()


class RequestStream:
    """One accepted request's outputs: `async for out in stream`, then (always) `stream.close()`."""

    def __init__(self, core: ServingCore, live: _Live, prompt_token_ids: list[int], timeout_s: float | None) -> None:
        self._core, self._live = core, live
        self.request_id = live.request_id
        self.prompt_token_ids = prompt_token_ids
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._complete = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self):
        if self._complete:
            raise StopAsyncIteration
        q = self._live.queue
        if self._deadline is None:
            item = await q.get()
        else:
            try:
                item = await asyncio.wait_for(q.get(), max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                self.close(failure="deadline")
                raise DeadlineExceeded(f"the request's deadline of {self._timeout_s:.3f} s passed") from None
        if item is _END:
            self._complete = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            from runtime.async_engine import EngineStepError

            self._complete = True
            if isinstance(item, EngineStepError):  # (the engine serves on)
                self._count_failure("error")
                raise InternalError(str(item), code="step_failed")
            self._count_failure("unavailable")
            raise Unavailable(f"the engine stopped: {item}", code="engine_dead")
        return item

    def close(self, failure: str | None = None) -> None:
        """Cancel the request unless its stream has ended; idempotent. With `failure` (a
        request_failure_total reason, e.g. "deadline"), the request counts as that failure rather
        than as a request finished by its cancel's abort."""
        if not self._complete:
            self._complete = True
            if failure is not None:
                self._count_failure(failure)
            self._live.engine_stream.cancel()  # (this request's, not a later one of the same id)

    def withdraw(self) -> None:
        """Cancel a request that is part of a refused client request: it counts as neither a
        failure (the refusal is counted) nor a finished request."""
        if self._live.counted is None:
            self._live.counted = "withdrawn"
        self.close()

    def _count_failure(self, reason: str) -> None:
        if self._live.counted is None:
            self._live.counted = reason
            self._core.metrics.request_failed(reason)


def _request_finish_reason(out) -> str:
    reasons = [o.finish_reason for o in out.outputs]
    if FINISH_ABORT in reasons:
        return FINISH_ABORT
    if FINISH_LENGTH in reasons:
        return FINISH_LENGTH
    return reasons[0] if reasons else FINISH_ABORT


def check_request_id(rid) -> None:
    """A client-chosen id is sent back as the x-request-id header (gRPC metadata) and logged:
    printable ASCII without spaces, of a bounded length."""
    if not (isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN and rid.isascii() and rid.isprintable()
            and " " not in rid):
        if not isinstance(rid, str):
            shown = f"a {type(rid).__name__}"
        else:
            shown = repr(rid) if len(rid) <= 64 else f"a string of {len(rid)} characters"
        raise InvalidRequest(f"request_id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters without "
                             f"spaces, got {shown}", param="request_id")


def _failure_reason(e: ServingError) -> str:
    return {400: "invalid", 413: "invalid", 429: "rejected", 503: "unavailable", 504: "deadline"}.get(e.status, "error")


def _check_messages(messages, *, parts: bool) -> list[dict]:
    """The messages with each content as the template reads it (vLLM's content formats): a string,
    text parts joined one a line; or with `parts` (a template that loops over a message's content)
    a list of text parts, a string becoming one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content", param="messages")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role is {role!r}; expected one of {', '.join(_CHAT_ROLES)}",
                                 param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text (and an assistant's refusal), one a line as vLLM
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                field = "refusal" if kind == "refusal" and role == "assistant" else "text"
                if kind != field or not isinstance(part.get(field), str):
                    raise InvalidRequest(f"messages[{i}].content[{j}] has type {kind!r}; only text parts (and an "
                                         "assistant's refusal parts) are supported", param="messages")
                texts.append(part[field])
        elif content is None and role == "assistant":
            texts = []
        elif isinstance(content, str):
            texts = [content]
        else:
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param="messages")
        content = [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)
        out.append({**m, "role": role, "content": content})  # (each key where the client put it)
    return out
