"""Plumbing the services stand on: gRPC servers and channels, security, telemetry,
the service lifecycle, proto conversions and the KV transfer engine. Imports no service."""
