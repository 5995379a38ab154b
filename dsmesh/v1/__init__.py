"""Generated protobuf and gRPC code for package dsmesh.v1."""
