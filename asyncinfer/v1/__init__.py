"""Generated protobuf and gRPC stubs for asyncinfer.v1 (scripts/gen_protos.py); do not edit."""
