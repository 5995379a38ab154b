"""The decode-attention choice (engine/decode_attention.py) and FlashInfer in eager forwards.

The policy runs everywhere. The GPU tests need FlashInfer (``pip install flashinfer-python``)
and a checkpoint with DeepSeek's latent (512 + 64): the eager forward with the planned
FlashInfer kernel against the same forward with dsmesh's Triton kernel, and an engine whose
eager decode steps (CUDA graphs off) plan once per forward and call it in every layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import decode_attention
from engine.decode_attention import make_flashinfer, wants_flashinfer
from engine.forward_batch import ForwardBatch, SequenceChunk
from engine.kv_cache import MLAKVPool
from engine.llm_engine import EngineConfig, LLMEngine
from engine.loader import load_model
from engine.model import DeepseekForCausalLM
from engine.sampling_params import SamplingParams
from kernels.backends import available
from kernels.mla_decode import mla_decode_ref
from tests.engine.hf_checkpoints import HFCheckpoint, random_prompts, relative_error

needs_flashinfer = pytest.mark.skipif(
    not (torch.cuda.is_available() and available("flashinfer")),
    reason="needs a CUDA device and FlashInfer (pip install flashinfer-python)",
)


def test_auto_takes_flashinfer_only_where_it_fits(
    v2_greedy_ckpt: HFCheckpoint, v2_latent_ckpt: HFCheckpoint, monkeypatch
) -> None:
    """ "auto": an adapter for an installed FlashInfer, CUDA, bf16/fp16, DeepSeek's latent."""
    small, latent = load_model(v2_greedy_ckpt.path), load_model(v2_latent_ckpt.path)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(decode_attention, "choose", lambda kernel: "flashinfer")
    assert wants_flashinfer("auto", latent, cuda, bf16)
    assert wants_flashinfer("auto", latent, cuda, torch.float16)
    assert not wants_flashinfer("auto", latent, cuda, torch.float32)  # the exact reference
    assert not wants_flashinfer("auto", latent, torch.device("cpu"), bf16)
    assert not wants_flashinfer("auto", small, cuda, bf16)  # kv_lora_rank 32, rope 16
    assert not wants_flashinfer("kernel", latent, cuda, bf16)
    assert wants_flashinfer("flashinfer", small, cuda, bf16)  # asked for: tried, may fail
    monkeypatch.setattr(decode_attention, "choose", lambda kernel: "triton")
    assert not wants_flashinfer("auto", latent, cuda, bf16)  # not installed
    with pytest.raises(ValueError, match="attention must be one of"):
        wants_flashinfer("fast", latent, cuda, bf16)


def test_explicit_flashinfer_fails_clearly_where_it_cannot_run(v2_latent_ckpt) -> None:
    model = load_model(v2_latent_ckpt.path)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="attention='flashinfer' needs CUDA"):
        make_flashinfer("flashinfer", model, cpu, torch.bfloat16, 16, 64, graph=False)
    assert make_flashinfer("auto", model, cpu, torch.float32, 16, 64, graph=False) is None


def test_tbo_micro_batches_keep_host_pages_and_drop_the_plan() -> None:
    """A plan covers the whole batch: split halves fall back to Triton, with their own host
    page tables and lengths."""
    chunks = [
        SequenceChunk([5], 6, torch.tensor([3, 1])),
        SequenceChunk([1, 2, 3], 0, torch.tensor([0])),
        SequenceChunk([7], 9, torch.tensor([2, 4, 5])),
    ]
    batch = ForwardBatch.build(chunks, 4, "cpu")
    assert batch.decode_host is not None
    pages, lens = batch.decode_host
    assert pages.tolist() == [[3, 1, 0], [2, 4, 5]] and lens.tolist() == [7, 10]
    planned = dataclasses.replace(batch, decode_attention=lambda *a, **k: None)
    first, second = planned.split()
    assert first.decode_attention is None and second.decode_attention is None
    halves = [h for h in (first, second) if h.decode_host is not None]
    got = sorted((p.tolist(), n.tolist()) for h in halves for p, n in [h.decode_host])
    assert got == [([[2, 4, 5]], [10]), ([[3, 1, 0]], [7])]


def _mixed_step(model: DeepseekForCausalLM, page_size: int):
    """Four prompts prefilled, then one forward of three decode rows and a fourth request's
    next chunk. Returns (that batch, the pool)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    pool = MLAKVPool(cfg.num_hidden_layers, 64, page_size, cfg.mla.kv_cache_dim, dtype, "cuda")
    prompts = random_prompts([40, 3, 100, 17], cfg.vocab_size, seed=6)
    pages = [torch.tensor(pool.allocator.allocate(8)) for _ in prompts]
    prefill = [SequenceChunk(p, 0, pg) for p, pg in zip(prompts, pages, strict=True)]
    model(ForwardBatch.build(prefill, page_size, "cuda"), pool)
    chunks = [SequenceChunk([7], len(p), pg) for p, pg in zip(prompts[:3], pages[:3], strict=True)]
    chunks.append(SequenceChunk(prompts[3][:9], len(prompts[3]), pages[3]))
    return ForwardBatch.build(chunks, page_size, "cuda"), pool


@needs_flashinfer
@pytest.mark.gpu
def test_eager_forward_with_planned_flashinfer_matches_triton(v2_latent_ckpt) -> None:
    """Decode rows and a prefill chunk in one bf16 eager forward, with FlashInfer (planned
    for the batch, called by every layer) and with the Triton kernel, each against the same
    forward of the float32 model (torch attention). Both kernels are held to the same
    distance: this tiny random model's bf16 logits sit 1.5-4% from float32 whichever kernel
    runs (measured on the H200), while wrong pages or rows would be off by about 100%."""
    page_size = 16
    exact = load_model(v2_latent_ckpt.path, torch.float32, "cuda")
    batch32, pool32 = _mixed_step(exact, page_size)
    want = exact(dataclasses.replace(batch32, decode_attention=mla_decode_ref), pool32)
    model = load_model(v2_latent_ckpt.path, torch.bfloat16, "cuda")
    batch, pool = _mixed_step(model, page_size)
    triton = model(batch, pool).float()
    fi = make_flashinfer("flashinfer", model, torch.device("cuda"), torch.bfloat16,
                         page_size, pool.num_pages, graph=False)  # fmt: skip
    assert fi is not None
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fi(*args, **kwargs)

    assert batch.decode_host is not None
    fi.plan(*batch.decode_host)
    got = model(dataclasses.replace(batch, decode_attention=spy), pool).float()
    assert calls == [3] * model.config.num_hidden_layers  # every layer, the 3 decode rows
    for row in range(4):
        err, base = relative_error(got[row], want[row]), relative_error(triton[row], want[row])
        assert err < 1.5 * base + 5e-3 and err < 5e-2, (row, err, base)


@needs_flashinfer
@pytest.mark.gpu
def test_engine_plans_each_eager_decode_forward(v2_latent_ckpt) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(v2_latent_ckpt.path),
            device="cuda",
            dtype="bfloat16",
            page_size=16,
            max_total_tokens=4096,
            cuda_graphs=False,
        )
    )
    fi = engine.eager_decode_attention
    assert engine.graph_runner is None and fi is not None  # "auto" picked FlashInfer
    plans = []
    plan = fi.plan

    def counted(table, lens) -> None:
        plans.append(len(lens))
        plan(table, lens)

    fi.plan = counted  # type: ignore[method-assign]
    prompts = random_prompts([5, 30, 64], engine.model_config.vocab_size, seed=8)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert all(len(t) == 6 for t in out.values())
    assert len(plans) >= 5 and max(plans) == 3  # one plan per decode forward, all rows
    assert engine.num_pages_in_use == 0
