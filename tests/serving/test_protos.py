"""The committed stubs match the .proto, and the Orchestrator messages keep JetStream's numbers."""

from __future__ import annotations

import pytest

from serving.protos import xlaserve_pb2 as pb

# From JetStream's jetstream/core/proto/jetstream.proto (package jetstream_proto).
JETSTREAM_FIELDS = {
    "DecodeRequest": {"max_tokens": 4, "text_content": 5, "token_content": 6, "metadata": 7, "num_samples": 8},
    "DecodeRequest.TextContent": {"text": 1},
    "DecodeRequest.TokenContent": {"token_ids": 1},
    "DecodeRequest.Metadata": {"start_time": 1},
    "DecodeResponse": {"initial_content": 2, "stream_content": 3},
    "DecodeResponse.StreamContent": {"samples": 1},
    "DecodeResponse.StreamContent.Sample": {"text": 1, "token_ids": 2},
    "HealthCheckResponse": {"is_live": 1},
}


def test_committed_stubs_are_current():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    from serving.protos import generate

    assert generate.main(["--check"]) == 0, "run `python -m serving.protos.generate` and commit the stubs"


def test_orchestrator_keeps_jetstream_field_numbers():
    for name, fields in JETSTREAM_FIELDS.items():
        desc = pb.DESCRIPTOR.message_types_by_name[name.split(".")[0]]
        for part in name.split(".")[1:]:
            desc = desc.nested_types_by_name[part]
        assert {f.name: f.number for f in desc.fields} == fields, name
    svc = pb.DESCRIPTOR.services_by_name["Orchestrator"]
    assert {m.name: (m.server_streaming, m.client_streaming) for m in svc.methods} == {
        "Decode": (True, False), "HealthCheck": (False, False)}


def test_sampling_params_message_covers_every_field():
    import dataclasses

    from runtime.request import SamplingParams

    proto_fields = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    # output_kind is how the server reads the engine's outputs (ServingCore asks for deltas), not a
    # client's choice: a stream sends only new tokens whatever the request. skip_special_tokens is
    # the request's keep_special_tokens (negated: proto3's default false keeps vLLM's default).
    assert {f.name for f in dataclasses.fields(SamplingParams)} - {"output_kind", "skip_special_tokens"} <= proto_fields
    assert "keep_special_tokens" in {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields}
