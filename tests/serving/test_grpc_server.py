"""The gRPC server through generated stubs, on stories260K."""

from __future__ import annotations

import importlib
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protos import xlaserve_pb2 as pb
from serving.protos import xlaserve_pb2_grpc as pb_grpc
from tests.serving.conftest import MODEL_NAME, LiveServer, steps_held_until_cancel
from tests.serving.test_http_server import GOLDEN, PROMPT, failed_count, finished_count


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(server.grpc_target)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


def collect(responses):
    """(text per index, token ids per index, finish reason per index, last response). The last
    response names every sequence with its finish reason (the proto's promise), also one that
    finished before: with nothing new, and the same reason."""
    text, ids, finish, last = {}, {}, {}, None
    for r in responses:
        last = r
        for d in r.outputs:
            text[d.index] = text.get(d.index, "") + d.text
            ids.setdefault(d.index, []).extend(d.token_ids)
            if d.finish_reason:
                if d.index in finish:
                    assert r.finished and not d.token_ids and not d.text, "a sequence finished twice"
                    assert d.finish_reason == finish[d.index]
                finish[d.index] = d.finish_reason
    if last is not None and last.finished:
        assert sorted(d.index for d in last.outputs if d.finish_reason) == sorted(ids)
    return text, ids, finish, last


def test_generate_greedy(stub):
    sp = pb.SamplingParams(temperature=0, max_tokens=16)
    responses = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=30))
    text, ids, finish, last = collect(responses)
    assert GOLDEN.startswith(PROMPT + text[0]) and len(ids[0]) == 16
    assert finish == {0: pb.FINISH_REASON_LENGTH}
    assert list(responses[0].prompt_token_ids)[:1] == [1] and len(responses[0].prompt_token_ids) == 5
    assert last.finished and not any(r.finished for r in responses[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 16)
    # The same prompt as token ids gives the same tokens.
    _, ids2, _, _ = collect(stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=list(responses[0].prompt_token_ids)), sampling=sp), timeout=30))
    assert ids2 == ids


def test_generate_chat_n2_logprobs_seed(stub):
    req = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Tell me a story")]),
        sampling=pb.SamplingParams(temperature=1.2, max_tokens=8, n=2, seed=11, logprobs=2), request_id="my-id")
    a = list(stub.Generate(req, timeout=30))
    assert all(r.request_id == "my-id" for r in a)
    text, ids, finish, last = collect(a)
    assert set(ids) == {0, 1} and all(len(v) == 8 for v in ids.values())
    for r in a:
        for d in r.outputs:
            assert len(d.logprobs) == len(d.token_ids)
            for t, lp in zip(d.token_ids, d.logprobs):
                assert lp.token_id == t and lp.logprob <= 0 and len(lp.top) == 2
                assert lp.top[0].logprob >= lp.top[1].logprob
    assert last.usage.completion_tokens == 16
    assert collect(stub.Generate(req, timeout=30))[1] == ids  # seeded: the same samples again


def test_the_last_response_names_every_sequences_finish(stub):
    """Samples 1..n-1 start a step after sample 0 (forked once the prompt is computed), so sample 0
    ended a response early and the last one named only the others: a client reading the last
    response alone missed a finish reason the proto promises there."""
    sp = pb.SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=5, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=30))
    _, ids, finish, last = collect(responses)
    assert finish == {i: pb.FINISH_REASON_LENGTH for i in range(3)} and all(len(v) == 4 for v in ids.values())
    assert sorted(d.index for d in last.outputs) == [0, 1, 2] and last.usage.completion_tokens == 12


def test_generate_logit_bias(stub):
    sp = pb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={400: 100.0})
    _, ids, _, _ = collect(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=30))
    assert ids[0] == [400] * 5


def test_generate_stop_string(stub):
    sp = pb.SamplingParams(temperature=0, max_tokens=30, stop=[" little"])
    responses = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=30))
    text, _, finish, _ = collect(responses)
    assert text[0] == ", there was a" and finish[0] == pb.FINISH_REASON_STOP
    last_delta = [d for r in responses for d in r.outputs][-1]
    assert last_delta.WhichOneof("stop_reason") == "stop_string" and last_delta.stop_string == " little"


@pytest.mark.parametrize("sampling, prompt, needle", [
    (pb.SamplingParams(top_p=2.0), PROMPT, "top_p must be in (0, 1]"),
    (pb.SamplingParams(max_tokens=1000), PROMPT, "max_model_len is 256"),
    (pb.SamplingParams(n=40), PROMPT, "n is 40; max_n is 16"),
    (pb.SamplingParams(logprobs=30), PROMPT, "logprobs is 30; max_logprobs is 20"),
    (pb.SamplingParams(stop_token_ids=[-3]), PROMPT, "stop_token_ids must be ints >= 0"),
    (pb.SamplingParams(logit_bias={3: 200.0}), PROMPT, "logit_bias values must be numbers in [-100, 100]"),
    (pb.SamplingParams(logit_bias={900: 1.0}), PROMPT, "logit_bias token id 900 is out of range"),
    (pb.SamplingParams(), None, "set one of text, token_ids or chat"),
])
def test_generate_invalid_argument(stub, server, sampling, prompt, needle):
    req = pb.GenerateRequest(sampling=sampling)
    if prompt is not None:
        req.text = prompt
    invalid = failed_count(server.core, "invalid")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert failed_count(server.core, "invalid") == invalid + 1  # (refused by the servicer or by the core)


def test_deadline_and_cancel_abort_the_request(stub, server):
    core = server.core
    sp = pb.SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    aborted, late = finished_count(core, "abort"), failed_count(core, "deadline")
    # the engine makes no step until the server cancels: the deadline expires mid-way, however fast.
    # Each request counts once: the deadline as a failure, not also as a finish by its cancel's abort.
    # (gRPC rounds a deadline up to three digits on the way: the client's 1.5 s passes first, and
    # the client cancels with ~10 ms still left here)
    for timeout in (0.3, 0.3, 1.5):
        with steps_held_until_cancel(server), pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=timeout))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        server.call(core.wait_idle(), timeout=30)
    assert (finished_count(core, "abort"), failed_count(core, "deadline")) == (aborted, late + 3)
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=30)
    next(call)
    with steps_held_until_cancel(server):
        call.cancel()
    server.call(core.wait_idle(), timeout=30)
    assert finished_count(core, "abort") == aborted + 1 and failed_count(core, "deadline") == late + 3
    assert core.in_flight == 0


def test_a_deadline_that_passes_while_the_prompt_is_prepared_counts(stub, server, monkeypatch):
    """A call whose deadline passes while its prompt is tokenized ends before the request exists;
    it counted nowhere (docs/serving.md: a request whose deadline passed counts as "deadline")."""
    core = server.core
    real = core._prompt_ids
    monkeypatch.setattr(core, "_prompt_ids", lambda spec: time.sleep(1.0) or real(spec))
    late, ok = failed_count(core, "deadline"), finished_count(core, "length")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2)), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while failed_count(core, "deadline") == late and time.monotonic() < deadline:
        time.sleep(0.05)
    assert failed_count(core, "deadline") == late + 1 and finished_count(core, "length") == ok


def test_keep_special_tokens(stub, server):
    # stories260K's tokenizer has BOS (1) and EOS (2) as special tokens; EOS is forced here
    sp = pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={2: 100.0})
    for keep in (False, True):
        text, ids, _, _ = collect(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp, keep_special_tokens=keep),
                                                timeout=30))
        assert ids[0] == [2, 2, 2]
        assert text[0] == server.engine.tokenizer.decode([2, 2, 2], skip_special_tokens=not keep)
        assert bool(text[0]) is keep


@pytest.mark.parametrize("rid", ["\u00fc", "nl\nid", "a b", "x" * 257])
def test_generate_refuses_a_bad_request_id(stub, server, rid):
    before = failed_count(server.core, "invalid")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(request_id=rid, text=PROMPT, sampling=pb.SamplingParams(max_tokens=2)),
                           timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id must be 1 to 256 printable" in e.value.details()
    assert failed_count(server.core, "invalid") == before + 1 and server.core.in_flight == 0


def test_generate_with_a_request_id(stub, server):
    sp = pb.SamplingParams(temperature=0, max_tokens=2)
    for _ in range(2):  # the id is free again once its request ended
        call = stub.Generate(pb.GenerateRequest(request_id="client-7:a/b", text=PROMPT, sampling=sp), timeout=30)
        responses = list(call)
        assert dict(call.initial_metadata())["x-request-id"] == "client-7:a/b"
        assert {r.request_id for r in responses} == {"client-7:a/b"}


def test_tokenize_and_model_info(stub, server):
    r = stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True))
    assert list(r.token_ids) == server.engine.tokenizer.encode(PROMPT) and len(r.tokens) == len(r.token_ids)
    # unset: the ids Generate and HTTP /tokenize take the text as (BOS first)
    assert stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids == r.token_ids
    assert list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=False)).token_ids) == r.token_ids[1:]
    assert r.max_model_len == 256
    r = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])))
    rendered = "<s>user: x\nassistant:"  # the test template; BOS as text, so no BOS is added again
    assert list(r.token_ids) == server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.model, info.vocab_size, info.max_model_len, info.max_num_seqs) == (MODEL_NAME, 512, 256, 16)
    # stories260K is a llama2.c model: BOS (1) ends a generation as EOS (2) does
    assert list(info.eos_token_ids) == [2, 1] and info.has_tokenizer and info.has_chat_template


def test_health_and_reflection(channel):
    h = health_pb2_grpc.HealthStub(channel)
    for service in ("", "xlaserve.v1.Generation", "jetstream_proto.Orchestrator"):
        assert h.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        h.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"xlaserve.v1.Generation", "xlaserve.v1.Orchestrator", "grpc.health.v1.Health"} <= names


# JetStream's own messages (jetstream/core/proto/jetstream.proto, package jetstream_proto), compiled here
# so that the test talks to the server exactly as a JetStream client does.
JETSTREAM_PROTO = """
syntax = "proto3";
package jetstream_proto;
service Orchestrator {
  rpc Decode(DecodeRequest) returns (stream DecodeResponse) {}
  rpc HealthCheck(HealthCheckRequest) returns (HealthCheckResponse) {}
}
message DecodeRequest {
  int32 max_tokens = 4;
  message TextContent { string text = 1; }
  message TokenContent { repeated int32 token_ids = 1; }
  oneof content { TextContent text_content = 5; TokenContent token_content = 6; }
  message Metadata { float start_time = 1; }
  oneof metadata_optional { Metadata metadata = 7; }
  int32 num_samples = 8;
  reserved 1, 2, 3;
}
message DecodeResponse {
  message InitialContent {}
  message StreamContent {
    message Sample { string text = 1; repeated int32 token_ids = 2; }
    repeated Sample samples = 1;
  }
  oneof content { InitialContent initial_content = 2; StreamContent stream_content = 3; }
  reserved 1;
}
message HealthCheckRequest {}
message HealthCheckResponse { bool is_live = 1; }
"""


@pytest.fixture(scope="module")
def jetstream(tmp_path_factory):
    protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools (dev extra) compiles JetStream's proto")
    d = tmp_path_factory.mktemp("jetstream")
    (d / "jetstream.proto").write_text(JETSTREAM_PROTO)
    assert protoc.main(["protoc", f"-I{d}", f"--python_out={d}", f"--grpc_python_out={d}", str(d / "jetstream.proto")]) == 0
    sys.path.insert(0, str(d))
    try:
        return importlib.import_module("jetstream_pb2"), importlib.import_module("jetstream_pb2_grpc")
    finally:
        sys.path.remove(str(d))


def test_jetstream_client_works_unchanged(channel, jetstream):
    js, js_grpc = jetstream
    orch = js_grpc.OrchestratorStub(channel)
    assert orch.HealthCheck(js.HealthCheckRequest()).is_live
    req = js.DecodeRequest(max_tokens=6, text_content=js.DecodeRequest.TextContent(text=PROMPT),
                           metadata=js.DecodeRequest.Metadata(start_time=1.0))
    responses = list(orch.Decode(req, timeout=30))
    assert all(r.WhichOneof("content") == "stream_content" and len(r.stream_content.samples) == 1 for r in responses)
    text = "".join(r.stream_content.samples[0].text for r in responses)
    ids = [t for r in responses for t in r.stream_content.samples[0].token_ids]
    assert len(ids) == 6 and GOLDEN.startswith(PROMPT + text)  # greedy, as JetStream decodes
    # Token content and several samples.
    req = js.DecodeRequest(max_tokens=3, token_content=js.DecodeRequest.TokenContent(token_ids=[1, 403, 407]),
                           num_samples=2)
    responses = list(orch.Decode(req, timeout=30))
    assert all(len(r.stream_content.samples) == 2 for r in responses)
    with pytest.raises(grpc.RpcError) as e:
        list(orch.Decode(js.DecodeRequest(max_tokens=3), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _corrupt(message, good: bytes, bad: bytes) -> bytes:
    data = message.SerializeToString()
    assert good in data
    return data.replace(good, bad)


@pytest.mark.parametrize("method, data", [
    ("/xlaserve.v1.Generation/Generate", _corrupt(pb.GenerateRequest(text="hi!"), b"hi!", b"hi\xff")),
    ("/xlaserve.v1.Generation/Tokenize", _corrupt(pb.TokenizeRequest(text="ab"), b"ab", b"\xc3(")),
    ("/xlaserve.v1.Generation/Generate", _corrupt(pb.GenerateRequest(request_id="r1"), b"r1", b"\xed\xa0")),
    ("/jetstream_proto.Orchestrator/Decode", b"\xff\xff"),
    ("/xlaserve.v1.Generation/ModelInfo", b"\x0a"),
])
def test_a_request_that_does_not_parse_is_an_invalid_argument(channel, method, data):
    """gRPC ended these UNKNOWN, logging the parser's traceback each time."""
    call = channel.unary_unary if method.endswith(("Tokenize", "ModelInfo")) else channel.unary_stream
    with pytest.raises(grpc.RpcError) as e:
        out = call(method)(data, timeout=30)
        list(out) if not isinstance(out, bytes) else out
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("the request does not parse: ")


def test_api_keys_and_health_exemption(engine):
    s = LiveServer(engine, api_keys=("sekrit",)).start()
    try:
        with grpc.insecure_channel(s.grpc_target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfo(pb.ModelInfoRequest(), metadata=[("authorization", "Bearer wrong")])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = list(stub.Generate(req, timeout=30, metadata=[("authorization", "Bearer sekrit")]))
            assert out[-1].finished
            # the key is checked before the request is parsed
            with pytest.raises(grpc.RpcError) as e:
                list(ch.unary_stream("/xlaserve.v1.Generation/Generate")(b"\xff\xff", timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/xlaserve.v1.Generation/Tokenize")(b"\xff", timeout=30,
                                                                   metadata=[("authorization", "Bearer sekrit")])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            h = health_pb2_grpc.HealthStub(ch)
            assert h.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            assert pb_grpc.OrchestratorStub(ch).HealthCheck(pb.HealthCheckRequest()).is_live
    finally:
        s.stop()


def test_a_second_server_cannot_share_the_grpc_port():
    """With gRPC's default SO_REUSEPORT a second server bound a port another one listened on, and the
    kernel split the connections between the two processes; it must fail to bind instead."""
    import asyncio
    import dataclasses

    from serving.config import ServerConfig
    from serving.core import ServingCore
    from serving.errors import BindError
    from serving.grpc_server import GrpcServer

    async def go() -> None:
        cfg = ServerConfig(port=None, grpc_port=0, status_interval_s=0)
        first = GrpcServer(ServingCore(cfg, MODEL_NAME), cfg)
        port = await first.start()
        cfg2 = dataclasses.replace(cfg, grpc_port=port)
        second = GrpcServer(ServingCore(cfg2, MODEL_NAME), cfg2)
        try:
            with pytest.raises(BindError, match=f"gRPC could not bind 127.0.0.1:{port}"):
                await second.start()
        finally:
            await second.server.stop(None)  # (running only where the second bind wrongly succeeded)
            await first.stop(grace=None)

    asyncio.run(go())


def test_an_error_after_the_calls_deadline_ends_it_quietly():
    """When a request's own deadline fires as the call's does, gRPC has already ended the call with
    DEADLINE_EXCEEDED; a status sent then failed and was logged as an error. The handler now ends
    as cancelled; before the deadline the error is the call's status."""
    import asyncio

    from serving.errors import DeadlineExceeded, InvalidRequest
    from serving.grpc_server import _abort

    class Context:
        def __init__(self, left):
            self.left, self.sent = left, None

        def time_remaining(self):
            return self.left

        async def abort(self, code, message):
            self.sent = (code, message)
            raise grpc.aio.AbortError

    late = Context(0)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_abort(late, DeadlineExceeded("the request's deadline of 0.1 s passed")))
    assert late.sent is None
    for left in (2.5, None):
        ctx = Context(left)
        with pytest.raises(grpc.aio.AbortError):
            asyncio.run(_abort(ctx, InvalidRequest("bad")))
        assert ctx.sent == (grpc.StatusCode.INVALID_ARGUMENT, "bad")
