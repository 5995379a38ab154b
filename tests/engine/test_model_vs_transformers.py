"""The engine's forward against transformers' DeepSeek-V2/V3 on tiny random checkpoints.

Every comparison runs several prompts of different lengths together in one ragged
:class:`ForwardBatch` on the paged cache, while transformers runs each prompt alone, unpadded.
Both are float32 on CPU, so differences are summation-order rounding (~1e-6 relative); the
bound 1e-4 leaves room for that and nothing else (see ``test_comparison_is_sensitive``: dropping
YaRN or the correction bias moves the logits by more than 1e-2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.kv.pool import pages_for
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.moe_routing import routing_config, select_experts
from tests.engine.hf_checkpoints import (
    HFCheckpoint,
    copy_checkpoint,
    edit_config,
    hf_logits,
    new_pool,
    prefill_logits,
    random_prompts,
    relative_error,
)

PROMPT_LENGTHS = [1, 2, 17, 64, 100]
HF_TOLERANCE = 1e-4  # max |ours - ref| / max |ref|
MODE_TOLERANCE = 1e-5  # naive vs absorbed, chunked vs one-shot: same math, other sum order


def _prompts(
    ckpt: HFCheckpoint, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0
) -> list[list[int]]:
    return random_prompts(lengths, ckpt.hf_model.config.vocab_size, seed)


@pytest.fixture(
    params=["v3_ckpt", "v3_plain_ckpt", "v2_greedy_ckpt", "v2_grouped_ckpt", "v3_fp8_ckpt"]
)
def compared_ckpt(request: pytest.FixtureRequest) -> HFCheckpoint:
    """Each of the four checkpoints, and V3 with every linear weight in FP8 128 x 128 blocks
    as DeepSeek-V3 ships it (loaded dequantised; transformers holds the dequantised
    weights)."""
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_batched_prefill_matches_transformers(compared_ckpt: HFCheckpoint, mode: str) -> None:
    model = load_model(compared_ckpt.path)
    prompts = _prompts(compared_ckpt)
    ours = prefill_logits(model, prompts, mode)
    refs = [hf_logits(compared_ckpt.hf_model, p) for p in prompts]
    for p, o, r in zip(prompts, ours, refs, strict=True):
        assert o.shape == (len(p), compared_ckpt.hf_model.config.vocab_size)
        assert relative_error(o, r) <= HF_TOLERANCE, f"prompt of {len(p)} tokens"
    assert relative_error(torch.cat(ours), torch.cat(refs)) <= HF_TOLERANCE


def test_last_token_logits_match_transformers(v3_ckpt: HFCheckpoint) -> None:
    """all_logits=False returns one row per request: its last new token."""
    model = load_model(v3_ckpt.path)
    prompts = _prompts(v3_ckpt, seed=1)
    pool = new_pool(model, 32, 16)
    chunks = [
        SequenceChunk(p, 0, torch.tensor(pool.allocator.allocate(pages_for(len(p), 16))))
        for p in prompts
    ]
    last = model(ForwardBatch.build(chunks, 16, "cpu"), pool, attention_mode="auto")
    assert last.shape == (len(prompts), v3_ckpt.hf_model.config.vocab_size)
    assert last.dtype == torch.float32
    ref = torch.stack([hf_logits(v3_ckpt.hf_model, p)[-1] for p in prompts])
    assert relative_error(last, ref) <= HF_TOLERANCE


@pytest.mark.parametrize("change", ["no_yarn", "no_correction_bias"])
def test_comparison_is_sensitive(v3_ckpt: HFCheckpoint, tmp_path, change: str) -> None:
    """Negative control: dropping YaRN or V3's correction bias breaks the match by far more
    than HF_TOLERANCE, so the comparisons above really check them."""
    path = copy_checkpoint(v3_ckpt.path, tmp_path / "ckpt")
    if change == "no_yarn":
        edit_config(path, rope_scaling=None)
    model = load_model(path)
    if change == "no_correction_bias":
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.zero_()
    prompts = _prompts(v3_ckpt)
    ours = torch.cat(prefill_logits(model, prompts, "naive"))
    ref = torch.cat([hf_logits(v3_ckpt.hf_model, p) for p in prompts])
    assert relative_error(ours, ref) > 1e-2


def _capture_routing(ckpt: HFCheckpoint, prompts: list[list[int]]):
    """Per MoE layer: HF router logits [T, E], HF expert ids [T, k], our router logits [T, E]
    for all prompt tokens (prompts concatenated in order)."""
    model = load_model(ckpt.path)
    hf_layers = ckpt.hf_model.model.layers
    moe_ids = model.config.moe_layer_ids
    hf_out: dict[int, list] = {i: [] for i in moe_ids}
    our_out: dict[int, list] = {i: [] for i in moe_ids}
    handles = []
    for i in moe_ids:
        handles.append(
            hf_layers[i].mlp.gate.register_forward_hook(
                lambda _m, _a, out, i=i: hf_out[i].append((out[0].detach(), out[2].detach()))
            )
        )
        handles.append(
            model.model.layers[i].mlp.gate.register_forward_hook(
                lambda _m, _a, out, i=i: our_out[i].append(out.clone())
            )
        )
    try:
        for p in prompts:
            hf_logits(ckpt.hf_model, p)
        prefill_logits(model, prompts, "naive")
    finally:
        for h in handles:
            h.remove()
    result = {}
    for i in moe_ids:
        hf_logit = torch.cat([o[0] for o in hf_out[i]])
        hf_ids = torch.cat([o[1] for o in hf_out[i]])
        result[i] = (hf_logit, hf_ids, torch.cat(our_out[i]))
    return model, result


def test_routing_is_exercised(any_ckpt: HFCheckpoint) -> None:
    """Our router sees HF's logits and picks HF's experts; the picks cover the experts, and the
    policy-specific step (V3's correction bias, V2's group limit) changes some picks."""
    prompts = _prompts(any_ckpt)
    num_tokens = sum(map(len, prompts))
    model, routing = _capture_routing(any_ckpt, prompts)
    moe = routing_config(model.config.moe)
    assert len(routing) == 2  # layers 1 and 2 (first_k_dense_replace = 1)
    for layer, (hf_logit, hf_ids, our_logit) in routing.items():
        assert hf_logit.shape == our_logit.shape == (num_tokens, moe.n_routed_experts)
        assert relative_error(our_logit, hf_logit) <= HF_TOLERANCE
        bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
        _, ids = select_experts(hf_logit, moe, bias)
        assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
        _, our_ids = select_experts(our_logit, moe, bias)
        assert torch.equal(our_ids.sort(-1).values, hf_ids.sort(-1).values)

        per_expert = torch.bincount(hf_ids.flatten(), minlength=moe.n_routed_experts)
        assert int((per_expert > 0).sum()) >= moe.n_routed_experts - 1, per_expert.tolist()

        if moe.topk_method == "noaux_tc":
            assert bias is not None and float(bias.abs().min()) > 0
            _, unbiased = select_experts(hf_logit, moe, None)
        elif moe.topk_method == "group_limited_greedy":
            _, unbiased = select_experts(hf_logit, dataclasses.replace(moe, topk_method="greedy"))
        else:
            continue
        changed = (unbiased.sort(-1).values != ids.sort(-1).values).any(-1)
        assert int(changed.sum()) >= num_tokens // 20, int(changed.sum())


def test_naive_and_absorbed_agree(any_ckpt: HFCheckpoint) -> None:
    model = load_model(any_ckpt.path)
    prompts = _prompts(any_ckpt, seed=2)
    naive = torch.cat(prefill_logits(model, prompts, "naive"))
    absorbed = torch.cat(prefill_logits(model, prompts, "absorbed"))
    assert relative_error(absorbed, naive) <= MODE_TOLERANCE
    torch.testing.assert_close(absorbed, naive, rtol=1e-5, atol=1e-5 * float(naive.abs().max()))


def _chunked_prefill(
    model, prompt: list[int], chunk: int, page_size: int, all_logits: bool
) -> list[torch.Tensor]:
    """Feed ``prompt`` ``chunk`` tokens per forward call, continuing from the cached prefix on
    the same (deliberately non-contiguous) pages; returns each call's logits."""
    pool = new_pool(model, 2 * pages_for(len(prompt), page_size), page_size)
    pages = pool.allocator.allocate(2 * pages_for(len(prompt), page_size))
    table = torch.tensor(pages[::-2])  # every other page, in reverse order
    out = []
    for start in range(0, len(prompt), chunk):
        piece = SequenceChunk(prompt[start : start + chunk], start, table)
        batch = ForwardBatch.build([piece], page_size, "cpu")
        out.append(model(batch, pool, attention_mode="auto", all_logits=all_logits))
    return out


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_grouped_ckpt"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot(request, ckpt_name: str, chunk: int) -> None:
    ckpt: HFCheckpoint = request.getfixturevalue(ckpt_name)
    model = load_model(ckpt.path)
    prompt = _prompts(ckpt, [100], seed=3)[0]
    (one_shot,) = prefill_logits(model, [prompt], "naive")

    per_call = _chunked_prefill(model, prompt, chunk, page_size=8, all_logits=True)
    assert [c.shape[0] for c in per_call[:-1]] == [chunk] * (len(per_call) - 1)
    assert relative_error(torch.cat(per_call), one_shot) <= MODE_TOLERANCE

    last_rows = _chunked_prefill(model, prompt, chunk, page_size=8, all_logits=False)
    assert last_rows[-1].shape == (1, one_shot.shape[1])
    assert relative_error(last_rows[-1][0], one_shot[-1]) <= MODE_TOLERANCE


def _greedy_generate(
    model, prompts: list[list[int]], max_new_tokens: int, page_size: int
) -> list[list[int]]:
    """Prefill every prompt in one forward, then one decode token per request per forward,
    all requests together, on the paged cache."""
    pool = new_pool(
        model, sum(pages_for(len(p) + max_new_tokens, page_size) for p in prompts), page_size
    )
    tables = [
        torch.tensor(pool.allocator.allocate(pages_for(len(p) + max_new_tokens, page_size)))
        for p in prompts
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for _ in range(max_new_tokens):
        logits = model(ForwardBatch.build(chunks, page_size, "cpu"), pool, attention_mode="auto")
        next_ids = logits.argmax(-1).tolist()
        for i, token in enumerate(next_ids):
            outputs[i].append(token)
        chunks = [
            SequenceChunk([tok], c.prefix_len + len(c.token_ids), c.page_table)
            for c, tok in zip(chunks, next_ids, strict=True)
        ]
    return outputs


def test_greedy_generation_matches_transformers(compared_ckpt: HFCheckpoint) -> None:
    max_new = 16
    model = load_model(compared_ckpt.path)
    prompts = _prompts(compared_ckpt, [1, 2, 5, 17, 33, 64, 100], seed=4)
    ours = _greedy_generate(model, prompts, max_new, page_size=8)
    eos = compared_ckpt.hf_model.config.eos_token_id
    compared = 0
    for prompt, generated in zip(prompts, ours, strict=True):
        out = compared_ckpt.hf_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, pad_token_id=eos
        )
        ref = out[0, len(prompt) :].tolist()
        # transformers stops at EOS; we do not, so compare up to where it stopped.
        assert len(ref) == max_new or ref[-1] == eos
        assert generated[: len(ref)] == ref, f"prompt of {len(prompt)} tokens"
        compared += len(ref)
    assert compared >= len(prompts) * max_new // 2
    # The continuations are not degenerate (a constant output would hide most bugs).
    assert len({t for g in ours for t in g}) >= 20
