"""Workloads that reuse prefixes: the generators' shapes, the runner that resends a
conversation's history, and a tiny run against a loopback mesh whose prefix cache serves
what the workloads share."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsmesh.bench.backends import Backend
from dsmesh.bench.serving import BenchConfig, BenchRequest, run_benchmark, send_units, summarize
from dsmesh.bench.workloads import (
    MultiTurnConfig,
    SharedPrefixConfig,
    multi_turn_requests,
    shared_prefix_requests,
)
from dsmesh.cli.bench import configure, requests_from
from dsmesh.cli.main import main
from dsmesh.v1 import generation_pb2 as pb
from tests.gateway.kv_mesh import KVMesh, running_kv_mesh

# ---- generators ------------------------------------------------------------------------------


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    config = SharedPrefixConfig(3, 4, system_len=10, question_len=5, output_len=7)
    reqs = shared_prefix_requests(config, (3, 50), seed=1)
    assert len(reqs) == 12
    assert all(len(r.input_ids) == 15 and r.max_new_tokens == 7 for r in reqs)
    assert all(3 <= t < 50 for r in reqs for t in r.input_ids)
    groups: dict[tuple[int, ...], list[BenchRequest]] = {}
    for r in reqs:
        groups.setdefault(r.input_ids[:10], []).append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    assert len({r.input_ids for r in reqs}) == 12  # questions of their own
    # shuffled: a group's prompts are not all next to each other
    order = [list(groups).index(r.input_ids[:10]) for r in reqs]
    assert order != sorted(order)
    assert shared_prefix_requests(config, (3, 50), seed=1) == reqs
    assert shared_prefix_requests(config, (3, 50), seed=2) != reqs
    assert SharedPrefixConfig() == SharedPrefixConfig(64, 16, 4000, 200, 128)  # the target's
    with pytest.raises(ValueError, match="at least 1"):
        shared_prefix_requests(SharedPrefixConfig(num_groups=0))


def test_multi_turn_turns_hold_their_new_tokens_in_order() -> None:
    reqs = multi_turn_requests(MultiTurnConfig(2, 3, user_len=6, output_len=4), (3, 50))
    assert [(r.conversation, r.turn) for r in reqs] == [(c, t) for c in range(2) for t in range(3)]
    assert all(len(r.input_ids) == 6 and r.max_new_tokens == 4 for r in reqs)
    with pytest.raises(ValueError, match="at least 1"):
        multi_turn_requests(MultiTurnConfig(num_turns=0))


def test_send_units_group_conversations_by_turn() -> None:
    alone = BenchRequest((1,))
    turns = [BenchRequest((2,), conversation=c, turn=t) for c, t in ((5, 1), (7, 0), (5, 0))]
    assert send_units([alone, *turns, alone]) == [[0], [3, 1], [2], [4]]  # turn 0 first


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_cli_picks_the_workload() -> None:
    reqs = requests_from(
        parse(
            *("--workload", "shared-prefix", "--gsp-groups", "2", "--gsp-prompts-per-group"),
            *("3", "--gsp-system-len", "8", "--gsp-question-len", "2", "--gsp-output-len", "5"),
        )
    )
    assert reqs == shared_prefix_requests(SharedPrefixConfig(2, 3, 8, 2, 5))
    args = parse("--workload", "multi-turn", "--mt-conversations", "2", "--mt-turns", "2")
    assert requests_from(args) == multi_turn_requests(MultiTurnConfig(2, 2))
    with pytest.raises(ValueError, match="do not apply"):
        requests_from(parse("--workload", "multi-turn", "--num-prompts", "3"))


# ---- the runner ------------------------------------------------------------------------------


class EchoBackend(Backend):
    """Answers each request with tokens 900, 901, ... and reports a fake cached count: the
    prompt's length less 1, rounded down to 4."""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def connect(self, timeout_s: float) -> None:
        pass

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.prompts.append(tuple(request.input_ids))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        n = request.sampling.max_new_tokens
        msg = pb.GenerateResponse(token_ids=range(900, 900 + n), finish_reason="length")
        msg.usage.prompt_tokens = len(request.input_ids)
        msg.usage.cached_tokens = (len(request.input_ids) - 1) // 4 * 4
        yield msg

    async def close(self) -> None:
        pass


def test_a_conversation_resends_its_history_turn_after_turn() -> None:
    reqs = multi_turn_requests(MultiTurnConfig(3, 3, user_len=5, output_len=2), (3, 50))
    backend = EchoBackend()
    run = asyncio.run(run_benchmark(BenchConfig(warmup=0), reqs, backend=backend))
    by_prompt = dict(zip(backend.prompts, range(len(backend.prompts)), strict=True))
    for conv in range(3):
        user = [reqs[conv * 3 + t].input_ids for t in range(3)]
        expected = [
            user[0],
            user[0] + (900, 901) + user[1],
            user[0] + (900, 901) + user[1] + (900, 901) + user[2],
        ]
        sent = [by_prompt[p] for p in expected]  # each was sent, in turn order
        assert sent == sorted(sent)
        records = run.records[conv * 3 : conv * 3 + 3]
        assert [r.prompt_tokens for r in records] == [5, 12, 19]
        assert [r.cached_tokens for r in records] == [4, 8, 16]
    assert backend.most_in_flight == 3  # the conversations run side by side
    s = summarize(run.records, run.duration_s)
    assert s.total_cached_tokens == 3 * 28
    assert s.mean_cached_tokens == pytest.approx(28 / 3)
    assert s.cache_hit_rate == pytest.approx(28 / 36)


# ---- against a mesh --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVMesh]:
    with running_kv_mesh(
        1, tmp_path_factory.mktemp("bench-cache"), tmp_path_factory.mktemp("bench-logs")
    ) as m:
        yield m


def bench_json(mesh: KVMesh, out: Path, *args: str) -> dict:
    rc = main(
        [
            *("bench", "--no-progress", "--backend", "grpc", "--grpc-addr", mesh.grpc_address),
            *("--max-concurrency", "1", "--json", str(out), "--json-details", *args),
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_shared_prefix_run_reports_cached_tokens(
    mesh: KVMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = bench_json(
        mesh,
        tmp_path / "gsp.json",
        *("--workload", "shared-prefix", "--gsp-groups", "2", "--gsp-prompts-per-group", "3"),
        *("--gsp-system-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "4"),
    )
    assert "Mean cached tokens per request:" in capsys.readouterr().out
    s, records = result["summary"], result["requests"]
    assert (s["completed"], s["total_input_tokens"]) == (6, 6 * 72)
    # one at a time: each group's first prompt computes its 64-token system prompt (4 pages
    # of 16), the other two find it cached
    assert sorted(r["cached_tokens"] for r in records) == [0, 0, 64, 64, 64, 64]
    assert s["total_cached_tokens"] == 256 and s["mean_cached_tokens"] == pytest.approx(256 / 6)
    assert s["cache_hit_rate"] == pytest.approx(256 / 432)


@pytest.mark.timeout(300)
def test_multi_turn_run_hits_the_history(mesh: KVMesh, tmp_path: Path) -> None:
    result = bench_json(
        mesh,
        tmp_path / "mt.json",
        *("--workload", "multi-turn", "--mt-conversations", "2", "--mt-turns", "3"),
        *("--mt-user-len", "20", "--mt-output-len", "12"),
    )
    records = result["requests"]
    assert [r["prompt_tokens"] for r in records] == [20, 52, 84] * 2
    # turn 1 finds turn 0's 31 computed tokens (1 full page), turn 2 turn 1's 63 (3 pages)
    assert [r["cached_tokens"] for r in records] == [0, 16, 48] * 2
