"""Request migration on a real supervised mesh (docs/RELIABILITY.md, "Migration"): 64
requests in flight over gRPC (streamed), REST and the OpenAI completions route (streamed or
not), most greedy, some seeded sampled with logprobs or n = 2, some with a stop string,
while a decode or the prefill is SIGKILLed. None fails, every request's output equals the
undisturbed run's (the same requests on the same mesh before the kill), and no KV page is
in use afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import openai
import pytest

from dsmesh.v1 import kv_broker_pb2 as kb
from tests.mesh import pid_alive, wait_until
from tests.reliability.fault_harness import (
    Mesh,
    Outcome,
    generate_request,
    long_prompt,
    start_mesh,
    wait_mesh_idle,
)

NUM_REQUESTS = 64
MAX_NEW = 48
MIGRATED = "dsmesh_requests_migrated_total"


def _prompt(i: int) -> list[int]:
    return long_prompt(40 + i % 7, salt=100 + i)


@dataclass(frozen=True)
class Failed:
    """A request that ended with an error: its status (gRPC code, HTTP status) and message."""

    status: object
    message: str


class Load:
    """The 64 requests, each on its own thread, eight kinds (by ``i % 8``): greedy gRPC
    streams (0-2), greedy REST (3), greedy OpenAI completions (4), a seeded sampled gRPC
    stream with logprobs (5), greedy REST with a stop string (6), and a seeded sampled
    OpenAI completions stream with n = 2 (7). ``results[i]`` is what the client got, or the
    error; ``streamed`` counts the tokens the gRPC streams have so far."""

    def __init__(self, mesh: Mesh, tag: str, model: str, stop: str) -> None:
        self.mesh, self.tag, self.model, self.stop = mesh, tag, model, stop
        self.results: dict[int, object] = {}
        self.streamed = 0
        self.moves = 0  # usage.migrations summed over every request's answer
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(NUM_REQUESTS)
        self._futures = [self._pool.submit(self._one, i) for i in range(NUM_REQUESTS)]

    def _one(self, i: int) -> None:
        rid = f"{self.tag}-{i}"
        kind = i % 8
        try:
            if kind in (3, 6):
                sampling = {"max_new_tokens": MAX_NEW, "ignore_eos": True}
                if kind == 6:
                    sampling["stop"] = [self.stop]
                body = {"request_id": rid, "input_ids": _prompt(i), "sampling": sampling}
                status, answer, _ = self.mesh.rest(body, timeout=120)
                if status != 200:
                    self.results[i] = Failed(status, str(answer))
                else:
                    self._moved(answer["usage"].get("migrations", 0))
                    if kind == 6:
                        self.results[i] = (answer["text"], answer["finish_reason"])
                    else:
                        self.results[i] = answer["token_ids"]
            elif kind in (4, 7):
                self.results[i] = self._openai(i, stream=kind == 7)
            else:
                self.results[i] = self._grpc(rid, i, sampled=kind == 5)
        except grpc.RpcError as exc:
            self.results[i] = Failed(exc.code(), exc.details() or "")
        except openai.APIError as exc:
            self.results[i] = Failed("openai", str(exc))

    def _grpc(self, rid: str, i: int, sampled: bool) -> object:
        req = generate_request(rid, _prompt(i), MAX_NEW)
        if sampled:
            req.sampling.temperature = 0.9
            req.sampling.seed = 1000 + i
            req.sampling.logprobs = 2
        tokens: list[int] = []
        logprobs: list[tuple] = []
        with self.mesh.gateway_channel() as ch:
            for msg in self.mesh.generation(ch).Generate(req, timeout=120):
                tokens += msg.token_ids
                for lp in msg.logprobs:
                    logprobs.append((lp.token_id, lp.logprob, tuple(t.token_id for t in lp.top)))
                with self._lock:
                    self.streamed += len(msg.token_ids)
                if msg.finish_reason:
                    self._moved(msg.usage.migrations)
        return (tokens, logprobs) if sampled else tokens

    def _openai(self, i: int, stream: bool) -> object:
        client = openai.OpenAI(base_url=f"{self.mesh.http}/v1", api_key="-", max_retries=0)
        args = {"model": self.model, "prompt": _prompt(i), "max_tokens": MAX_NEW}
        if not stream:
            done = client.completions.create(
                temperature=0, extra_body={"ignore_eos": True}, timeout=120, **args
            )
            self._moved((done.usage.model_extra or {}).get("migrations", 0))
            return done.choices[0].text
        texts = ["", ""]
        chunks = client.completions.create(
            temperature=0.9,
            seed=2000 + i,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
            timeout=120,
            **args,
        )
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
            if chunk.usage is not None:
                self._moved((chunk.usage.model_extra or {}).get("migrations", 0))
        return texts

    def _moved(self, migrations: int) -> None:
        with self._lock:
            self.moves += migrations

    def wait(self) -> dict[int, object]:
        for f in self._futures:
            f.result(180)
        self._pool.shutdown()
        return self.results


def _same(i: int, expected: object, got: object) -> bool:
    """Tokens and texts equal; logprobs equal but for float rounding (the batch around the
    request differs between the runs)."""
    if i % 8 != 5:
        return got == expected
    (tokens, lps), (want_tokens, want_lps) = got, expected
    return tokens == want_tokens and all(
        a[0] == b[0] and a[2] == b[2] and abs(a[1] - b[1]) < 1e-4
        for a, b in zip(lps, want_lps, strict=True)
    )


def _model(mesh: Mesh) -> str:
    with urllib.request.urlopen(f"{mesh.http}/v1/models", timeout=5) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _run_with_kill(mesh: Mesh, victim: str, **counts: int) -> None:
    """The undisturbed run, then the same requests with ``victim`` SIGKILLed once the gRPC
    streams are under way; every request ends with the undisturbed tokens."""
    wait_mesh_idle(mesh, 60, **counts)
    model = _model(mesh)
    # a stop string that a kind-6 request reaches late: the end of an undisturbed output
    status, answer, _ = mesh.rest(
        {"input_ids": _prompt(6), "sampling": {"max_new_tokens": MAX_NEW, "ignore_eos": True}}
    )
    assert status == 200, answer
    stop = answer["text"][-4:-1]
    undisturbed = Load(mesh, f"{victim}-base", model, stop)
    expected = undisturbed.wait()
    expected_load_moves = undisturbed.moves
    for i, want in expected.items():
        assert not isinstance(want, Failed) and want, (i, want)
    assert expected[6][1] == "stop" and len(expected[6][0]) < len(answer["text"])
    wait_mesh_idle(mesh, 60, **counts)
    migrated_before = mesh.metric(MIGRATED)
    svc = mesh.services()
    victim_pid = svc[victim][1]
    others = {
        n: (pid, mesh.restarts(n)) for n, (_, pid) in svc.items() if n not in (victim, "gateway")
    }

    load = Load(mesh, f"{victim}-moved", model, stop)
    # the kill lands while requests are prefilling and decoding: a few tokens streamed
    assert wait_until(lambda: load.streamed >= NUM_REQUESTS // 2, 60, 0.005)
    os.kill(victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    got = load.wait()
    ended = time.monotonic() - killed_at

    failed = {i: r for i, r in got.items() if isinstance(r, Failed)}
    assert not failed, failed
    differ = [i for i in range(NUM_REQUESTS) if not _same(i, expected[i], got[i])]
    assert not differ, [(i, expected[i], got[i]) for i in differ[:3]]
    migrated = mesh.metric(MIGRATED) - migrated_before
    assert migrated >= 1, "no request was in flight on the killed process"
    assert load.moves == migrated  # every move shows in its request's usage
    assert expected_load_moves == 0

    mesh.up.wait_for(rf"{victim} restarted at \S+ \(pid \d+\), healthy", 60)
    for name, (pid, restarts) in others.items():  # nothing else restarted
        assert pid_alive(pid) and mesh.restarts(name) == restarts, name
    wait_mesh_idle(mesh, 60, **counts)  # 0 KV pages in use on every instance
    # the gateway's view (its load polls) comes to the same
    assert wait_until(lambda: mesh.metric("dsmesh_kv_pages_used") == 0, 10)
    print(f"RELIABILITY migrate_{victim} migrated={migrated:.0f} all_done_after_kill_s={ended:.2f}")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with start_mesh(tmp_path_factory) as m:
        yield m


def test_decode_killed_with_a_second_decode_loses_no_request(mesh: Mesh) -> None:
    _run_with_kill(mesh, "decode-0", num_decodes=2)


def test_prefill_killed_loses_no_request(mesh: Mesh) -> None:
    _run_with_kill(mesh, "prefill-0", num_decodes=2)


def test_the_only_decode_killed_loses_no_request(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """No decode is left: the requests wait in the gateway until the supervisor's restart
    attaches, then resume there."""
    with start_mesh(tmp_path_factory, decodes=1) as one:
        assert wait_until(lambda: len(one.instances(kb.ROLE_DECODE)) == 1, 60)
        _run_with_kill(one, "decode-0", num_decodes=1)


def test_unified_killed_with_a_second_unified_loses_no_request(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Unified instances (no handoff): the requests of the killed one resume on the other."""
    extra = ("--prefill", "0", "--unified", "2")
    with start_mesh(tmp_path_factory, decodes=0, extra=extra) as mesh:
        _run_with_kill(mesh, "unified-0", num_decodes=0, num_prefills=0, num_unified=2)


def test_limit_zero_fails_lost_requests_and_new_ones_wait_for_the_restart(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``--migration-limit 0``: requests on a killed decode fail UNAVAILABLE. While no decode
    exists (the supervisor is held stopped, so the restart waits), new requests wait in the
    gateway's queue up to ``--max-queued``; past it they get 503 with Retry-After. Once the
    decode is back the waiting ones complete with the undisturbed tokens."""
    extra = ("--migration-limit", "0", "--max-queued", "2")
    with start_mesh(tmp_path_factory, decodes=1, extra=extra) as mesh:
        wait_mesh_idle(mesh, 60, num_decodes=1)
        sampling = {"max_new_tokens": 8, "ignore_eos": True}
        bodies = [{"input_ids": _prompt(i), "sampling": sampling} for i in range(2)]
        expected = [mesh.rest(body)[1]["token_ids"] for body in bodies]
        victim_pid = mesh.services()["decode-0"][1]

        streams = [Outcome(mesh, f"limit0-{i}", _prompt(10 + i), 3000) for i in range(4)]
        for call in streams:
            assert call.first_token.wait(60), (call.code, call.details)
        os.kill(mesh.up.process.pid, signal.SIGSTOP)  # hold the supervisor: no restart yet
        try:
            os.kill(victim_pid, signal.SIGKILL)
            for call in streams:
                assert call.wait(30), f"{call.request_id} hangs"
                assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
            assert mesh.metric(MIGRATED) == 0
            assert wait_until(lambda: not mesh.instances(kb.ROLE_DECODE), 30)
            assert wait_until(lambda: not mesh.healthy(), 30)  # the gateway sees no decode

            pool = ThreadPoolExecutor(2)
            waiting = [pool.submit(mesh.rest, body, 120) for body in bodies]
            assert wait_until(lambda: mesh.metric("dsmesh_requests_queued") == 2, 30), (
                [f.result() if f.done() else "running" for f in waiting],
                mesh.metric("dsmesh_requests_queued"),
            )
            status, answer, headers = mesh.rest(bodies[0])
            assert status == 503 and answer["error"]["status"] == "UNAVAILABLE", answer
            assert headers.get("Retry-After"), headers
        finally:
            os.kill(mesh.up.process.pid, signal.SIGCONT)
        mesh.up.wait_for(r"decode-0 restarted at \S+ \(pid \d+\), healthy", 60)
        got = [f.result(120) for f in waiting]
        pool.shutdown()
        assert [(s, a.get("token_ids")) for s, a, _ in got] == [(200, t) for t in expected]
        wait_mesh_idle(mesh, 60, num_decodes=1)
