"""Through the gateway: one REST request is one trace rooted at the gateway, with spans
from dsmesh.gateway, prefill, kv-broker and decode, and no orphans."""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from tests.gateway.conftest import wait_http_ok
from tests.telemetry.otlp_receiver import orphans, roots

pytestmark = pytest.mark.timeout(180)
SERVICES = {"gateway", "prefill", "decode", "kv-broker"}


def test_rest_request_is_one_trace_across_four_services(receiver, tmp_path_factory) -> None:
    cache = os.environ.get("DSMESH_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    logs = tmp_path_factory.mktemp("logs")
    from dsmesh.engine.model.tiny_model import default_model_dir

    default_model_dir(cache_dir=cache)
    env = {"DSMESH_CACHE_DIR": cache, **receiver.exporter_env()}
    started: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        started.append(broker)
        common = ["--broker", broker.address]
        with ThreadPoolExecutor(2) as pool:
            procs = list(
                pool.map(
                    lambda spec: start_service(spec[0], spec[1], env, logs),
                    [
                        ("prefill", dsmesh_command("prefill", *common)),
                        ("decode", dsmesh_command("decode", *common)),
                    ],
                )
            )
        started += procs
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            http_port = s.getsockname()[1]
        started.append(
            start_service(
                "gateway",
                dsmesh_command(
                    "gateway", *common, "--grpc-port", "0", "--http-port", str(http_port)
                ),
                env=env,
                log_dir=logs,
            )
        )
        url = f"http://127.0.0.1:{http_port}"
        wait_http_ok(f"{url}/health", 60)
        body = json.dumps(
            {
                "request_id": "traced-gw",
                "input_ids": [4, 5, 6],
                "sampling": {"max_new_tokens": 4, "ignore_eos": True},
            }
        ).encode()
        req = urllib.request.Request(f"{url}/v1/generate", data=body)
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert len(json.loads(resp.read())["token_ids"]) == 4

        def gateway_root():
            spans = [
                s
                for s in receiver.spans()
                if s.name == "gateway.request"
                and s.attributes.get("dsmesh.request_id") == "traced-gw"
            ]
            return spans[0].trace_id if spans else None

        def complete(spans) -> bool:
            return (
                {s.service for s in spans} >= SERVICES
                and not orphans(spans)
                and any(s.name == "decode.generate" for s in spans)
            )

        trace_id = None
        for _ in range(300):
            trace_id = gateway_root()
            if trace_id:
                break
            import time

            time.sleep(0.05)
        assert trace_id, "no gateway.request span arrived"
        spans = receiver.wait_for(trace_id, complete, timeout=15)
        assert {s.service for s in spans} >= SERVICES
        assert not orphans(spans), [(o.service, o.name, o.attributes) for o in orphans(spans)] + [
            (s.service, s.name) for s in spans if s.service == "gateway"
        ]
        assert [(r.service, r.name) for r in roots(spans)] == [("gateway", "gateway.request")]
        tagged = {
            s.trace_id
            for s in receiver.spans()
            if s.attributes.get("dsmesh.request_id") == "traced-gw"
        }
        assert tagged == {trace_id}
    finally:
        for proc in reversed(started):
            proc.stop()
