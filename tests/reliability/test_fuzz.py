"""Fuzzing the gateway's input validation with hypothesis, against a real mesh.

Targets: REST ``/v1/generate`` and ``/v1/abort``, OpenAI ``/v1/completions`` and
``/v1/chat/completions`` (random JSON: wrong types, missing and unknown fields, huge, negative,
NaN and infinite numbers, nested junk, unicode, very long strings, and raw non-JSON bodies), and
gRPC ``Generate``/``Abort`` with random messages (edge values of every sampling field, token ids
negative and huge). Properties: never a 5xx and never INTERNAL/UNKNOWN/UNAVAILABLE; an error
is the route's JSON error object; a success ends with a finish reason; every call answers within
its timeout. Afterwards the mesh is healthy and no KV page is held.

Examples are derandomized (the same inputs on every run of the same test collection) and
bounded so the file runs in seconds. The mesh is the small-limits one the overload tests use
(soak_harness.limited_mesh): its decode pool holds 2048 tokens, so a valid request asking for
more is refused at once (400) instead of generating for seconds; plausible requests ask for
1..8 tokens.

The server bugs this fuzzing found (docs/RELIABILITY.md) are fixed; each keeps a regression
test at the end of this file.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.reliability.soak_harness import (
    CLIENT_FAULT_CODES,
    limited_mesh,
    parse_sse,
    wait_http_ok,
    wait_idle,
)

pytestmark = pytest.mark.timeout(300)

EXAMPLES = 150  # per target
CALL_TIMEOUT_S = 30.0  # every call: a hang is a failure, not a stuck test
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

INT32_MAX = 2**31 - 1
EDGE_INTS = [
    0, 1, 2, -1, 7, 16, 4095, 4096,
    INT32_MAX, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**53 + 1,
    2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**400,
]  # fmt: skip
EDGE_FLOATS = [
    0.0, -0.0, 5e-324, 1e-9, 0.5, 0.9999999, 1.0, 1.0000001, 2.0, -1.0, 1e308,
    math.nan, math.inf, -math.inf,
]  # fmt: skip

text_no_surrogates = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60)
long_text = st.builds(
    lambda c, n: c * n, st.sampled_from(["a", "é", "中", "🙂", " ", "\x00"]), st.integers(1, 50_000)
)
any_text = st.one_of(st.text(max_size=60), text_no_surrogates, long_text)
small_ints = st.integers(-3, 8)
ints = st.one_of(small_ints, st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, any_text)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
token_ids = st.lists(st.one_of(st.integers(0, 511), ints), min_size=0, max_size=12)
valid_ids = st.lists(st.integers(0, 511), min_size=1, max_size=40)
unknown = st.dictionaries(
    st.sampled_from(["foo", "Stream", "sampling_params", "n_predict", "__proto__", ""]), junk,
    max_size=2,
)  # fmt: skip


wild = st.one_of(ints, floats, any_text, junk)  # any field may become any of these


def _has(parent: Any, key: Any) -> bool:
    if isinstance(parent, dict):
        return key in parent
    return isinstance(parent, list) and isinstance(key, int) and key < len(parent)


def _replace(body: Any, path: tuple, value: Any, remove: bool) -> None:
    """Set (or remove) the field at ``path``, when the path exists in ``body``."""
    parent = body
    for key in path[:-1]:
        if not _has(parent, key):
            return
        parent = parent[key]
    last = path[-1]
    if remove and _has(parent, last):
        del parent[last]
    elif isinstance(parent, dict) or _has(parent, last):
        parent[last] = value


@st.composite
def mutated(draw, build: st.SearchStrategy, paths: list[tuple]) -> Any:
    """A plausible request (``build``) with up to two fields, at any of ``paths``, replaced by
    a wild value or removed, and sometimes unknown fields added."""
    body = draw(build)
    for path in draw(st.lists(st.sampled_from(paths), max_size=2, unique=True)):
        remove = draw(st.integers(0, 4)) == 0
        _replace(body, path, None if remove else draw(wild), remove)
    if draw(st.integers(0, 5)) == 0:
        body.update(draw(unknown))
    return body


short_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)
stops = st.lists(short_text, max_size=3)
plausible_sampling = {
    "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 0.5),
    "seed": st.integers(0, 2**63 - 1),
    "stop": stops,
    "ignore_eos": st.booleans(),
}

# ---- REST /v1/generate ------------------------------------------------------------------------

SAMPLING_FIELDS = [*plausible_sampling, "max_new_tokens", "stop_token_ids"]
generate_json = mutated(
    st.builds(
        lambda prompt, rest: {**prompt, **rest},
        st.one_of(
            st.fixed_dictionaries({"text": short_text}),
            st.fixed_dictionaries({"input_ids": valid_ids}),
        ),
        st.fixed_dictionaries(
            {
                "sampling": st.fixed_dictionaries(
                    {"max_new_tokens": st.integers(1, 8)},
                    optional={
                        **plausible_sampling,
                        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
                    },
                )
            },
            optional={"request_id": short_text, "stream": st.booleans()},
        ),
    ),
    [("text",), ("input_ids",), ("request_id",), ("stream",), ("sampling",), ("inputIds",)]
    + [("sampling", f) for f in SAMPLING_FIELDS],
)


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [b"", b"{", b"null", b"[]", b"42", b'"x"', b"{}", b'{"text": "a"', b"\xff\xfe{}",
         b'{"text": "a"}' * 3, b"[" * 100_000, b'{"a":' * 5000, b"\x00" * 100]
    ),
)  # fmt: skip


# ---- OpenAI routes ----------------------------------------------------------------------------

OPENAI_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "n", "best_of", "presence_penalty", "frequency_penalty",
    "logprobs", "echo", "suffix", "stop", "ignore_eos", "stream", "stream_options", "user",
]  # fmt: skip


def openai_common(model: str) -> tuple[dict, dict]:
    required = {"model": st.just(model), "max_tokens": st.integers(1, 8)}
    optional = {
        **{k: v for k, v in plausible_sampling.items() if k != "stop"},
        "stop": st.one_of(short_text, stops),
        "n": st.just(1),
        "logprobs": st.sampled_from([None, False, 0]),
        "presence_penalty": st.just(0),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "user": short_text,
    }
    return required, optional


def bounded_length(body: Any) -> Any:
    """A body whose mutation removed the length bound gets it back: with none, a request runs
    to the end of the context (OpenAI's default, tests/gateway/test_deepseek_mesh.py), longer
    than CALL_TIMEOUT_S on CPU."""
    if isinstance(body, dict) and all(
        body.get(key) is None for key in ("max_tokens", "max_completion_tokens")
    ):
        body["max_tokens"] = 8
    return body


def completions_json(model: str) -> st.SearchStrategy:
    required, optional = openai_common(model)
    prompt = st.one_of(short_text, valid_ids, st.lists(short_text, min_size=1, max_size=1))
    return mutated(
        st.fixed_dictionaries({**required, "prompt": prompt}, optional=optional),
        [(f,) for f in OPENAI_FIELDS if f not in ("messages", "max_completion_tokens")],
    ).map(bounded_length)


def chat_json(model: str) -> st.SearchStrategy:
    required, optional = openai_common(model)
    part = st.fixed_dictionaries({"type": st.just("text"), "text": short_text})
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.one_of(short_text, st.lists(part, min_size=1, max_size=2)),
        }
    )
    messages = st.lists(message, min_size=1, max_size=3)
    fields = [(f,) for f in OPENAI_FIELDS if f not in ("prompt", "echo", "suffix")]
    for i in range(2):
        fields += [("messages", i), ("messages", i, "role"), ("messages", i, "content")]
    return mutated(
        st.fixed_dictionaries({**required, "messages": messages}, optional=optional), fields
    ).map(bounded_length)


# ---- open bugs kept out of the random inputs (each has a strict xfail test below) -------------

TINY_FIELDS = ("temperature", "top_p")  # values float32 flushes to 0: must still work


# ---- checks -----------------------------------------------------------------------------------


def post_raw(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def check_http(url: str, data: bytes, openai: bool, stats: Counter) -> None:
    """No 5xx; errors are the route's JSON error object; successes end with a reason."""
    status, headers, raw = post_raw(url, data)
    stats[status] += 1
    assert status < 500, (status, raw[:300], data[:300])
    if status != 200:
        err = json.loads(raw)["error"]
        assert err["message"], err
        if status == 429:
            assert headers.get("Retry-After"), headers
        return
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        events = parse_sse(raw.decode())
        assert events, raw[:300]
        for kind, event in events:
            assert kind != "error" or event["error"]["code"] < 500, (event, data[:300])
        if events[-1][0] == "error":
            return
        last = events[-1][1]
        if openai:
            last = next(e for _, e in reversed(events) if e.get("choices"))
            assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
        else:
            assert last["finish_reason"] in ("length", "stop"), last
        assert raw.endswith(b"data: [DONE]\n\n") == openai
        return
    out = json.loads(raw)
    if url.endswith("/v1/abort"):
        assert isinstance(out.get("aborted"), bool), out
    elif openai:
        assert out["choices"][0]["finish_reason"] in ("length", "stop"), out
    else:
        assert out["finish_reason"] in ("length", "stop"), out


def check_grpc(
    stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, stats: Counter
) -> None:
    try:
        reasons = [m.finish_reason for m in stub.Generate(request, timeout=CALL_TIMEOUT_S)]
    except grpc.RpcError as exc:
        stats[exc.code().name] += 1
        # BUG id-reuse-cancelled: an id whose earlier request was aborted is refused with
        # CANCELLED (HTTP 499) instead of ALREADY_EXISTS; a client fault either way
        reused = exc.code() == grpc.StatusCode.CANCELLED and "was aborted" in exc.details()
        assert exc.code() in CLIENT_FAULT_CODES or reused, (exc.code(), exc.details(), request)
        return
    stats["OK"] += 1
    assert reasons and reasons[-1] in ("length", "stop"), (reasons, request)


@pytest.fixture(scope="module")
def fuzz_mesh(request, tmp_path_factory):
    yield from limited_mesh(request, tmp_path_factory)


# ---- the properties ---------------------------------------------------------------------------

STATS: dict[str, Counter] = {}  # target -> answers seen (HTTP status / gRPC code)


def http_target(mesh, route: str) -> tuple[st.SearchStrategy, bool]:
    """The bodies to throw at ``route`` and whether it is an OpenAI route."""
    if route == "generate":
        return generate_json, False
    if route == "abort":
        return mutated(st.fixed_dictionaries({"request_id": short_text}), [("request_id",)]), False
    if route == "completions":
        return completions_json(mesh.model_name), True
    return chat_json(mesh.model_name), True


@pytest.mark.parametrize("route", ["generate", "abort", "completions", "chat/completions"])
def test_fuzz_http(fuzz_mesh, route) -> None:
    url = f"{fuzz_mesh.url}/v1/{route}"
    bodies, openai = http_target(fuzz_mesh, route)
    stats = STATS.setdefault(f"POST /v1/{route}", Counter())

    @settings(FUZZ, max_examples=EXAMPLES // 3 if route == "abort" else EXAMPLES)
    @given(body=st.one_of(bodies, bodies, junk, raw_bodies))
    def prop(body) -> None:
        check_http(url, body if isinstance(body, bytes) else encode(body), openai, stats)

    prop()


int32s = st.one_of(small_ints, st.sampled_from([v for v in EDGE_INTS if abs(v) < 2**31]))
grpc_sampling = st.builds(
    lambda fields: pb.SamplingParams(**fields),
    st.fixed_dictionaries(
        {},
        optional={
            "temperature": floats,
            "top_p": floats,
            "top_k": st.one_of(int32s, st.integers(-(2**31), INT32_MAX)),
            "min_p": floats,
            "max_new_tokens": int32s,
            "seed": st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]),
                              st.integers(0, 2**64 - 1)),
            "stop": st.lists(st.one_of(text_no_surrogates, st.just("")), max_size=20),
            "stop_token_ids": st.lists(st.integers(-(2**31), INT32_MAX), max_size=5),
            "ignore_eos": st.booleans(),
        },
    ),
)  # fmt: skip
grpc_requests = st.builds(
    lambda fields: pb.GenerateRequest(**fields),
    st.fixed_dictionaries(
        {},
        optional={
            "request_id": st.one_of(text_no_surrogates, st.just("x" * 257)),
            "text": st.one_of(
                text_no_surrogates, st.builds(lambda n: "ab" * n, st.integers(1, 10_000))
            ),
            "input_ids": st.one_of(
                st.lists(st.integers(-(2**31), INT32_MAX), max_size=12),
                valid_ids,
                st.builds(lambda n: [7] * n, st.integers(400, 5000)),
            ),
            "sampling": grpc_sampling,
            "stream": st.booleans(),
        },
    ),
)


def test_fuzz_grpc_generate(fuzz_mesh) -> None:
    with grpc.insecure_channel(fuzz_mesh.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        stats = STATS.setdefault("gRPC Generate", Counter())

        @FUZZ
        @given(request=grpc_requests)
        def prop(request: pb.GenerateRequest) -> None:
            check_grpc(stub, request, stats)

        prop()
        abort_stats = STATS.setdefault("gRPC Abort", Counter())

        @settings(FUZZ, max_examples=EXAMPLES // 5)
        @given(request_id=st.one_of(text_no_surrogates, st.just("x" * 300)))
        def abort(request_id: str) -> None:
            try:
                stub.Abort(pb.AbortRequest(request_id=request_id), timeout=CALL_TIMEOUT_S)
                abort_stats["OK"] += 1
            except grpc.RpcError as exc:
                abort_stats[exc.code().name] += 1
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc

        abort()


# ---- open bugs: minimal reproductions ---------------------------------------------------------

# Regression tests for bugs the fuzzing found (docs/RELIABILITY.md), fixed since.


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_fuzz_regression_float_overflow(fuzz_mesh, field) -> None:
    """A JSON integer beyond float range: ``float()`` raises OverflowError -> 500."""
    body = {"model": fuzz_mesh.model_name, "prompt": "hi", "max_tokens": 1, field: 10**400}
    status, _, raw = post_raw(f"{fuzz_mesh.url}/v1/completions", encode(body))
    assert status == 400, (status, raw[:200])


@pytest.mark.parametrize("field", ["max_tokens", "top_k"])
def test_fuzz_regression_int32_overflow(fuzz_mesh, field) -> None:
    """Valid for SamplingParams, too big for the proto's int32: ``sampling_to_proto`` raises
    ValueError inside the request pipeline -> 500."""
    body = {"model": fuzz_mesh.model_name, "prompt": "hi", "max_tokens": 1, field: 2**31}
    status, _, raw = post_raw(f"{fuzz_mesh.url}/v1/completions", encode(body))
    assert status in (400, 429), (status, raw[:200])


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("completions", {"prompt": "a\ud800b"}),
        ("completions", {"prompt": "hi", "stop": "\udfff"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}),
    ],
)
def test_fuzz_regression_unpaired_surrogate(fuzz_mesh, route, extra) -> None:
    """JSON may escape an unpaired UTF-16 surrogate (``"\\ud800"``); the tokenizer (TypeError)
    and the proto conversion (UnicodeEncodeError) cannot take it -> 500."""
    body = {"model": fuzz_mesh.model_name, "max_tokens": 1, **extra}
    status, _, raw = post_raw(f"{fuzz_mesh.url}/v1/{route}", encode(body))
    assert status == 400, (status, raw[:200])


@pytest.mark.parametrize("protocol", ["rest", "openai", "grpc"])
@pytest.mark.parametrize("field", TINY_FIELDS)
def test_fuzz_regression_tiny_sampling(fuzz_mesh, protocol, field) -> None:
    """0 < temperature < ~1.2e-38 or 0 < top_p < ~1.4e-45 pass validation, but the sampler
    works in float32: the temperature divides the logits by 0 or a subnormal (softmax NaN), the
    top_p threshold rounds to 0 (no token kept). The sampled token is -1, prefill cannot commit
    it, and the client gets 503 UNAVAILABLE with Retry-After for a request that never works."""
    sampling = {"temperature": 1.0, field: 5e-324}
    if protocol == "grpc":
        with grpc.insecure_channel(fuzz_mesh.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                input_ids=[5, 6, 7], sampling=pb.SamplingParams(**sampling)
            )
            check_grpc(stub, request, Counter())
        return
    if protocol == "rest":
        url, openai = f"{fuzz_mesh.url}/v1/generate", False
        body: dict = {"input_ids": [5, 6, 7], "sampling": sampling}
    else:
        url, openai = f"{fuzz_mesh.url}/v1/completions", True
        body = {"model": fuzz_mesh.model_name, "prompt": "hi", "max_tokens": 16, **sampling}
    check_http(url, encode(body), openai, Counter())


def test_fuzz_mesh_healthy_afterwards(fuzz_mesh) -> None:
    """Whatever was thrown at it, the mesh is healthy and holds no KV page afterwards."""
    wait_http_ok(f"{fuzz_mesh.url}/health", 10)
    after = wait_idle(fuzz_mesh.url)
    assert after["dsmesh_kv_pages_used"] == 0, after
    assert all(fuzz_mesh.alive().values()), fuzz_mesh.alive()
    outcomes = {k: v for k, v in after.items() if k.startswith("dsmesh_requests_total")}
    print()
    for target, stats in STATS.items():
        print(f"fuzz: {target:28s} {sum(stats.values()):4d} inputs, answers {dict(stats)}")
    print(f"fuzz: after fuzzing, kv pages used 0; gateway outcomes {outcomes}")
