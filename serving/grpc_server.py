"""gRPC server (grpc.aio) over the serving core.

Services: `xlaserve.v1.Generation` (Generate, Tokenize, ModelInfo), the JetStream-compatible
`Orchestrator` (registered as `xlaserve.v1.Orchestrator` and as JetStream's own
`jetstream_proto.Orchestrator`; the messages share field numbers, so the bytes are the same),
the standard `grpc.health.v1.Health` (NOT_SERVING until warmup is done and while draining; Check
also consults the engine loop) and server reflection (grpcurl works without .proto files).

API keys travel as `authorization: Bearer <key>` metadata; health checks need none. The client's
deadline bounds the request: when it passes, the request is cancelled (its pages are freed) and
the call ends with DEADLINE_EXCEEDED. A cancelled call (client gone) cancels the request too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from runtime.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from serving.auth import APIKeyChecker
from serving.config import ServerConfig, host_port
from serving.core import GenerationSpec, ServingCore, State
from serving.errors import BindError, InvalidRequest, ServingError
from serving.openai_protocol import TokenText, new_rows
from serving.protos import xlaserve_pb2 as pb
from serving.protos import xlaserve_pb2_grpc as pb_grpc

logger = logging.getLogger("xlaserve.grpc")

JETSTREAM_SERVICE = "jetstream_proto.Orchestrator"
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, FINISH_STOP: pb.FINISH_REASON_STOP,
           FINISH_LENGTH: pb.FINISH_REASON_LENGTH, FINISH_ABORT: pb.FINISH_REASON_ABORT}
_SERVICES = ("xlaserve.v1.Generation", "xlaserve.v1.Orchestrator", JETSTREAM_SERVICE)
_AUTH_EXEMPT = ("/grpc.health.v1.Health/", "/xlaserve.v1.Orchestrator/HealthCheck",
                f"/{JETSTREAM_SERVICE}/HealthCheck")


def sampling_params_from_proto(sp: pb.SamplingParams, *, keep_special_tokens: bool = False) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults; max_tokens 0 means "until max_model_len".
    keep_special_tokens is the GenerateRequest's own field."""
    has = sp.HasField
    try:
        return SamplingParams(
            temperature=sp.temperature if has("temperature") else 1.0,
            top_k=sp.top_k,
            top_p=sp.top_p if has("top_p") else 1.0,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty if has("repetition_penalty") else 1.0,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            seed=sp.seed if has("seed") else None,
            logprobs=sp.logprobs if has("logprobs") else None,
            stop=list(sp.stop),
            stop_token_ids=list(sp.stop_token_ids),
            min_tokens=sp.min_tokens,
            max_tokens=(sp.max_tokens or None) if has("max_tokens") else 16,
            ignore_eos=sp.ignore_eos,
            n=sp.n if has("n") else 1,
            logit_bias=dict(sp.logit_bias) or None,
            skip_special_tokens=not keep_special_tokens,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _messages(chat: pb.ChatMessages) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


async def _abort(context, e: ServingError):
    """End the call with e's status; one whose deadline has passed ends as cancelled instead: gRPC
    ends it with DEADLINE_EXCEEDED itself, and a status sent after that fails (gRPC logged each such
    send as an error when the request's own deadline fired as the call's did)."""
    left = context.time_remaining()
    if left is not None and left <= 0:
        raise asyncio.CancelledError
    await context.abort(e.grpc_code, e.message)


def _timeout(context) -> float | None:
    return context.time_remaining()


def _close(stream, context, timeout_s: float | None) -> None:
    """Ends a handler's request. A call whose deadline passed usually ends before the stream's own
    deadline fires, cancelled by the client or by gRPC: count that as the deadline failure it is,
    not as a request the client cancelled. gRPC's header rounds a deadline up to three significant
    digits (a client's 1.5 s arrives as ~1.51 s, 100.1 s as ~101 s), so the client's deadline
    passes while this side still sees up to 1% of `timeout_s` (the time left on arrival) left."""
    stream.close(failure="deadline" if _deadline_passed(context, timeout_s) else None)


def _deadline_passed(context, timeout_s: float | None) -> bool:
    left = context.time_remaining()
    return left is not None and left <= 0.01 * (timeout_s or 0.0) + 0.05


async def _submit(core: ServingCore, spec: GenerationSpec, context):
    """core.submit(spec), or None once the call is aborted with the error that refused it. A call
    that ends while its prompt is prepared (tokenized, admitted) cancels this; past its deadline
    that is the deadline failure it is, counted as `_close` counts it later on."""
    try:
        return await core.submit(spec)
    except ServingError as e:
        await _abort(context, e)
    except asyncio.CancelledError:
        if _deadline_passed(context, spec.timeout_s):
            core.metrics.request_failed("deadline")
        raise
    return None


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self._text_of: TokenText | None = None

    def text_of(self) -> TokenText:
        if self._text_of is None:
            self._text_of = TokenText(self.core.tokenizer)
        return self._text_of

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            kind = request.WhichOneof("prompt")
            if kind is None:
                raise InvalidRequest("set one of text, token_ids or chat as the prompt", param="prompt")
            timeout_s = _timeout(context)
            spec = GenerationSpec(
                params=sampling_params_from_proto(request.sampling, keep_special_tokens=request.keep_special_tokens),
                text=request.text if kind == "text" else None,
                token_ids=list(request.token_ids.ids) if kind == "token_ids" else None,
                messages=_messages(request.chat) if kind == "chat" else None,
                request_id=request.request_id or None, priority=request.priority,
                cache_salt=request.cache_salt or None, timeout_s=timeout_s)
        except ServingError as e:  # (the core counts what it refuses; this is refused before it)
            self.core.metrics.request_failed("invalid")
            await _abort(context, e)
            return
        stream = await _submit(self.core, spec, context)
        if stream is None:
            return
        want_lp = spec.params.logprobs is not None
        k = spec.params.logprobs or 0
        first, done = True, set()
        try:
            # Accepted: tell the client now (headers), before the first token.
            await context.send_initial_metadata((("x-request-id", stream.request_id),))
            async for out in stream:
                msg = pb.GenerateResponse(request_id=stream.request_id, finished=out.finished)
                if first:
                    msg.prompt_token_ids.extend(stream.prompt_token_ids)
                    first = False
                for co in out.outputs:  # (the last response names every sequence, with its finish reason)
                    newly_done = co.finish_reason is not None and co.index not in done
                    if not (co.new_token_ids or co.new_text or newly_done or out.finished):
                        continue
                    d = msg.outputs.add(index=co.index, text=co.new_text, finish_reason=_FINISH[co.finish_reason])
                    d.token_ids.extend(co.new_token_ids)
                    if want_lp:
                        for t, row in zip(co.new_token_ids, new_rows(co)):
                            tl = d.logprobs.add(token_id=t, logprob=row.get(t, 0.0))
                            for i, v in sorted(row.items(), key=lambda kv: -kv[1])[:k]:
                                tl.top.add(token_id=i, logprob=v, token=self.text_of()(i))
                    if newly_done or out.finished:
                        done.add(co.index)
                        if isinstance(co.stop_reason, int):
                            d.stop_token_id = co.stop_reason
                        elif isinstance(co.stop_reason, str):
                            d.stop_string = co.stop_reason
                if out.finished:
                    msg.usage.prompt_tokens = len(stream.prompt_token_ids)
                    msg.usage.completion_tokens = sum(len(co.token_ids) for co in out.outputs)
                    msg.usage.cached_prompt_tokens = out.num_cached_tokens
                yield msg
        except ServingError as e:
            await _abort(context, e)
        finally:
            _close(stream, context, timeout_s)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            kind = request.WhichOneof("input")
            if kind == "text":
                special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self.core.tokenize(text=request.text, add_special_tokens=special)
            elif kind == "chat":
                ids = await self.core.tokenize(messages=_messages(request.chat))
            else:
                raise InvalidRequest("set text or chat", param="input")
        except ServingError as e:
            await _abort(context, e)
            return
        tok = self.core.tokenizer
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_piece(i) for i in ids] if tok else [],
                                   max_model_len=self.core.model_info.max_model_len)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context):
        info = self.core.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up; retry shortly")
        return pb.ModelInfoResponse(
            model=info.name, source=info.source, architecture=info.architecture, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, eos_token_ids=list(info.eos_token_ids),
            has_tokenizer=info.has_tokenizer, has_chat_template=info.has_chat_template, dtype=info.dtype,
            max_num_seqs=info.max_num_seqs, page_size=info.page_size, num_pages=info.num_pages,
            max_logprobs=info.max_logprobs, max_n=info.max_n, max_stop=info.max_stop)


class OrchestratorServicer(pb_grpc.OrchestratorServicer):
    """JetStream's API: greedy decoding (JetStream's default sampler), `num_samples` sequences,
    one StreamContent per step with a Sample for each sequence (empty when it had nothing new)."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    async def Decode(self, request: pb.DecodeRequest, context):
        try:
            kind = request.WhichOneof("content")
            if kind is None:
                raise InvalidRequest("set text_content or token_content", param="content")
            if request.max_tokens < 0:
                raise InvalidRequest(f"max_tokens is {request.max_tokens}; it must be >= 1", param="max_tokens")
            n = request.num_samples or 1
            if n < 1:
                raise InvalidRequest(f"num_samples is {n}; it must be >= 1", param="num_samples")
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens or None, n=n)
            timeout_s = _timeout(context)
            spec = GenerationSpec(
                params=params,
                text=request.text_content.text if kind == "text_content" else None,
                token_ids=list(request.token_content.token_ids) if kind == "token_content" else None,
                timeout_s=timeout_s)
        except ServingError as e:
            self.core.metrics.request_failed("invalid")
            await _abort(context, e)
            return
        stream = await _submit(self.core, spec, context)
        if stream is None:
            return
        try:
            await context.send_initial_metadata(())
            async for out in stream:
                if not any(co.new_token_ids or co.new_text for co in out.outputs):
                    continue
                msg = pb.DecodeResponse()
                for co in sorted(out.outputs, key=lambda c: c.index):
                    msg.stream_content.samples.add(text=co.new_text, token_ids=co.new_token_ids)
                yield msg
        except ServingError as e:
            await _abort(context, e)
        finally:
            _close(stream, context, timeout_s)

    async def HealthCheck(self, request: pb.HealthCheckRequest, context):
        return pb.HealthCheckResponse(is_live=self.core.health()[0])


class _Health(health.aio.HealthServicer):
    """Watch follows the core's state (set on changes); Check also asks the engine loop."""

    def __init__(self, core: ServingCore) -> None:
        super().__init__()
        self.core = core

    async def Check(self, request, context):
        if request.service not in ("", *_SERVICES):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        ok = self.core.health()[0]
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def publish(self, state: State) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if state is State.READY
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *_SERVICES):
            await self.set(name, status)


class _RequestGate(grpc.aio.ServerInterceptor):
    """Every call passes here first. With API keys on, a call without a valid key is refused
    before its request is parsed. A request that does not parse (invalid UTF-8 in a string field,
    corrupt bytes) ends INVALID_ARGUMENT: gRPC would end it UNKNOWN and log the parser's traceback.
    Calls that stream requests (reflection) parse as gRPC does."""

    def __init__(self, keys: APIKeyChecker) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        allowed = not self.keys.enabled or details.method.startswith(_AUTH_EXEMPT)
        if not allowed:
            md = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
            allowed = self.keys.check_authorization(md.get("authorization"), md.get("x-api-key"))
        if handler.request_streaming:
            return handler if allowed else _deny(handler)
        return _gated(handler, allowed)


_DENIED = "a valid API key is needed: send metadata 'authorization: Bearer <key>'"


def _deny(handler):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # makes this an async generator, as streaming handlers are

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


def _gated(handler, allowed: bool):
    """A unary-request handler that takes the request's bytes, then checks the key and parses."""
    parse = handler.request_deserializer

    async def request_of(data: bytes, context):
        if not allowed:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        try:
            return parse(data) if parse is not None else data
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse: {e}")

    kw = dict(response_serializer=handler.response_serializer)
    if handler.unary_unary:
        behaviour = handler.unary_unary

        async def unary(data, context):
            return await behaviour(await request_of(data, context), context)

        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    behaviour = handler.unary_stream
    if not inspect.isasyncgenfunction(behaviour):  # it writes with context.write (grpc's health Watch)

        async def writing(data, context):
            await behaviour(await request_of(data, context), context)

        return grpc.unary_stream_rpc_method_handler(writing, **kw)

    async def streaming(data, context):
        async for response in behaviour(await request_of(data, context), context):
            yield response

    return grpc.unary_stream_rpc_method_handler(streaming, **kw)


def _jetstream_handler(servicer: OrchestratorServicer):
    return grpc.method_handlers_generic_handler(JETSTREAM_SERVICE, {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode, request_deserializer=pb.DecodeRequest.FromString,
            response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            servicer.HealthCheck, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    })


class GrpcServer:
    """The gRPC server on the current event loop: `port = await s.start()`, `await s.stop()`."""

    def __init__(self, core: ServingCore, config: ServerConfig, keys: APIKeyChecker | None = None) -> None:
        self.core, self.config = core, config
        keys = keys or APIKeyChecker(config.api_keys)
        # so_reuseport off: with gRPC's default a second server on a taken port bound it too and the
        # kernel split the connections between the two processes, instead of the second one failing.
        self.server = grpc.aio.server(interceptors=[_RequestGate(keys)],
                                      options=[("grpc.so_reuseport", 0)])
        self.health = _Health(core)
        orchestrator = OrchestratorServicer(core)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(core), self.server)
        pb_grpc.add_OrchestratorServicer_to_server(orchestrator, self.server)
        self.server.add_generic_rpc_handlers((_jetstream_handler(orchestrator),))
        from grpc_health.v1 import health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (pb.DESCRIPTOR.services_by_name["Generation"].full_name,
                 pb.DESCRIPTOR.services_by_name["Orchestrator"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self._tasks: set[asyncio.Task] = set()
        self.port: int | None = None

    def _on_state(self, state: State) -> None:
        t = asyncio.get_running_loop().create_task(self.health.publish(state))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def start(self) -> int:
        cfg = self.config
        addr = host_port(cfg.host, cfg.grpc_port)
        try:
            if cfg.tls:
                ca = Path(cfg.tls_ca_certfile).read_bytes() if cfg.tls_ca_certfile else None
                creds = grpc.ssl_server_credentials(
                    [(Path(cfg.tls_keyfile).read_bytes(), Path(cfg.tls_certfile).read_bytes())],
                    root_certificates=ca, require_client_auth=ca is not None)
                self.port = self.server.add_secure_port(addr, creds)
            else:
                self.port = self.server.add_insecure_port(addr)
        except RuntimeError:  # grpcio >= 1.55 raises "Failed to bind" where older versions returned 0
            self.port = 0
        if not self.port:
            raise BindError(f"gRPC could not bind {addr}")
        await self.server.start()
        await self.health.publish(self.core.state)
        self.core.on_state_change(self._on_state)
        return self.port

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.health.publish(State.STOPPED)
        await self.server.stop(grace)
