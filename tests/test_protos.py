"""The checked-in generated code matches the .proto sources (regenerate: protos/generate.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from google.protobuf import json_format

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "protos/generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    gen = _load_generator()
    fresh = gen.generate(tmp_path)
    assert {f.name for f in fresh} == {f.name for f in (ROOT / "dsmesh/v1").glob("*_pb2*.py*")}, (
        "generated file set differs: run python protos/generate.py"
    )
    for f in fresh:
        checked_in = ROOT / "dsmesh/v1" / f.name
        assert checked_in.read_bytes() == f.read_bytes(), (
            f"dsmesh/v1/{f.name} is stale: run python protos/generate.py"
        )


def test_public_field_names_and_optional_presence() -> None:
    from dsmesh.v1 import generation_pb2 as pb

    req = json_format.Parse(
        '{"request_id": "r1", "text": "hi", "input_ids": [1, 2], "stream": true,'
        ' "sampling": {"temperature": 0, "top_p": 0.9, "top_k": 0, "min_p": 0,'
        ' "max_new_tokens": 8, "seed": "7", "stop": ["\\n"], "stop_token_ids": [2],'
        ' "ignore_eos": true}}',
        pb.GenerateRequest(),
    )
    s = req.sampling
    # temperature 0 is present (greedy), not "unset" -> server default
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("top_k") and s.HasField("min_p") and s.HasField("seed")
    assert not pb.SamplingParams().HasField("temperature")
    assert list(req.input_ids) == [1, 2] and req.stream
    out = pb.GenerateResponse(request_id="r1", token_ids=[5], text="x", finish_reason="stop")
    out.usage.prompt_tokens = 2
    out.usage.completion_tokens = 1
    as_json = json_format.MessageToDict(out, preserving_proto_field_name=True)
    assert set(as_json) == {"request_id", "token_ids", "text", "finish_reason", "usage"}


def test_generate_is_annotated_for_rest() -> None:
    from google.api import annotations_pb2

    from dsmesh.v1 import generation_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    generate = service.methods_by_name["Generate"]
    assert generate.server_streaming
    rule = generate.GetOptions().Extensions[annotations_pb2.http]
    assert rule.post == "/v1/generate" and rule.body == "*"
    assert "Abort" in service.methods_by_name
