"""The MTP draft layer: weights, forward against transformers, and speculative decoding.

Greedy speculative decoding must give exactly the tokens of plain greedy decoding (and
transformers'); sampled speculative decoding must draw from exactly the target distribution.
The tiny checkpoints carry one random MTP layer (tests/engine/hf_checkpoints.py:
``add_mtp_layer``); on a 4-token vocabulary its drafts agree with the target often enough to
exercise acceptance, rejection and the roll-back of rejected positions.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.mtp import build_mtp
from dsmesh.engine.model.mtp_weights import load_mtp_weights, mtp_state_dict
from dsmesh.engine.model.weights import WeightError
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.speculative.acceptance import accept_greedy, accept_greedy_rows, sampling_probs
from dsmesh.engine.speculative.mtp_graph import MTPGraphRunner
from tests.engine.hf_checkpoints import (
    HFCheckpoint,
    copy_checkpoint,
    random_prompts,
    relative_error,
)

PAGE = 8


def _engine(ckpt: HFCheckpoint, k: int | None, **overrides) -> LLMEngine:
    fields = {
        "model": str(ckpt.path),
        "page_size": PAGE,
        "max_total_tokens": 4096,
        "speculative": None if k is None else "mtp",
        "num_draft_tokens": k or 1,
    }
    return LLMEngine(EngineConfig(**{**fields, **overrides}))


def _draft(ckpt: HFCheckpoint):
    cfg = load_config(ckpt.path)
    draft = build_mtp(cfg, torch.float32, "cpu")
    load_mtp_weights(draft, ckpt.path)
    return draft


# ---- the module ---------------------------------------------------------------------------


def test_mtp_weights_load_every_tensor_and_name_a_missing_one(
    v3_mtp_ckpt: HFCheckpoint, tmp_path
) -> None:
    from safetensors.torch import load_file, save_file

    draft = _draft(v3_mtp_ckpt)
    on_disk = load_file(str(v3_mtp_ckpt.path / "mtp.safetensors"))
    loaded = mtp_state_dict(draft)
    assert set(loaded) == set(on_disk) - {
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.shared_head.head.weight",
    }
    for name, tensor in loaded.items():
        assert torch.equal(tensor, on_disk[name]), name
    assert any(".mlp.experts.7.down_proj" in n for n in loaded)  # the MoE layer, all experts

    path = copy_checkpoint(v3_mtp_ckpt.path, tmp_path / "ckpt")
    del on_disk["model.layers.3.eh_proj.weight"]
    save_file(on_disk, str(path / "mtp.safetensors"))
    with pytest.raises(WeightError, match=r"model\.layers\.3\.eh_proj\.weight"):
        _draft(HFCheckpoint(v3_mtp_ckpt.hf_model, path))


def test_mtp_forward_matches_transformers_layer(v3_mtp_ckpt: HFCheckpoint) -> None:
    """The draft's logits equal a transformers DeepSeek-V3 of one MoE layer holding the MTP
    decoder layer, its final norm = shared_head.norm and its head = the main LM head, fed
    eh_proj(cat[enorm(embed(x[p + 1])), hnorm(h[p])]) with h the main model's final-normed
    hidden states: the MTP forward of DeepSeek-V3's reference implementations."""
    model = load_model(v3_mtp_ckpt.path)
    draft = _draft(v3_mtp_ckpt)
    draft.share_with(model)
    cfg = model.config
    tokens = random_prompts([41], cfg.vocab_size, seed=9)[0]  # x[0 .. 40]
    n = len(tokens) - 1
    pool = MLAKVPool(cfg.num_hidden_layers + 1, 16, PAGE, cfg.mla.kv_cache_dim, torch.float32)
    table = torch.tensor(pool.allocator.allocate(pages_for(n, PAGE)))
    target = ForwardBatch.build([SequenceChunk(tokens[:n], 0, table)], PAGE, "cpu")
    hidden = model.hidden_states(target, pool)  # h[0 .. n-1]
    # chunked like a prefill (two chunks) and then one decode row, to cover both paths
    outs = []
    for start, end in ((0, 17), (17, n - 1), (n - 1, n)):
        batch = ForwardBatch.build(
            [SequenceChunk(tokens[start + 1 : end + 1], start, table)], PAGE, "cpu"
        )
        outs.append(draft(batch, pool, hidden[start:end])[1])
    ours = torch.cat(outs)

    hf_cfg = DeepseekV3Config(
        **{**v3_mtp_ckpt.hf_model.config.to_dict(), "num_hidden_layers": 1},
    )
    hf_cfg.first_k_dense_replace = 0
    ref_model = DeepseekV3ForCausalLM(hf_cfg).eval()
    mtp = draft.layers[0]
    layer_state = {
        k: v
        for k, v in mtp.state_dict().items()
        if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "mlp.experts"))
    }
    # transformers 5 stacks the experts as dsmesh does: gate rows then up rows
    layer_state["mlp.experts.gate_up_proj"] = mtp.mlp.experts.w13
    layer_state["mlp.experts.down_proj"] = mtp.mlp.experts.w2
    missing = ref_model.model.layers[0].load_state_dict(layer_state, strict=False)
    assert not [m for m in missing.missing_keys if "rotary" not in m], missing
    assert not missing.unexpected_keys, missing
    with torch.no_grad():
        ref_model.model.norm.weight.copy_(mtp.shared_head.norm.weight)
        ref_model.lm_head.weight.copy_(model.lm_head.weight)
        emb = model.model.embed_tokens(torch.tensor(tokens[1 : n + 1]))
        x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(hidden)], dim=-1))
        ref = ref_model(inputs_embeds=x[None], use_cache=False).logits[0].float()
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) <= 1e-4


# ---- greedy speculative decoding ----------------------------------------------------------


def _hf_greedy(ckpt: HFCheckpoint, prompt: list[int], max_new: int) -> list[int]:
    eos = ckpt.hf_model.config.eos_token_id
    out = ckpt.hf_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, pad_token_id=eos
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("ckpt_name", "k"),
    [("v3_mtp_small_vocab_ckpt", 1), ("v3_mtp_small_vocab_ckpt", 2),
     ("v3_mtp_small_vocab_ckpt", 3), ("v3_mtp_ckpt", 2)],
)  # fmt: skip
def test_greedy_speculative_equals_plain_and_transformers(
    request: pytest.FixtureRequest, ckpt_name: str, k: int
) -> None:
    ckpt: HFCheckpoint = request.getfixturevalue(ckpt_name)
    vocab = ckpt.hf_model.config.vocab_size
    prompts = random_prompts([1, 6, 19, 40], vocab, seed=k)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = _engine(ckpt, None).generate(prompts, params)
    engine = _engine(ckpt, k)
    spec = engine.generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    for prompt, res in zip(prompts, spec, strict=True):
        ref = _hf_greedy(ckpt, prompt, 24)
        assert res.output_ids[: len(ref)] == ref
    stats = engine.spec_stats
    assert stats is not None and stats.num_draft_tokens > 0
    assert sum(r.spec_draft_tokens for r in spec) == stats.num_draft_tokens
    assert sum(r.spec_accepted_tokens for r in spec) == stats.num_accepted_tokens
    assert sum(stats.accepted_histogram) == stats.num_verifications
    assert len(stats.accepted_histogram) == k + 1
    if vocab == 4:  # the drafts agree often: acceptance, multi-token steps, roll-back
        assert stats.num_accepted_tokens > 0
    assert engine.num_pages_in_use == 0


def test_stop_tokens_and_max_tokens_cut_inside_an_accepted_run(
    v3_mtp_small_vocab_ckpt: HFCheckpoint,
) -> None:
    ckpt = v3_mtp_small_vocab_ckpt
    prompts = random_prompts([3, 9, 14, 30], 4, seed=11)
    cases = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 5, 7)]
    free = _engine(ckpt, None).generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    token = free[0].output_ids[4]  # a token the outputs reach after a few steps
    stop = [SamplingParams(max_new_tokens=30, stop_token_ids=(token,), ignore_eos=True)] * 4
    eos = [SamplingParams(max_new_tokens=30)] * 4
    for params in (cases, stop, eos):
        want = _engine(ckpt, None).generate(prompts, params)
        engine = _engine(ckpt, 3)
        got = engine.generate(prompts, params)
        assert [(r.output_ids, r.finish_reason) for r in got] == [
            (r.output_ids, r.finish_reason) for r in want
        ]
        assert engine.num_pages_in_use == 0
        if params is stop:  # it really stops early
            assert any(r.finish_reason == "stop" and len(r.output_ids) < 30 for r in got)


def test_no_page_leaks_with_aborts_mid_run_and_retraction(
    v3_mtp_small_vocab_ckpt: HFCheckpoint,
) -> None:
    # a pool so small that the decode steps' lookahead pages force retractions
    engine = _engine(v3_mtp_small_vocab_ckpt, 3, max_total_tokens=160, prefix_cache=True)
    _abort_two_mid_run(v3_mtp_small_vocab_ckpt, engine)


def _abort_two_mid_run(ckpt: HFCheckpoint, engine: LLMEngine) -> None:
    """Six requests of 40 tokens; two abort after the sixth step. The pool was too small
    (retractions), every page comes back, and the survivors' output equals plain decoding's,
    each token streamed once."""
    prompts = random_prompts([5, 12, 21, 30, 7, 16], 4, seed=12)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == 6:
            assert engine.abort(ids[1]) and engine.abort(ids[4])
    assert engine.num_pages_in_use == 0
    assert engine.stats.num_retractions > 0
    want = _engine(ckpt, None).generate([prompts[i] for i in (0, 2, 3, 5)], params)
    for i, res in zip((0, 2, 3, 5), want, strict=True):
        assert outputs[ids[i]] == res.output_ids


# ---- sampling: the target distribution, exactly -------------------------------------------


def _exact_distribution(ckpt: HFCheckpoint, prompt: list[int], n: int, params) -> torch.Tensor:
    """P(t1 .. tn | prompt) [4 ** n] under the sampler's transform of the target's logits."""
    model = load_model(ckpt.path)
    cfg = model.config
    probs = torch.ones(1)
    for length in range(n):
        prefixes = list(itertools.product(range(4), repeat=length))
        seqs = [prompt + list(p) for p in prefixes]
        pool = MLAKVPool(cfg.num_hidden_layers, 256, PAGE, cfg.mla.kv_cache_dim, torch.float32)
        chunks = [
            SequenceChunk(s, 0, torch.tensor(pool.allocator.allocate(pages_for(len(s), PAGE))))
            for s in seqs
        ]
        logits = model(ForwardBatch.build(chunks, PAGE, "cpu"), pool)
        step = sampling_probs(logits, [params] * len(seqs)).double()  # [4 ** length, 4]
        probs = (probs[:, None] * step).reshape(-1)
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.9, max_new_tokens=3, ignore_eos=True),
    ],
    ids=["t1", "t0.7-topk3-topp0.9"],
)
def test_sampled_speculative_decoding_follows_the_target_distribution(
    v3_mtp_small_vocab_ckpt: HFCheckpoint, params: SamplingParams
) -> None:
    """2000 seeded requests of 3 tokens with K = 2: a chi-square test of the joint
    distribution of the 3 tokens (64 cells) against the exact target distribution."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompt = [2, 3, 0, 1, 3]
    num = 2000
    engine = _engine(
        ckpt,
        2,
        max_total_tokens=num * 16,
        max_running_requests=num,
        max_batch_tokens=num * 8,
        speculative_max_batch=num,
    )
    per = [dataclasses.replace(params, seed=s) for s in range(num)]
    results = engine.generate([prompt] * num, per)
    stats = engine.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections too
    counts = torch.zeros(4**3, dtype=torch.float64)
    for r in results:
        assert len(r.output_ids) == 3
        counts[sum(t * 4 ** (2 - i) for i, t in enumerate(r.output_ids))] += 1
    expected = _exact_distribution(ckpt, prompt, 3, params) * num
    assert not bool(((expected == 0) & (counts > 0)).any())  # filtered tokens never appear
    # merge cells expected below 5 into one, as the chi-square approximation asks
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    # chi-square survival function: the regularized upper incomplete gamma Q(dof / 2, stat / 2)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    assert p_value > 1e-3, (stat, dof, p_value)
    assert math.isfinite(stat)


def test_instance_metrics_export_the_speculation_counters(
    v3_mtp_small_vocab_ckpt: HFCheckpoint,
) -> None:
    """Prometheus text format of an instance whose engine speculates: drafts, accepted
    drafts and the acceptance-length histogram equal the engine's own counters."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dsmesh.instance.metrics import InstanceMetrics

    engine = _engine(v3_mtp_small_vocab_ckpt, 2)
    metrics = InstanceMetrics(engine, "unified")
    prompts = random_prompts([1, 6, 19, 40], 4, seed=2)
    engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    text = generate_latest(metrics.registry).decode()
    got = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("role") == "unified"
    }
    stats = engine.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0
    assert got[("dsmesh_spec_draft_tokens_total", None)] == stats.num_draft_tokens
    assert got[("dsmesh_spec_accepted_tokens_total", None)] == stats.num_accepted_tokens
    counts = [got[("dsmesh_spec_acceptance_length_bucket", f"{a + 1}.0")] for a in range(3)]
    assert counts == list(itertools.accumulate(stats.accepted_histogram))
    assert got[("dsmesh_spec_acceptance_length_count", None)] == stats.num_verifications
    emitted = got[("dsmesh_spec_acceptance_length_sum", None)]
    assert emitted / stats.num_verifications == stats.mean_acceptance_length
    plain = InstanceMetrics(_engine(v3_mtp_small_vocab_ckpt, None), "unified")
    assert b"dsmesh_spec" not in generate_latest(plain.registry)


def test_prefill_only_requests_write_the_prompts_draft_kv(
    v3_mtp_small_vocab_ckpt: HFCheckpoint,
) -> None:
    """A prefill instance's request ends at its first token, yet the MTP layer still runs
    over its prompt: the draft layer's KV of every prompt position (what crosses the PD
    handoff with the pages) equals the offline engine's after the same prefill."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompt = random_prompts([23], 4, seed=4)[0]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    draft_kv = []
    for prefill_only in (True, False):
        engine = _engine(ckpt, 2)
        rid = engine.add_request(prompt, params, prefill_only=prefill_only)
        engine.step()  # the whole prompt in one chunk, then the MTP over it
        req = engine.requests[rid]
        slots = torch.tensor([req.pages[p // PAGE] * PAGE + p % PAGE for p in range(len(prompt))])
        pool = engine.kv_pool
        draft_layer = pool.num_layers - 1  # the MTP layer's KV: the pool's last layer
        draft_kv.append(pool.read(draft_layer, slots).clone())
    assert bool(draft_kv[0].abs().sum() > 0)
    torch.testing.assert_close(draft_kv[0], draft_kv[1])


@pytest.mark.parametrize("k", [1, 2])
def test_prefills_drafts_cross_the_handoff_and_decodes_first_step_verifies_them(
    v3_mtp_small_vocab_ckpt: HFCheckpoint, k: int
) -> None:
    """The engine halves of PD in one process: a prefill-only engine drafts after the first
    token as the offline engine does after a prompt; its pages (the MTP layer's KV among
    them) and its drafts go to a decode engine, whose first step verifies those drafts.
    Tokens and each request's (drafted, accepted) counts equal the offline engine's. A
    sampled request hands over no drafts (their q stays on prefill): it drafts from its
    first decode step on."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompts = random_prompts([1, 6, 19, 40], 4, seed=5)
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=1)
    params = [greedy, greedy, greedy, sampled]
    offline = _engine(ckpt, k).generate(prompts, params)
    prefill, decode = _engine(ckpt, k), _engine(ckpt, k)
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        rid = f"r{i}"
        reserved = decode.reserve(prompt, sp, rid)
        prefill.add_request(prompt, sp, request_id=rid, prefill_only=True)
        first = [o for o in prefill.step() if o.request_id == rid][0]
        assert first.finish_reason == "prefilled"
        drafts = prefill.handoff_drafts(rid)
        assert len(drafts) == (k if sp is greedy else 0)
        src = prefill.requests[rid]
        for p in range(pages_for(len(prompt), PAGE)):  # every layer of each prompt page
            decode.kv_pool.buffer[:, reserved.pages[p]] = prefill.kv_pool.buffer[:, src.pages[p]]
        prefill.release(rid)
        tokens = list(decode.activate(rid, first.new_token_ids[0], None, drafts).new_token_ids)
        step = 0
        while rid in decode.requests:
            for out in decode.step():
                tokens += out.new_token_ids
                step += 1
                if step == 1:  # the first step verified prefill's drafts
                    assert out.spec_counts is not None and out.spec_counts[0] == len(drafts)
        req = reserved
        assert tokens == req.output_ids
        if sp is greedy:
            assert tokens == offline[i].output_ids
            counts = (offline[i].spec_draft_tokens, offline[i].spec_accepted_tokens)
            assert (req.num_spec_draft_tokens, req.num_spec_accepted_tokens) == counts
    assert prefill.num_pages_in_use == 0 and decode.num_pages_in_use == 0


# ---- speculative steps on the graph runners (dsmesh/engine/speculative/graphs.py)
# ------------------------
#
# On CPU the runners run their forwards uncaptured over the same fixed buffers, so these tests
# check the captured path's logic: verify and draft rows padded to buckets, greedy acceptance
# and the chained drafts' positions on the device, one host sync per step. On a GPU the same
# scenarios replay real graphs (needs_cuda below).

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _on_runners(engine: LLMEngine, max_rows: int, host_chain: bool = False) -> LLMEngine:
    """The CUDA path's runners, uncaptured, for a CPU engine (which has none). With
    ``host_chain`` the decode backend claims to plan on the host, as FlashInfer does: the
    chained drafts then run after the step's sync, fed from the host."""
    engine.graph_runner = CudaGraphRunner(
        engine.model, engine.kv_pool, max_batch=max_rows, max_tokens_per_request=512,
        use_graphs=False,
    )  # fmt: skip
    if host_chain:
        engine.model.decode_backend.plans_on_host = True  # the draft shares the backend
    assert engine.speculator is not None
    engine.speculator.attach_graphs(engine.graph_runner)
    return engine


def test_accept_greedy_rows_equals_accept_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    k = 3
    for _ in range(50):
        num_drafts = torch.randint(0, k + 1, (6,), generator=gen)
        first = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
        rows = int((num_drafts + 1).sum())
        fed = torch.randint(0, 3, (rows,), generator=gen)
        target = torch.randint(0, 3, (rows,), generator=gen)
        got = accept_greedy_rows(fed, target, first, num_drafts, k).tolist()
        want = []
        for f, d in zip(first.tolist(), num_drafts.tolist(), strict=True):
            want.append(accept_greedy(fed[f + 1 : f + 1 + d].tolist(), target[f : f + d].tolist()))
        assert got == want


def test_draft_runner_equals_the_eager_draft_in_padded_buckets(
    v3_mtp_small_vocab_ckpt: HFCheckpoint,
) -> None:
    """Five draft rows in a bucket of 8 (three padding rows): host-loaded rows, the rows the
    model's runner loaded (fed ids from the device) and rows placed on the device all give
    the eager draft's outputs; the padding writes nothing outside the rows' pages."""
    ckpt = v3_mtp_small_vocab_ckpt
    model = load_model(ckpt.path)
    draft = _draft(ckpt)
    draft.share_with(model)
    cfg = model.config
    pool = MLAKVPool(cfg.num_hidden_layers + 1, 32, PAGE, cfg.mla.kv_cache_dim, torch.float32)
    pool.allocator.allocate(4)  # pages others own: never written
    prompts = random_prompts([3, 9, 14, 20, 30], 4, seed=3)
    pages = [pool.allocator.allocate(pages_for(len(p) + 2, PAGE)) for p in prompts]
    chunks = [SequenceChunk(p, 0, torch.tensor(pg)) for p, pg in zip(prompts, pages, strict=True)]
    hidden = model.hidden_states(ForwardBatch.build(chunks, PAGE, "cpu"), pool)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    h = hidden.index_select(0, last)  # h[p] of each prompt's last position p
    ids = [1, 3, 0, 2, 1]
    positions = [len(p) for p in prompts]  # drafting the position after each prompt
    rows = zip(ids, positions, pages, strict=True)
    seqs = [SequenceChunk([t], n, torch.tensor(pg)) for t, n, pg in rows]
    want_g, want = draft(ForwardBatch.build(seqs, PAGE, "cpu"), pool, h)
    before = pool.buffer.clone()

    target = CudaGraphRunner(model, pool, max_batch=8, max_tokens_per_request=64, use_graphs=False)
    runner = MTPGraphRunner(draft, target)
    arrays = [torch.tensor(pg).numpy() for pg in pages]
    g, logits = runner.run(ids, positions, arrays, h)
    assert runner.keys_used == {(8, 4)}  # 5 rows -> bucket 8; 31 tokens -> 4 pages
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.buffer[:, :4], before[:, :4])
    target.run([0] * 5, positions, arrays)  # the model's rows; the draft reuses them
    got = runner.run_loaded(torch.tensor(ids), h)[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    p = runner.load_pages(arrays, max(positions) + 1)
    placed = runner.run_placed(p, torch.tensor(positions), torch.tensor(ids), h, 0)[1]
    torch.testing.assert_close(placed, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.buffer[:, :4], before[:, :4])
    assert runner.num_eager == 3 and runner.num_replays == 0


@pytest.mark.parametrize(
    ("k", "host_chain"), [(1, False), (2, False), (3, False), (3, True)],
    ids=["k1", "k2", "k3", "k3-host-chain"],
)  # fmt: skip
def test_greedy_speculative_on_the_runners_equals_plain_and_transformers(
    v3_mtp_small_vocab_ckpt: HFCheckpoint, k: int, host_chain: bool
) -> None:
    """Greedy steps resolved on the device (the one-sync path) give plain decoding's tokens
    and transformers', and exactly the eager speculative engine's drafts and acceptance. With
    the benchmark's forced acceptance (multi-token runs and roll-backs whatever the drafts)
    the tokens, which then depend on every draft fed, equal the eager engine's too."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompts = random_prompts([1, 6, 19, 40], 4, seed=k)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = _engine(ckpt, None).generate(prompts, params)
    for forced in (None, 0.7):
        eager = _engine(ckpt, k, spec_forced_acceptance=forced)
        want = eager.generate(prompts, params)
        engine = _on_runners(
            _engine(ckpt, k, spec_forced_acceptance=forced), 4 * (k + 1), host_chain
        )
        got = engine.generate(prompts, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert engine.spec_stats == eager.spec_stats
        if forced is None:
            assert [r.output_ids for r in got] == [r.output_ids for r in plain]
            for prompt, res in zip(prompts, got, strict=True):
                ref = _hf_greedy(ckpt, prompt, 24)
                assert res.output_ids[: len(ref)] == ref
        else:
            assert engine.spec_stats is not None
            assert engine.spec_stats.accepted_histogram[k] > 0  # whole runs accepted
        graphs = engine.speculator.graphs
        assert graphs is not None  # no fallback to the eager path
        assert graphs.target.num_eager > 10 and graphs.draft.num_eager > 10
        # rows of 4 requests x (1 + drafts): padded buckets
        assert len({b for b, _ in graphs.target.keys_used}) >= 2
        assert engine.num_pages_in_use == 0


def _tokens_and_logprobs(engine: LLMEngine, prompts, per) -> list[tuple[list[int], list]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
    out: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
    return [out[i] for i in ids]


def test_sampled_and_greedy_requests_on_the_runners_equal_the_eager_engine(
    v3_mtp_small_vocab_ckpt: HFCheckpoint,
) -> None:
    """Steps with sampled requests (rejection sampling) or logprobs replay the same runners
    and choose on the host: the seeded tokens, the logprobs and the counters equal the eager
    speculative engine's."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompts = random_prompts([1, 6, 19, 40, 3, 12], 4, seed=6)
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    per = [greedy, dataclasses.replace(greedy, logprobs=2)] + [
        SamplingParams(temperature=0.9, top_k=3, seed=i, max_new_tokens=20, ignore_eos=True)
        for i in range(4)
    ]
    eager = _engine(ckpt, 2)
    want = _tokens_and_logprobs(eager, prompts, per)
    engine = _on_runners(_engine(ckpt, 2), 6 * 3)
    got = _tokens_and_logprobs(engine, prompts, per)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert len(got[1][1]) == 20
    for (_, lps), (_, ref) in zip(got, want, strict=True):
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in ref]
        for lp, r in zip(lps, ref, strict=True):
            assert lp.logprob == pytest.approx(r.logprob, abs=1e-5)
    assert engine.spec_stats == eager.spec_stats
    graphs = engine.speculator.graphs
    assert graphs is not None and graphs.target.num_eager > 5 and graphs.draft.num_eager > 5
    assert engine.num_pages_in_use == 0


@pytest.mark.parametrize("host_chain", [False, True], ids=["device-chain", "host-chain"])
def test_runners_with_aborts_and_retractions_leak_no_page(
    v3_mtp_small_vocab_ckpt: HFCheckpoint, host_chain: bool
) -> None:
    """A pool so small that chains get clamped into short pages, steps fall back to the
    host's chain and requests are retracted; two requests abort mid-run. The survivors'
    tokens are plain decoding's and every page comes back."""
    engine = _engine(v3_mtp_small_vocab_ckpt, 3, max_total_tokens=160, prefix_cache=True)
    _on_runners(engine, 6 * 4, host_chain)
    _abort_two_mid_run(v3_mtp_small_vocab_ckpt, engine)
    assert engine.speculator is not None and engine.speculator.graphs is not None


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("k", "host_chain", "tbo"),
    [(1, False, False), (2, False, False), (3, False, False), (3, True, False),
     (1, False, True), (2, False, True)],
    ids=["k1", "k2", "k3", "k3-host-chain", "k1-tbo", "k2-tbo"],
)  # fmt: skip
def test_captured_speculative_decoding_equals_eager_speculative_decoding(
    v3_mtp_small_vocab_ckpt: HFCheckpoint, k: int, host_chain: bool, tbo: bool
) -> None:
    """Real graphs (float32: torch attention, masked experts): verify and draft replays give
    the eager speculative engine's greedy tokens, plain decoding's and, under forced
    acceptance, the eager engine's tokens and counters. With ``tbo`` the verify graphs hold
    both micro-batches, and the eager engine splits its forwards the same way."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompts = random_prompts([1, 6, 19, 40, 9, 27, 3], 4, seed=k)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    cuda = {"device": "cuda", "dtype": "float32"}
    plain = _engine(ckpt, None, **cuda).generate(prompts, params)
    for forced in (None, 0.7):
        eager = _engine(ckpt, k, cuda_graphs=False, spec_forced_acceptance=forced, tbo=tbo, **cuda)
        want = eager.generate(prompts, params)
        engine = _engine(ckpt, k, spec_forced_acceptance=forced, tbo=tbo, **cuda)
        graphs = engine.speculator.graphs
        assert graphs is not None and graphs.target.use_graphs and graphs.draft.use_graphs
        assert graphs.target.tbo == tbo
        if host_chain:
            engine.model.decode_backend.plans_on_host = True
        got = engine.generate(prompts, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        if forced is None:
            assert [r.output_ids for r in got] == [r.output_ids for r in plain]
        else:
            assert engine.spec_stats == eager.spec_stats
        assert engine.speculator.graphs is graphs  # no capture failed
        assert graphs.target.num_replays > 10 and graphs.draft.num_replays > 10
        assert engine.num_pages_in_use == 0


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_decoding_with_two_batch_overlap(
    v3_mtp_small_vocab_ckpt: HFCheckpoint, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``tbo`` prompt forwards run as two micro-batches and decode-only steps (plain or
    the verify of a speculative one) through the runner's two-batch overlap forward; the
    greedy tokens stay plain decoding's, and eager or on the runners the drafts and their
    acceptance equal speculation without tbo."""
    ckpt = v3_mtp_small_vocab_ckpt
    prompts = random_prompts([1, 6, 19, 40], 4, seed=k)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = _engine(ckpt, None).generate(prompts, params)
    spec = _engine(ckpt, k)
    spec.generate(prompts, params)
    eager = _engine(ckpt, k, tbo=True)
    runners = _engine(ckpt, k, tbo=True)
    rows = 4 * (k + 1)
    runners.graph_runner = CudaGraphRunner(
        runners.model, runners.kv_pool, max_batch=rows, max_tokens_per_request=512,
        use_graphs=False, tbo=True,
    )  # fmt: skip
    assert runners.speculator is not None
    runners.speculator.attach_graphs(runners.graph_runner)
    splits: list[int] = []  # rows of every batch run as two micro-batches
    split = ForwardBatch.split

    def counted(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
        splits.append(batch.num_tokens)
        return split(batch)

    monkeypatch.setattr(ForwardBatch, "split", counted)
    for engine in (eager, runners):
        splits.clear()
        got = engine.generate(prompts, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in plain]
        assert engine.spec_stats == spec.spec_stats
        assert engine.num_pages_in_use == 0
        assert sum(splits) >= sum(map(len, prompts))  # the prompts at least, in two halves
    # on the runners, the verify forwards too: buckets of rows x (1 + k)
    assert any(n % (k + 1) == 0 and n >= 2 * (k + 1) for n in splits[-5:])
    graphs = runners.speculator.graphs
    assert graphs is not None and graphs.target.num_eager > 10  # verify forwards on the runner
