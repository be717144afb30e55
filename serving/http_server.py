"""OpenAI-compatible HTTP server (a Starlette ASGI app over the serving core).

    GET  /health                 200 {"status": "ok"} | 503 {"status": "<why>"}   (no API key needed)
    GET  /metrics                Prometheus text
    GET  /v1/models, /v1/models/{model}
    POST /v1/completions         prompt: a string, token ids, or a list of those (choice index = prompt x n + i)
    POST /v1/chat/completions    messages rendered with the model's chat template
    POST /tokenize               {"prompt": ...} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}

Streaming answers are server-sent events ending with `data: [DONE]`. A client that disconnects
(streaming or not) cancels its request, which releases its KV pages within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving import sse
from serving.auth import APIKeyChecker
from serving.core import GenerationSpec, ServingCore, check_request_id
from serving.errors import BodyTooLarge, InvalidRequest, NotFound, ServingError, Unauthenticated
from serving.metrics import CONTENT_TYPE
from serving.openai_protocol import (
    ParsedRequest,
    TokenText,
    chat_logprobs,
    chat_messages,
    check_model,
    completion_logprobs,
    new_rows,
    parse_chat,
    parse_chat_options,
    parse_completion,
    usage,
)

logger = logging.getLogger("xlaserve.http")


def build_app(core: ServingCore, api_keys: APIKeyChecker | None = None, *,
              allowed_origins: tuple[str, ...] = ()) -> Starlette:
    """The ASGI app. allowed_origins: browser origins answered cross-origin (CORS preflights and
    headers, Starlette's CORSMiddleware, outermost so that errors carry the headers too)."""
    api = _Api(core, api_keys or APIKeyChecker(()))
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
    ]
    handlers = {ServingError: _serving_error, HTTPException: _http_error, ClientDisconnect: _client_gone}
    middleware = [Middleware(_InternalErrors)]
    if allowed_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                        allow_headers=["*"]))
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    return Response(status_code=499)  # the client went away while sending its body: nobody reads this


async def _serving_error(request: Request, exc: ServingError) -> JSONResponse:
    headers = exc.headers()
    client = request.headers.get("x-request-id")
    if client is not None:  # echoed for tracing, as on success: when it is an id we would take
        with contextlib.suppress(InvalidRequest):
            check_request_id(client)
            headers["X-Request-Id"] = client
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse({"error": {"message": msg, "type": kind, "param": None, "code": None}},
                        status_code=exc.status_code, headers=exc.headers)  # (a 405's Allow)


class _InternalErrors:
    """An unexpected error's 500, answered as any other response. Starlette's own handler for
    Exception runs in its outermost middleware, which re-raises after answering; uvicorn then
    closes the connection, and a request the client has already sent on it gets no answer."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as exc:
            if started:  # a response cut short: closing the connection is all that is left
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            response = JSONResponse({"error": {"message": f"internal error: {exc!r}", "type": "server_error",
                                               "param": None, "code": None}}, status_code=500)
            await response(scope, receive, send)


class _Api:
    def __init__(self, core: ServingCore, keys: APIKeyChecker) -> None:
        self.core, self.keys = core, keys
        self._text_of: TokenText | None = None

    # -- plumbing -------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if not self.keys.check_authorization(request.headers.get("authorization"), request.headers.get("x-api-key")):
            raise Unauthenticated("a valid API key is needed: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")

    async def _json(self, request: Request) -> dict:
        self._auth(request)
        limit = self.core.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body has {declared} bytes; max_body_bytes is {limit}")
        body = bytearray()
        async for chunk in request.stream():  # (a client gone meanwhile: ClientDisconnect, _client_gone)
            body += chunk
            if len(body) > limit:
                raise BodyTooLarge(f"request body has more than {limit} bytes; max_body_bytes is {limit}")
        try:
            obj = json.loads(body)
        except RecursionError:
            raise InvalidRequest("the request body is not valid JSON: nested too deeply") from None
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits)
            raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise InvalidRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
        return obj

    def _served(self) -> str:
        return self.core.model_name

    def text_of(self) -> TokenText:
        if self._text_of is None:
            self._text_of = TokenText(self.core.tokenizer)
        return self._text_of

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ok, reason = self.core.health()
        return JSONResponse({"status": reason}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        self._auth(request)
        return Response(self.core.metrics.render(), media_type=CONTENT_TYPE)

    def _model_card(self) -> dict:
        """The served model's card; 503 while warming up, as gRPC's ModelInfo (a 200 here would tell
        a client polling /v1/models for readiness that requests are served)."""
        self.core.check_ready_for_info()
        info = self.core.model_info
        return {"id": self._served(), "object": "model", "created": info.created, "owned_by": "xlaserve",
                "root": info.source, "max_model_len": info.max_model_len}

    async def models(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._auth(request)
        name = request.path_params["model"]
        if name != self._served():
            raise NotFound(f"the model {name!r} does not exist; this server serves {self._served()!r}",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        if "model" in body:
            check_model(body, self._served())
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidRequest("add_special_tokens must be true or false", param="add_special_tokens")
        if body.get("prompt") is not None:
            if not isinstance(body["prompt"], str):
                raise InvalidRequest(f"prompt must be a string, got {type(body['prompt']).__name__}", param="prompt")
            ids = await self.core.tokenize(text=body["prompt"], add_special_tokens=add_special)
        elif body.get("messages") is not None:
            ids = await self.core.tokenize(messages=chat_messages(body), chat=parse_chat_options(body))
        else:
            raise InvalidRequest("give prompt (a string) or messages", param="prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.core.model_info.max_model_len})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, "cmpl")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, "chatcmpl")

    # -- generation -----------------------------------------------------------------------------
    async def _generate(self, request: Request, parse, prefix: str) -> Response:
        try:
            body = await self._json(request)
            req: ParsedRequest = parse(body, self._served())
            # the client's id for the request, as vLLM takes it: the X-Request-Id header, else the body's
            # request_id; the response's id is built from it and the header echoes it (tracing)
            client = request.headers.get("x-request-id", body.get("request_id"))
            if client is not None:
                check_request_id(client)
        except (InvalidRequest, BodyTooLarge, NotFound):  # counted as the core counts what it refuses
            self.core.metrics.request_failed("invalid")
            raise
        rid = f"{prefix}-{uuid.uuid4().hex if client is None else client}"
        # engine ids stay unique when clients reuse theirs (a suffix), and name the client's in logs
        engine_id = rid if client is None else f"{rid}.{uuid.uuid4().hex[:12]}"
        common = dict(params=req.params, request_id=engine_id, priority=req.priority, cache_salt=req.cache_salt,
                      logprobs_param="top_logprobs" if req.kind == "chat" else "logprobs",
                      max_tokens_param=req.max_tokens_param)
        if req.prompts is None:
            streams = [await self.core.submit(GenerationSpec(text=req.text, token_ids=req.token_ids,
                                                             messages=req.messages, chat=req.chat, **common))]
        else:  # a batch: one engine request per prompt
            streams = await self.core.submit_batch([
                GenerationSpec(**{**common, "request_id": f"{engine_id}-{i}"},
                               **({"text": p} if isinstance(p, str) else {"token_ids": p}))
                for i, p in enumerate(req.prompts)])
        fmt = _Formatter(req, rid, self._served(), [len(st.prompt_token_ids) for st in streams], self.text_of())
        headers = {"X-Request-Id": client if client is not None else rid}
        if req.stream:
            return _SSEResponse(streams, fmt, headers)
        try:
            finals = await _until_disconnect(request, _finals(streams))
        finally:
            for st in streams:
                st.close()
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(fmt.full(finals), headers=headers)


async def _merged(streams):
    """(prompt index, output) from the prompts' streams, in the order they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - a ServingError (deadline, engine stopped): the reader raises it
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _finals(streams) -> list:
    """Each prompt's last output."""
    last = [None] * len(streams)
    async for i, out in _merged(streams):
        last[i] = out
    return last


async def _until_disconnect(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it and return None. After the body is
    read, the next ASGI receive() completes only on disconnect (or when the response is done)."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work not in done:  # (cancel() only asks: the task is not cancelled until it runs again)
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return None
    return work.result()


class _SSEResponse(StreamingResponse):
    """Closes (cancels) the request however the response ends, even if the body never started."""

    def __init__(self, streams: list, fmt: _Formatter, headers: dict[str, str]) -> None:
        super().__init__(_sse_body(streams, fmt), media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for st in self._streams:
                st.close()


async def _sse_body(streams: list, fmt: _Formatter):
    try:
        for chunk in fmt.head():
            yield sse.event(chunk)
        try:
            async for i, out in _merged(streams):
                for chunk in fmt.deltas(out, i):
                    yield sse.event(chunk)
        except ServingError as e:  # after the 200 header: report it in the stream, as OpenAI does
            yield sse.event(e.envelope())
            yield sse.DONE
            return
        if fmt.req.include_usage:
            yield sse.event(fmt.usage_chunk())
        yield sse.DONE
    finally:
        for st in streams:
            st.close()


class _Formatter:
    """Builds OpenAI response objects (whole, or stream chunks) from engine outputs: one output
    stream per prompt; sample j of prompt i is choice i * n + j."""

    def __init__(self, req: ParsedRequest, rid: str, model: str, num_prompt: list[int], text_of: TokenText) -> None:
        self.req, self.rid, self.model, self.text_of = req, rid, model, text_of
        self.num_prompt = sum(num_prompt)
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.n = req.params.n
        self.k = req.params.logprobs or 0
        self.want_logprobs = req.params.logprobs is not None
        self.completion_tokens = 0
        self.cached = [0] * len(num_prompt)  # per prompt
        self.finished: set[int] = set()
        self.offsets = [0] * (self.n * len(num_prompt))  # completions text_offset per choice

    def _chunk(self, choices: list) -> dict:
        c = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if self.req.continuous_usage:
            c["usage"] = self._usage_so_far()
        elif self.req.include_usage:
            c["usage"] = None
        return c

    def head(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]

    def deltas(self, out, prompt: int = 0) -> list[dict]:
        chunks = []
        self.cached[prompt] = out.num_cached_tokens
        for co in out.outputs:
            index = prompt * self.n + co.index
            newly_done = co.finish_reason is not None and index not in self.finished
            if not (co.new_token_ids or co.new_text or newly_done):
                continue
            self.completion_tokens += len(co.new_token_ids)
            lp = None
            if self.want_logprobs and co.new_token_ids:
                rows = new_rows(co)
                if self.chat:
                    lp = chat_logprobs(co.new_token_ids, rows, self.k, self.text_of)
                else:
                    lp = completion_logprobs(co.new_token_ids, rows, self.k, self.text_of, self.offsets[index])
                    self.offsets[index] += sum(len(t) for t in lp["tokens"])
            if newly_done:
                self.finished.add(index)
            if self.chat:
                delta = {"content": co.new_text} if (co.new_text or not newly_done) else {}
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": co.finish_reason}
            else:
                choice = {"index": index, "text": co.new_text, "logprobs": lp, "finish_reason": co.finish_reason}
            choice["stop_reason"] = co.stop_reason if newly_done else None  # (null but where one matched, as vLLM)
            chunks.append(self._chunk([choice]))
        return chunks

    def _usage_so_far(self) -> dict:
        return usage(self.num_prompt, self.completion_tokens, sum(self.cached))

    def usage_chunk(self) -> dict:
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage_so_far()}

    def full(self, outs: list) -> dict:
        """The whole response from each prompt's final output."""
        choices = []
        for prompt, out in enumerate(outs):
            choices += self._choices(prompt, out)
        n_out = sum(len(co.token_ids) for out in outs for co in out.outputs)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(self.num_prompt, n_out, sum(out.num_cached_tokens for out in outs))}

    def _choices(self, prompt: int, out) -> list[dict]:
        choices = []
        for co in out.outputs:
            index = prompt * self.n + co.index
            lp = None
            if self.want_logprobs:
                rows = co.logprobs or []
                lp = (chat_logprobs(co.token_ids, rows, self.k, self.text_of) if self.chat
                      else completion_logprobs(co.token_ids, rows, self.k, self.text_of))
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": co.text}, "logprobs": lp,
                          "finish_reason": co.finish_reason}
            else:
                choice = {"index": index, "text": co.text, "logprobs": lp, "finish_reason": co.finish_reason}
            choice["stop_reason"] = co.stop_reason
            choices.append(choice)
        return choices
