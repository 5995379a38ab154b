"""Soak: 500 requests at concurrency 32 through one gateway (`dsmesh up`, default flags), mixing
gRPC, REST (JSON and SSE) and the OpenAI completions route, prompts of 1..300 tokens, outputs
of 1..48 tokens, and about 10% of requests given up by the client mid-stream (gRPC cancel,
dropped SSE connection, or the Abort RPC).

Checks: every request the client did not give up ends with "length" or "stop"; greedy outputs
equal the offline engine's and repeated prompts give identical outputs whatever the protocol
and the batch they landed in; no KV page is held afterwards; each service's RSS stays flat.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import aiohttp
import grpc
import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.reliability.soak_harness import (
    Outcome,
    grpc_generate,
    openai_completion,
    rest_generate,
    rss_all,
    run,
    shared_cache,
    start_up_mesh,
    wait_idle,
)

pytestmark = pytest.mark.timeout(240)

NUM_REQUESTS = 500
CONCURRENCY = 32
NUM_PROMPTS = 80  # distinct prompts: each is sent ~6 times, through different protocols
ABORT_SHARE = 0.10
REQUEST_TIMEOUT_S = 90.0  # per request: a hang fails the test instead of blocking it
OFFLINE_SAMPLE = 16  # distinct prompts checked against the offline engine
# RSS growth allowed per service between the end of warm-up and the end of the soak. A leak
# of one KV-sized or prompt-sized object per request (>= 100 KB) grows by >= 50 MB over 500
# requests; allocator noise after warm-up measured a few MB (docs/RELIABILITY.md).
RSS_GROWTH_LIMIT_MB = 48.0

PROTOCOLS = ("grpc", "rest", "rest-sse", "openai", "openai-sse")
TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;!?0123456789\nàéü€中文🙂"


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str | None  # text prompts go through the gateway's tokenizer
    ids: tuple[int, ...]  # the tokens the model sees (text prompts: encoded here)
    max_new_tokens: int


@dataclass(frozen=True)
class Job:
    number: int
    prompt: Prompt
    protocol: str
    abort: str | None  # None, "cancel" (gRPC), "close" (SSE), "abort-rpc"
    abort_after: int = 1


def make_prompts(rng: random.Random, tok: Tokenizer, vocab: int) -> list[Prompt]:
    prompts = []
    for i in range(NUM_PROMPTS):
        # lengths spread over 1..300: a third short, the rest up to the longest
        length = rng.choice([rng.randint(1, 8), rng.randint(9, 80), rng.randint(81, 300)])
        new = rng.choice([1, 2, rng.randint(3, 16), rng.randint(17, 48)])
        if i % 2:
            text = "".join(rng.choice(TEXT_ALPHABET) for _ in range(length))
            ids = tok.encode(text)
            while len(ids) > 300:
                text = text[: len(text) * 3 // 4]
                ids = tok.encode(text)
            prompts.append(Prompt(i, text, tuple(ids), new))
        else:
            ids = tuple(rng.randrange(vocab) for _ in range(length))
            prompts.append(Prompt(i, None, ids, new))
    return prompts


def make_jobs(rng: random.Random, prompts: list[Prompt], count: int) -> list[Job]:
    jobs = []
    for n in range(count):
        prompt = rng.choice(prompts)
        if rng.random() < ABORT_SHARE:
            kind = rng.choice(["cancel", "close", "abort-rpc"])
            protocol = "rest-sse" if kind == "close" else "grpc"
            jobs.append(Job(n, prompt, protocol, kind, abort_after=rng.randint(1, 3)))
        else:
            jobs.append(Job(n, prompt, rng.choice(PROTOCOLS), None))
    return jobs


async def run_job(
    job: Job,
    stub: generation_pb2_grpc.GenerationStub,
    session: aiohttp.ClientSession,
    url: str,
    model: str,
) -> Outcome:
    p = job.prompt
    # a request to give up must still be running when the client gives up
    new = 400 if job.abort else p.max_new_tokens
    ignore_eos = job.abort is not None
    rid = f"soak-{job.number}-{random.getrandbits(32):08x}"
    try:
        if job.protocol == "grpc":
            req = pb.GenerateRequest(
                request_id=rid,
                sampling=pb.SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos),
            )
            if p.text is not None:
                req.text = p.text
            else:
                req.input_ids.extend(p.ids)
            if job.abort == "abort-rpc":
                return await grpc_with_abort_rpc(stub, req, job.abort_after)
            cancel = job.abort_after if job.abort == "cancel" else None
            return await grpc_generate(stub, req, REQUEST_TIMEOUT_S, cancel_after=cancel)
        if job.protocol.startswith("rest"):
            body: dict = {
                "request_id": rid,
                "sampling": {"max_new_tokens": new, "ignore_eos": ignore_eos},
                "stream": job.protocol == "rest-sse",
            }
            if p.text is not None:
                body["text"] = p.text
            else:
                body["input_ids"] = list(p.ids)
            close = job.abort_after if job.abort == "close" else None
            return await rest_generate(session, url, body, REQUEST_TIMEOUT_S, close_after=close)
        body = {
            "model": model,
            "prompt": p.text if p.text is not None else list(p.ids),
            "max_tokens": new,
            "temperature": 0,
            "stream": job.protocol == "openai-sse",
        }
        return await openai_completion(session, url, body, REQUEST_TIMEOUT_S)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(job.protocol, "CLIENT_ERROR", error=repr(exc))


async def grpc_with_abort_rpc(
    stub: generation_pb2_grpc.GenerationStub, req: pb.GenerateRequest, after: int
) -> Outcome:
    """Stream, and after ``after`` messages ask the gateway to abort the request by id."""
    start = time.monotonic()
    out = Outcome("grpc-abort", "OK")
    seen = 0
    try:
        async for msg in stub.Generate(req, timeout=REQUEST_TIMEOUT_S):
            out.token_ids += msg.token_ids
            out.finish_reason = msg.finish_reason or out.finish_reason
            seen += 1
            if seen == after and not msg.finish_reason:
                resp = await stub.Abort(pb.AbortRequest(request_id=req.request_id), timeout=10)
                out.error = f"aborted={resp.aborted}"
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
        out.error = exc.details() or ""
    out.seconds = time.monotonic() - start
    return out


async def run_all(mesh, jobs: list[Job]) -> list[Outcome]:
    sem = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with (
        grpc.aio.insecure_channel(mesh.grpc_address) as channel,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(job: Job) -> Outcome:
            async with sem:
                return await run_job(job, stub, session, mesh.url, mesh.model_name)

        return await asyncio.gather(*(one(j) for j in jobs))


@pytest.fixture(scope="module")
def soak_mesh(tmp_path_factory):
    m = start_up_mesh(shared_cache(tmp_path_factory), tmp_path_factory.mktemp("soak-logs"))
    try:
        yield m
    finally:
        m.close()


GIVEN_UP = ("CLIENT_CANCELLED", "CLIENT_CLOSED")


def tally(jobs: list[Job], outcomes: list[Outcome]):
    """(unexplained failures, finished runs by prompt index, given-up counts by kind)."""
    failures, finished, gave_up = [], defaultdict(list), Counter()
    for job, out in zip(jobs, outcomes, strict=True):
        if job.abort is None:
            if out.status in (200, "OK") and out.finish_reason in ("length", "stop"):
                finished[job.prompt.index].append((job, out))
            else:
                failures.append((job, out))
        elif job.abort == "abort-rpc":
            # the Abort RPC ends the stream with finish_reason "abort"
            if out.status != "OK" or out.finish_reason != "abort":
                failures.append((job, out))
            gave_up[job.abort] += 1
        else:
            if out.status not in GIVEN_UP:
                failures.append((job, out))
            gave_up[job.abort] += 1
    return failures, finished, gave_up


def test_soak_500_mixed_requests(soak_mesh) -> None:
    mesh = soak_mesh
    tok = Tokenizer.from_dir(mesh.model_dir)
    vocab = json.loads((mesh.model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(20261129)
    prompts = make_prompts(rng, tok, vocab)

    # warm-up: every protocol, long and short prompts, at full concurrency
    warm_jobs = make_jobs(random.Random(7), prompts, 48)
    warm_failures, warm_finished, warm_gave_up = tally(warm_jobs, run(run_all(mesh, warm_jobs)))
    assert not warm_failures, warm_failures[:3]
    wait_idle(mesh.url)
    rss_start = rss_all(mesh.pids)

    jobs = make_jobs(rng, prompts, NUM_REQUESTS)
    begin = time.monotonic()
    outcomes = run(run_all(mesh, jobs))
    elapsed = time.monotonic() - begin
    after = wait_idle(mesh.url)
    rss_end = rss_all(mesh.pids)

    # -- every request accounted for, by the client and by the gateway ---------------------------
    failures, finished, gave_up = tally(jobs, outcomes)
    assert not failures, f"{len(failures)} unexplained failures, first: {failures[:3]}"
    assert sum(gave_up.values()) >= NUM_REQUESTS * ABORT_SHARE / 2
    outcome_metric = {
        k.split('"')[1]: v for k, v in after.items() if k.startswith("dsmesh_requests_total{")
    }
    num_finished = sum(map(len, finished.values())) + sum(map(len, warm_finished.values()))
    num_given_up = sum(gave_up.values()) + sum(warm_gave_up.values())
    ended = outcome_metric.get("length", 0) + outcome_metric.get("stop", 0)
    assert ended == num_finished, (outcome_metric, num_finished)
    assert sum(outcome_metric.values()) - ended == num_given_up, (outcome_metric, num_given_up)

    # -- greedy outputs: repeated prompts identical, and equal to the offline engine -----------
    for index, runs in finished.items():
        ids = {tuple(o.token_ids) for j, o in runs if not j.protocol.startswith("openai")}
        texts = {o.text for _, o in runs}
        assert len(ids) <= 1 and len(texts) == 1, (index, ids, texts)
    sample = sorted(finished)[:: max(1, len(finished) // OFFLINE_SAMPLE)][:OFFLINE_SAMPLE]
    engine = LLMEngine(EngineConfig(model=str(mesh.model_dir), max_total_tokens=1 << 14))
    by_index = {p.index: p for p in prompts}
    refs = engine.generate(
        [list(by_index[i].ids) for i in sample],
        [SamplingParams(max_new_tokens=by_index[i].max_new_tokens) for i in sample],
    )
    for index, ref in zip(sample, refs, strict=True):
        ref_text = tok.decode(ref.output_ids, skip_special_tokens=True)
        for job, out in finished[index]:
            if not job.protocol.startswith("openai"):
                assert out.token_ids == ref.output_ids, (index, job.protocol)
            assert out.text == ref_text, (index, job.protocol)

    # -- nothing leaked ------------------------------------------------------------------------
    assert after["dsmesh_kv_pages_used"] == 0, after
    assert after["dsmesh_requests_running"] == 0 and after["dsmesh_requests_waiting"] == 0
    growth = {name: rss_end[name] - rss_start[name] for name in rss_start}
    by_protocol = Counter(j.protocol if j.abort is None else f"gave-up:{j.abort}" for j in jobs)
    print(
        f"\nsoak: {NUM_REQUESTS} requests, concurrency {CONCURRENCY}, {elapsed:.1f}s "
        f"({NUM_REQUESTS / elapsed:.1f} req/s); {dict(by_protocol)}\n"
        f"soak: finished {sum(map(len, finished.values()))}, given up {dict(gave_up)}; "
        f"distinct prompts {len(finished)}, {len(sample)} checked offline\n"
        f"soak: kv pages used after {after['dsmesh_kv_pages_used']:.0f}; gateway outcomes "
        f"(warm-up included) {outcome_metric}\n"
        + "\n".join(
            f"soak: RSS {name:10s} {rss_start[name]:7.1f} -> {rss_end[name]:7.1f} MiB "
            f"({growth[name]:+.1f})"
            for name in sorted(rss_start)
        )
    )
    assert all(mesh.alive().values()), mesh.alive()
    grown = {n: g for n, g in growth.items() if g > RSS_GROWTH_LIMIT_MB}
    assert not grown, f"RSS grew by more than {RSS_GROWTH_LIMIT_MB} MiB: {grown}"
