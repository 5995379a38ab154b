"""A span receiver for the whole test run, and tracing in the test process itself (service
``test-client``) exporting to it."""

from __future__ import annotations

import os

import pytest

from dsmesh.runtime import telemetry
from tests.telemetry.otlp_receiver import OTLPReceiver


@pytest.fixture(scope="session")
def receiver():
    rx = OTLPReceiver()
    yield rx
    rx.stop()


@pytest.fixture(scope="module")
def client_tracing(receiver):
    """Tracing on in this process while the module runs. The environment is set only while
    the SDK reads it, so that processes other tests start do not inherit it."""
    saved = dict(os.environ)
    os.environ.update(receiver.exporter_env())
    try:
        assert telemetry.setup_tracing("test-client")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield
    telemetry.shutdown_tracing()
