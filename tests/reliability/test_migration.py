"""Request migration on a real supervised mesh (docs/RELIABILITY.md, "Migration"): 64 greedy
requests in flight over gRPC (streamed), REST and the OpenAI completions route while a
decode or the prefill is SIGKILLed. None fails, every request's tokens equal the
undisturbed run's (the same requests on the same mesh before the kill), and no KV page is in
use afterwards.
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

import grpc
import pytest

from dsmesh.v1 import kv_broker_pb2 as kb
from tests.reliability.fault_harness import (
    Mesh,
    generate_request,
    long_prompt,
    start_mesh,
    wait_mesh_idle,
)
from tests.up.harness import pid_alive, wait_until

NUM_REQUESTS = 64
MAX_NEW = 48
MIGRATED = "dsmesh_requests_migrated_total"


def _prompt(i: int) -> list[int]:
    return long_prompt(40 + i % 7, salt=100 + i)


class Load:
    """The 64 requests, each on its own thread: a quarter each over REST and the OpenAI
    completions route, half streamed over gRPC. ``results[i]`` is what the client got (token
    ids, or the text on the OpenAI route), or the error; ``streamed`` counts the tokens the
    gRPC streams have so far."""

    def __init__(self, mesh: Mesh, tag: str, model: str) -> None:
        self.mesh, self.tag, self.model = mesh, tag, model
        self.results: dict[int, object] = {}
        self.streamed = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(NUM_REQUESTS)
        self._futures = [self._pool.submit(self._one, i) for i in range(NUM_REQUESTS)]

    def _one(self, i: int) -> None:
        rid = f"{self.tag}-{i}"
        try:
            if i % 4 == 2:
                body = {"request_id": rid, "input_ids": _prompt(i)}
                body["sampling"] = {"max_new_tokens": MAX_NEW, "ignore_eos": True}
                status, answer, _ = self.mesh.rest(body, timeout=120)
                self.results[i] = answer["token_ids"] if status == 200 else (status, answer)
            elif i % 4 == 3:
                body = {"model": self.model, "prompt": _prompt(i), "max_tokens": MAX_NEW}
                body |= {"temperature": 0, "ignore_eos": True}
                req = urllib.request.Request(
                    f"{self.mesh.http}/v1/completions",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=120) as resp:
                        self.results[i] = json.loads(resp.read())["choices"][0]["text"]
                except urllib.error.HTTPError as exc:
                    self.results[i] = (exc.code, exc.read())
            else:
                tokens: list[int] = []
                with self.mesh.gateway_channel() as ch:
                    call = self.mesh.generation(ch).Generate(
                        generate_request(rid, _prompt(i), MAX_NEW), timeout=120
                    )
                    for msg in call:
                        tokens += msg.token_ids
                        with self._lock:
                            self.streamed += len(msg.token_ids)
                self.results[i] = tokens
        except grpc.RpcError as exc:
            self.results[i] = (exc.code(), exc.details())

    def wait(self) -> dict[int, object]:
        for f in self._futures:
            f.result(180)
        self._pool.shutdown()
        return self.results


def _model(mesh: Mesh) -> str:
    with urllib.request.urlopen(f"{mesh.http}/v1/models", timeout=5) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _run_with_kill(mesh: Mesh, victim: str, num_decodes: int) -> None:
    """The undisturbed run, then the same requests with ``victim`` SIGKILLed once the gRPC
    streams are under way; every request ends with the undisturbed tokens."""
    wait_mesh_idle(mesh, 60, num_decodes)
    model = _model(mesh)
    expected = Load(mesh, f"{victim}-base", model).wait()
    for i, got in expected.items():
        assert isinstance(got, (list, str)) and len(got) > 0, (i, got)
    wait_mesh_idle(mesh, 60, num_decodes)
    migrated_before = mesh.metric(MIGRATED)
    svc = mesh.services()
    victim_pid = svc[victim][1]
    others = {n: pid for n, (_, pid) in svc.items() if n not in (victim, "gateway")}

    load = Load(mesh, f"{victim}-moved", model)
    # the kill lands while requests are prefilling and decoding: a few tokens streamed
    assert wait_until(lambda: load.streamed >= NUM_REQUESTS // 2, 60, 0.005)
    os.kill(victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    got = load.wait()
    ended = time.monotonic() - killed_at

    failed = {i: r for i, r in got.items() if not isinstance(r, (list, str))}
    assert not failed, failed
    differ = [i for i in range(NUM_REQUESTS) if got[i] != expected[i]]
    assert not differ, [(i, expected[i], got[i]) for i in differ[:3]]
    migrated = mesh.metric(MIGRATED) - migrated_before
    assert migrated >= 1, "no request was in flight on the killed process"

    mesh.up.wait_for(rf"{victim} restarted at \S+ \(pid \d+\), healthy", 60)
    for name, pid in others.items():  # nothing else restarted
        assert pid_alive(pid) and mesh.restarts(name) == 0, name
    wait_mesh_idle(mesh, 60, num_decodes)  # 0 KV pages in use on every instance
    assert mesh.metric("dsmesh_kv_pages_used") == 0
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
