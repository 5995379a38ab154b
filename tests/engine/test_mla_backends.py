"""The MLA attention backends (dsmesh/engine/model/mla_decode_backend.py,
dsmesh/engine/model/mla_prefill_backend.py):
the choice, each backend against the torch reference, and FlashInfer in eager forwards.

The policy and the Triton backends run everywhere (Triton's CPU interpreter when there is no
GPU). The FlashInfer tests need it (``pip install flashinfer-python``) and a checkpoint with
DeepSeek's latent (512 + 64): the eager forward with FlashInfer planned per forward against
the Triton backend, and an engine whose eager decode steps plan once per forward.
"""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model import mla_decode_backend
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.mla_decode_backend import (
    TorchMLADecode,
    TritonMLADecode,
    flashinfer_fits,
    make_decode_backend,
)
from dsmesh.engine.model.mla_prefill_backend import TorchMLAPrefill, TritonMLAPrefill
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.kernels.backends import available
from tests.engine.hf_checkpoints import random_prompts, relative_error

needs_flashinfer = pytest.mark.skipif(
    not (torch.cuda.is_available() and available("flashinfer")),
    reason="needs a CUDA device and FlashInfer (pip install flashinfer-python)",
)
LATENT = (512, 64)


def test_auto_takes_flashinfer_only_where_it_fits(monkeypatch) -> None:
    """ "auto": an adapter for an installed FlashInfer, CUDA, bf16/fp16, DeepSeek's latent;
    Triton otherwise on the GPU, the torch reference in float32 and off the GPU."""
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(mla_decode_backend, "choose", lambda kernel: "flashinfer")
    assert flashinfer_fits(LATENT, cuda, bf16)
    assert flashinfer_fits(LATENT, cuda, torch.float16)
    assert not flashinfer_fits(LATENT, cuda, torch.float32)  # the exact reference
    assert not flashinfer_fits(LATENT, cpu, bf16)
    assert not flashinfer_fits((32, 16), cuda, bf16)  # a tiny model's latent
    monkeypatch.setattr(mla_decode_backend, "choose", lambda kernel: "triton")
    assert not flashinfer_fits(LATENT, cuda, bf16)  # not installed
    monkeypatch.setattr("dsmesh.engine.model.kernel_choice.triton_importable", lambda: True)
    monkeypatch.setattr("dsmesh.kernels.backends.choose", lambda kernel: "triton")
    gpu = KernelChoice.resolve(cuda, bf16, flashinfer_fits=True)
    assert gpu == KernelChoice(
        triton=True, decode_attention="flashinfer", fused_moe=True, fp8_linear="triton"
    )  # FP8 linears: DeepGEMM taken as absent
    assert KernelChoice.resolve(cuda, bf16).decode_attention == "triton"
    assert KernelChoice.resolve(cuda, bf16, decode_attention="torch").decode_attention == "torch"
    exact = KernelChoice.resolve(cuda, torch.float32, flashinfer_fits=True)
    assert exact == KernelChoice(triton=True, decode_attention="torch", fused_moe=False)
    assert KernelChoice.resolve(cuda, bf16, kernels="torch") == KernelChoice.reference()
    assert not KernelChoice.resolve(cuda, bf16, moe_backend="grouped").fused_moe
    with pytest.raises(ValueError, match="unknown decode attention"):
        KernelChoice.resolve(cuda, bf16, decode_attention="fast")


def test_explicit_flashinfer_fails_clearly_where_it_cannot_run(v2_latent_ckpt) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="attention='flashinfer' needs CUDA"):
        make_decode_backend(
            "flashinfer", "flashinfer", cpu, (4, 512, 64, 1.0), torch.bfloat16, 16, 64
        )
    with pytest.raises(ValueError, match="attention='flashinfer' needs CUDA"):
        LLMEngine(
            EngineConfig(
                model=str(v2_latent_ckpt.path), device="cpu", decode_attention="flashinfer"
            )
        )
    # "auto" falls back where FlashInfer was picked but cannot be built
    fallback = make_decode_backend(
        "flashinfer", "auto", cpu, (4, 512, 64, 1.0), torch.bfloat16, 16, 64
    )
    assert fallback.name == "triton"


def test_tbo_micro_batches_keep_their_own_pages() -> None:
    """Two-batch overlap splits the decode rows with their own page tables, lengths, host
    copies and rows (None where a half is decode-only)."""
    chunks = [
        SequenceChunk([5], 6, torch.tensor([3, 1])),
        SequenceChunk([1, 2, 3], 0, torch.tensor([0])),
        SequenceChunk([7], 9, torch.tensor([2, 4, 5])),
    ]
    batch = ForwardBatch.build(chunks, 4, "cpu")
    meta = batch.decode
    assert meta is not None and meta.host is not None
    pages, lens = meta.host
    assert pages.tolist() == [[3, 1, 0], [2, 4, 5]] and lens.tolist() == [7, 10]
    assert meta.rows is not None and meta.rows.tolist() == [0, 4]
    assert meta.page_table.tolist() == pages.tolist() and meta.seq_lens.tolist() == [7, 10]
    halves = [h for h in batch.split() if h.decode is not None]
    got = sorted(
        (h.decode.page_table.tolist(), h.decode.seq_lens.tolist(), h.decode.host[1].tolist())
        for h in halves
    )
    assert got == [([[2, 4, 5]], [10], [10]), ([[3, 1, 0]], [7], [7])]
    first, second = batch.split()  # [request 0] and [requests 1, 2]
    assert first.decode is not None and first.decode.rows is None  # decode-only
    assert second.decode is not None and second.decode.rows.tolist() == [3]
    decode_only = ForwardBatch.build([chunks[0], chunks[2]], 4, "cpu")
    assert decode_only.decode is not None and decode_only.decode.rows is None


def _decode_inputs(device: str, seed: int = 0):
    """Random latents in a paged pool and queries for 5 requests of ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    heads, rank, rope, page_size = 4, 64, 16, 4
    lens = [1, 5, 17, 9, 30]
    kv = torch.randn(40, page_size, rank + rope, generator=g).to(device)
    perm = torch.randperm(40, generator=g).tolist()
    table = torch.zeros(len(lens), 8, dtype=torch.int32)
    start = 0
    for i, n in enumerate(lens):
        used = -(-n // page_size)
        table[i, :used] = torch.tensor(perm[start : start + used])
        start += used
    q = torch.randn(len(lens), heads, rank, generator=g).to(device)
    q_pe = torch.randn(len(lens), heads, rope, generator=g).to(device)
    meta_lens = torch.tensor(lens, dtype=torch.int32)
    from dsmesh.engine.model.forward_batch import DecodeMeta

    meta = DecodeMeta(
        None, table.to(device), meta_lens.to(device), (table.numpy(), meta_lens.numpy())
    )
    return q, q_pe, kv, meta


def test_triton_decode_backend_equals_the_torch_reference() -> None:
    pytest.importorskip("triton")
    import tests.kernels.conftest  # noqa: F401 - patches Triton's interpreter for NumPy 2.4

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, q_pe, kv, meta = _decode_inputs(device)
    want = TorchMLADecode().forward(q, q_pe, kv, meta, 0.125)
    backend = TritonMLADecode()
    backend.plan(meta)  # no host work, but part of the contract
    out = torch.empty_like(want)
    got = backend.forward(q, q_pe, kv, meta, 0.125, out=out)
    assert got is out and relative_error(got, want) < 1e-5


@pytest.mark.parametrize("decode_row", [True, False])
def test_triton_prefill_backend_equals_the_torch_reference(v2_greedy_ckpt, decode_row) -> None:
    """A ragged batch (two prompts, a chunk continuing from a prefix, a decode row left to
    the decode backend) through both prefill backends of one attention layer. Without the
    decode row every request is a prefill one and the kernel writes ``out`` in place."""
    pytest.importorskip("triton")
    import tests.kernels.conftest  # noqa: F401

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(v2_greedy_ckpt.path, torch.float32, device)
    attn = model.model.layers[0].self_attn
    cfg = model.config
    pool = MLAKVPool(cfg.num_hidden_layers, 32, 4, cfg.mla.kv_cache_dim, torch.float32, device)
    pool.buffer.normal_()
    chunks = [
        SequenceChunk([1] * 7, 0, torch.tensor([0, 1])),
        SequenceChunk([2], 5, torch.tensor([2, 3])),
        SequenceChunk([3] * 3, 6, torch.tensor([4, 5, 6])),
        SequenceChunk([4] * 12, 0, torch.tensor([7, 8, 9])),
    ]
    if not decode_row:
        del chunks[1]
    batch = ForwardBatch.build(chunks, 4, device)
    assert batch.prefill_ids == ([0, 2, 3] if decode_row else [0, 1, 2])
    g = torch.Generator().manual_seed(2)
    t, h = batch.num_tokens, attn.num_heads
    q_nope = torch.randn(t, h, attn.nope_dim, generator=g).to(device)
    q_pe = torch.randn(t, h, attn.rope_dim, generator=g).to(device)
    outs = []
    for backend in (TorchMLAPrefill(), TritonMLAPrefill()):
        out = torch.zeros(t, h, attn.v_dim, device=device)
        with torch.inference_mode():
            backend.forward(attn, q_nope, q_pe, pool, batch, batch.prefill_ids, out)
        outs.append(out)
    if decode_row:
        assert not bool(outs[0][7].any()) and not bool(outs[1][7].any())  # left alone
    assert relative_error(outs[1].cpu(), outs[0].cpu()) < 1e-5


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
    exact = load_model(v2_latent_ckpt.path, torch.float32, "cuda")  # torch attention
    batch32, pool32 = _mixed_step(exact, page_size)
    want = exact(batch32, pool32)
    model = load_model(v2_latent_ckpt.path, torch.bfloat16, "cuda")  # Triton attention
    batch, pool = _mixed_step(model, page_size)
    triton = model(batch, pool).float()
    attn = model.model.layers[0].self_attn
    shape = (attn.num_heads, attn.kv_lora_rank, attn.rope_dim, attn.scale)
    fi = make_decode_backend(
        "flashinfer", "flashinfer", torch.device("cuda"), shape, torch.bfloat16, page_size, 8
    )
    calls = []
    forward = fi.forward

    def spy(q_latent, *args, **kwargs):
        calls.append(q_latent.shape[0])
        return forward(q_latent, *args, **kwargs)

    fi.forward = spy  # type: ignore[method-assign]
    model.set_kernels(model.kernels, fi)
    batch, pool = _mixed_step(model, page_size)
    got = model(batch, pool).float()
    assert calls[-model.config.num_hidden_layers :] == [3] * model.config.num_hidden_layers
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
    fi = engine.model.decode_backend
    assert engine.graph_runner is None and fi.name == "flashinfer"  # "auto" picked it
    plans = []
    plan = fi.plan

    def counted(meta) -> None:
        plans.append(meta.num_rows)
        plan(meta)

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
