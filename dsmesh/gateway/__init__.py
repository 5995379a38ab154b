"""The public API: gRPC dsmesh.v1.Generation, REST transcoding, OpenAI routes (docs/GATEWAY.md)."""
