"""dsmesh/bench/mesh_metrics.py reads each engine instance's /metrics URL from ``dsmesh up``'s
ready summary, the lines the supervisor prints (a real run: tests/bench/test_no_max_tokens.py)."""

from __future__ import annotations

from dsmesh.bench.mesh_metrics import instance_metrics_urls
from dsmesh.cli.main import build_parser
from dsmesh.cli.supervisor import instance_metrics_lines
from dsmesh.cli.up import mesh_config_from


def summary_lines(*argv: str) -> list[str]:
    """The ready summary's instance lines ``dsmesh up`` prints for these flags."""
    config = mesh_config_from(build_parser().parse_args(["up", "--model", "/m", *argv]))
    return instance_metrics_lines(config)


def test_each_instance_is_read_at_the_port_the_supervisor_lists() -> None:
    lines = summary_lines("--instance-metrics-port", "9100", "--unified", "1", "--ep-size", "2")
    assert instance_metrics_urls(lines) == {  # an EP instance's rank 0, then a port per rank
        "prefill-0": "http://127.0.0.1:9100/metrics",
        "decode-0": "http://127.0.0.1:9102/metrics",
        "unified-0": "http://127.0.0.1:9104/metrics",
    }
    unified = summary_lines("--instance-metrics-port", "9100", "--prefill", "0", "--decode", "0")
    assert instance_metrics_urls([*unified, *summary_lines("--unified", "2")]) == {}
    two = summary_lines(
        "--instance-metrics-port", "9200", "--prefill", "0", "--decode", "0", "--unified", "2"
    )
    assert instance_metrics_urls(two) == {
        "unified-0": "http://127.0.0.1:9200/metrics",
        "unified-1": "http://127.0.0.1:9201/metrics",
    }


def test_the_other_summary_lines_are_not_instances() -> None:
    """A whole summary as a CUDA mesh prints it: the gateway's metrics and the GPU lines are
    left out."""
    summary = """dsmesh mesh ready in 41.3s
  REST     http://127.0.0.1:8000
  OpenAI   http://127.0.0.1:8000/v1
  gRPC     127.0.0.1:50051
  metrics  http://127.0.0.1:8000/metrics
  broker   127.0.0.1:40001
  gpus     prefill-0    GPU 0        mem-fraction 0.425
           decode-0     GPU 0        mem-fraction 0.425
  metrics  prefill-0    http://127.0.0.1:9100/metrics
           decode-0     http://127.0.0.1:9101/metrics
  logs     /tmp/logs
Ctrl-C to stop."""
    assert instance_metrics_urls(summary.splitlines()) == {
        "prefill-0": "http://127.0.0.1:9100/metrics",
        "decode-0": "http://127.0.0.1:9101/metrics",
    }
