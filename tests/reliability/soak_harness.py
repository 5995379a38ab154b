"""Shared helpers of the overload, soak and fuzz tests: a mesh on free ports (through
``dsmesh up`` or service by service), process memory, gateway metrics, async clients.

Every mesh uses its own cache folder (the tiny model is built once, in-process, before any
child starts) and its own free ports, so these tests never touch the README's 8000/50051.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.mesh import UpProcess, free_port, wait_http_ok

# gRPC codes a well-behaved gateway may answer a bad or excessive request with. INTERNAL,
# UNKNOWN, DATA_LOSS, UNAVAILABLE and the like are server faults.
CLIENT_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


def shared_cache(tmp_path_factory) -> Path:
    """One cache folder for every reliability mesh of the test run (the model is built once)."""
    path = tmp_path_factory.getbasetemp() / "reliability-cache"
    path.mkdir(exist_ok=True)
    return path


def model_dir(cache: Path) -> Path:
    """The tiny default model under ``cache``, built here so that children never race."""
    from dsmesh.engine.model.tiny_model import default_model_dir

    return default_model_dir(cache_dir=cache)


# ---- process memory ---------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (VmRSS of /proc/PID/status)."""
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    assert m, f"no VmRSS for pid {pid}"
    return int(m.group(1)) / 1024


def rss_all(pids: dict[str, int]) -> dict[str, float]:
    return {name: rss_mb(pid) for name, pid in pids.items()}


# ---- meshes -----------------------------------------------------------------------------------


@dataclass
class Mesh:
    """A running mesh: where to reach the gateway and which process runs each service."""

    http_port: int
    grpc_address: str
    model_dir: Path
    log_dir: Path
    pids: dict[str, int]
    _up: UpProcess | None = None
    _services: list[ServiceProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def alive(self) -> dict[str, bool]:
        return {name: Path(f"/proc/{pid}").exists() for name, pid in self.pids.items()}

    def close(self) -> None:
        if self._up is not None:
            self._up.close()
        stop_all(self._services)

    def log_tails(self, lines: int = 30) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)


def start_up_mesh(cache: Path, log_dir: Path, extra: Iterable[str] = ()) -> Mesh:
    """``dsmesh up`` on free ports; service pids from its ready lines."""
    model = model_dir(cache)
    http_port, grpc_port = free_port(), free_port()
    args = [
        "--model",
        str(model),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--log-dir",
        str(log_dir),
        *extra,
    ]
    up = UpProcess(args, env={"DSMESH_CACHE_DIR": str(cache)})
    try:
        up.wait_for(r"^dsmesh mesh ready", timeout=180)
        services = up.ready_services()
        pids = {name: pid for name, (_, pid) in services.items()}
        mesh = Mesh(http_port, services["gateway"][0], model, log_dir, pids, _up=up)
        wait_http_ok(f"{mesh.url}/health", 60)
        return mesh
    except BaseException:
        up.close()
        raise


def start_manual_mesh(
    cache: Path,
    log_dir: Path,
    prefill: Iterable[str] = (),
    decode: Iterable[str] = (),
    gateway: Iterable[str] = (),
) -> Mesh:
    """kv_broker, one prefill, one decode and the gateway, each with its own extra flags
    (``dsmesh up`` forwards engine flags only, not ``--max-inflight`` or
    ``--max-queued-tokens``)."""
    model = model_dir(cache)
    env = {"DSMESH_CACHE_DIR": str(cache)}
    started: list[ServiceProcess] = []
    lock = threading.Lock()

    def start(name: str, *args: str) -> ServiceProcess:
        svc = start_service(name, dsmesh_command(*args), env=env, log_dir=log_dir, timeout=180)
        with lock:
            started.append(svc)
        return svc

    try:
        broker = start("kv-broker", "kv-broker", "--port", "0")
        common = ("--broker", broker.address, "--model", str(model), "--port", "0")
        http_port = free_port()
        gateway_args = (
            *("gateway", "--broker", broker.address, "--model", str(model)),
            *("--grpc-port", "0", "--http-port", str(http_port), *gateway),
        )
        # the three start together (each takes seconds to import torch and load the model)
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(start, "prefill-0", "prefill", *common, *prefill),
                pool.submit(start, "decode-0", "decode", *common, *decode),
                pool.submit(start, "gateway", *gateway_args),
            ]
            gw = [f.result() for f in futures][-1]
        pids = {svc.name: svc.process.pid for svc in started}
        mesh = Mesh(http_port, gw.address, model, log_dir, pids, _services=started)
        wait_http_ok(f"{mesh.url}/health", 60)
        return mesh
    except BaseException:
        stop_all(started)
        raise


def stop_all(services: list[ServiceProcess]) -> None:
    """SIGTERM every service at once, then wait for each (SIGKILL after 10 s)."""
    for svc in services:
        if svc.alive():
            svc.process.send_signal(signal.SIGTERM)
    for svc in services:
        svc.stop(timeout=10)


# The mesh with small admission limits that the overload and fuzz tests share (started once;
# stopped after the last test that uses it).
LIMITED_MAX_INFLIGHT = 8  # gateway --max-inflight
LIMITED_MAX_QUEUED = 16  # gateway --max-queued
LIMITED_DECODE_TOKENS = 2048  # decode --max-total-tokens: 128 pages of 16
LIMITED_PREFILL_QUEUE = 1024  # prefill --max-queued-tokens
_shared: dict[str, Mesh] = {}
atexit.register(lambda: [m.close() for m in list(_shared.values())])  # an interrupted test run


LIMITED_USERS = ("overload_mesh", "fuzz_mesh")  # the module fixtures built on limited_mesh


def limited_mesh(request, tmp_path_factory) -> Iterator[Mesh]:
    """Body of the module-scoped fixtures in LIMITED_USERS: the shared small-limits mesh,
    stopped when no later test of the run uses one of them."""
    mesh = _shared.get("limited")
    if mesh is None or not all(mesh.alive().values()):
        if mesh is not None:
            mesh.close()
        mesh = _shared["limited"] = start_manual_mesh(
            shared_cache(tmp_path_factory),
            tmp_path_factory.mktemp("limited-logs"),
            prefill=["--max-queued-tokens", str(LIMITED_PREFILL_QUEUE)],
            decode=["--max-total-tokens", str(LIMITED_DECODE_TOKENS)],
            gateway=[
                *("--max-inflight", str(LIMITED_MAX_INFLIGHT)),
                *("--max-queued", str(LIMITED_MAX_QUEUED)),
            ],
        )
    try:
        yield mesh
    finally:
        if not _used_later(request, LIMITED_USERS):
            _shared.pop("limited", None)
            mesh.close()


def _used_later(request, fixtures: tuple[str, ...]) -> bool:
    """Whether a test after this module's last one uses one of ``fixtures``."""
    items = request.session.items
    prefix = request.node.nodeid + "::"
    mine = [i for i, item in enumerate(items) if item.nodeid.startswith(prefix)]
    later = items[max(mine) + 1 :] if mine else []
    return any(set(fixtures) & set(getattr(item, "fixturenames", ())) for item in later)


# ---- metrics ----------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Gateway /metrics as {'name{labels}': value} (comments dropped)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Wait until no KV page is held and no request is running or waiting (the gateway polls
    decode's load four times a second); returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = (
            m.get("dsmesh_kv_pages_used", -1) == 0
            and m.get("dsmesh_requests_running", -1) == 0
            and m.get("dsmesh_requests_waiting", -1) == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


# ---- clients ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request ended with, whatever the protocol."""

    protocol: str
    status: int | str  # HTTP status, or the gRPC status name
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    retry_after: str | None = None
    seconds: float = 0.0
    error: str = ""
    error_body: str = ""  # an HTTP refusal's body, as sent


async def grpc_generate(
    stub: generation_pb2_grpc.GenerationStub,
    request: pb.GenerateRequest,
    timeout: float,
    cancel_after: int | None = None,
) -> Outcome:
    """Run one Generate stream to its end (or cancel it after ``cancel_after`` messages)."""
    start = time.monotonic()
    out = Outcome("grpc", "OK")
    call = stub.Generate(request, timeout=timeout)
    try:
        seen = 0
        async for msg in call:
            out.token_ids += msg.token_ids
            out.text += msg.text
            out.finish_reason = msg.finish_reason or out.finish_reason
            seen += 1
            if cancel_after is not None and seen >= cancel_after and not msg.finish_reason:
                call.cancel()
                out.status = "CLIENT_CANCELLED"
                break
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
        out.error = exc.details() or ""
    out.seconds = time.monotonic() - start
    return out


def error_message(raw: str) -> str:
    """The message of a REST or OpenAI error body (the raw body when it is not one)."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw


def parse_sse(raw: str) -> list[tuple[str, dict]]:
    """(event, data) pairs of an SSE body; ``[DONE]`` is left out."""
    events = []
    for block in raw.split("\n\n"):
        kind, data = "message", None
        for line in block.splitlines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None and data != "[DONE]":
            events.append((kind, json.loads(data)))
    return events


async def rest_generate(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    timeout: float,
    close_after: int | None = None,
) -> Outcome:
    """POST /v1/generate (SSE when ``body['stream']``); with ``close_after`` the connection is
    dropped after that many events (a client going away mid-stream)."""
    start = time.monotonic()
    stream = bool(body.get("stream"))
    out = Outcome("rest-sse" if stream else "rest", 0)
    tmo = aiohttp.ClientTimeout(total=timeout)
    async with session.post(f"{url}/v1/generate", json=body, timeout=tmo) as resp:
        out.status = resp.status
        out.retry_after = resp.headers.get("Retry-After")
        if resp.status != 200:
            out.error = error_message(await resp.text())
        elif not stream:
            data = await resp.json()
            out.token_ids, out.text = data["token_ids"], data["text"]
            out.finish_reason = data["finish_reason"]
        else:
            seen = 0
            buf = ""
            async for chunk in resp.content.iter_any():
                buf += chunk.decode()
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    for kind, data in parse_sse(block + "\n\n"):
                        if kind == "error":
                            out.status = data["error"]["code"]
                            out.error = data["error"]["message"]
                            continue
                        out.token_ids += data.get("token_ids", [])
                        out.text += data.get("text", "")
                        out.finish_reason = data.get("finish_reason") or out.finish_reason
                        seen += 1
                if close_after is not None and seen >= close_after and not out.finish_reason:
                    resp.close()  # drop the connection: the gateway must cancel the request
                    out.status = "CLIENT_CLOSED"
                    break
    out.seconds = time.monotonic() - start
    return out


async def openai_completion(
    session: aiohttp.ClientSession, url: str, body: dict, timeout: float
) -> Outcome:
    """POST /v1/completions, streamed or not."""
    start = time.monotonic()
    stream = bool(body.get("stream"))
    out = Outcome("openai-sse" if stream else "openai", 0)
    tmo = aiohttp.ClientTimeout(total=timeout)
    async with session.post(f"{url}/v1/completions", json=body, timeout=tmo) as resp:
        out.status = resp.status
        out.retry_after = resp.headers.get("Retry-After")
        if resp.status != 200:
            out.error_body = await resp.text()
            out.error = error_message(out.error_body)
        elif not stream:
            data = await resp.json()
            out.text = data["choices"][0]["text"]
            out.finish_reason = data["choices"][0]["finish_reason"]
        else:
            for kind, data in parse_sse(await resp.text()):
                if kind == "error":
                    out.status = data["error"]["code"]
                    out.error = data["error"]["message"]
                elif data.get("choices"):
                    out.text += data["choices"][0]["text"]
                    out.finish_reason = data["choices"][0]["finish_reason"] or out.finish_reason
    out.seconds = time.monotonic() - start
    return out


def run(coro):
    """Run ``coro`` on a fresh event loop (the tests are plain sync functions)."""
    return asyncio.run(coro)
