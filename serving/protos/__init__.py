"""Generated gRPC stubs for serving/protos/xlaserve.proto (package xlaserve.v1).

The *_pb2 files are generated and committed, so that installing xlaserve needs only the protobuf
and grpcio runtimes (pyproject pins them at or above the versions that generated the stubs).
Regenerate with `python -m serving.protos.generate` after editing the .proto.
"""
