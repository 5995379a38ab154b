"""Dense linears held in FP8 (dsmesh/engine/model/fp8_linear.py, ``--fp8-linears``).

The checkpoint is V3 with every linear weight in FP8 128 x 128 blocks, as DeepSeek-V3 ships
it (``v3_fp8_ckpt``; its transformers model holds the dequantised weights). The loader keeps
the attention projections but kv_b_proj and the dense MLP / shared experts as stored when
asked, and dequantises them otherwise. A model running them (the torch reference on CPU, the
Triton or DeepGEMM GEMM on a GPU) quantises each linear's input per token per 128 columns,
as SGLang and vLLM do; transformers is made to do the same (a pre-hook on the same linears,
:func:`_quantise_inputs_of`), and then the two agree to float32 rounding. Without that hook
this tiny random model (weights of std 0.15) is far from transformers: e4m3 input rounding
(3 mantissa bits) moves each layer's output by 5-13% and flips MoE routing in the last layer
(measured 2026-12-06: logits 60% apart, top-1 agreement 52%), which is what the hook shows to
be the activation rounding and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from dsmesh.engine.footprint import weight_bytes
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.fp8_linear import Fp8Linear
from dsmesh.engine.runner.kernel_summary import describe_kernels
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.kernels.fp8 import dequantize_fp8_block
from tests.engine.hf_checkpoints import (
    HFCheckpoint,
    hf_logits,
    prefill_logits,
    random_prompts,
    relative_error,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BLOCK = (128, 128)


def _stored(ckpt: HFCheckpoint) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt.path / "model.safetensors"))


def _fp8_modules(model: nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def test_loader_keeps_fp8_and_scales_when_asked(v3_fp8_ckpt: HFCheckpoint) -> None:
    stored = _stored(v3_fp8_ckpt)
    model = load_model(v3_fp8_ckpt.path, fp8_linears=True)
    held = _fp8_modules(model)
    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
    expected = {f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in attention}
    expected |= {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    expected |= {
        f"model.layers.{i}.mlp.shared_experts.{p}"
        for i in (1, 2)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert set(held) == expected
    for name, module in held.items():
        w, s = stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"]
        assert module.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(module.weight.view(torch.uint8), w.view(torch.uint8)), name
        assert torch.equal(module.weight_scale_inv, s), name
    # kv_b_proj feeds the weight-absorbed decode: dequantised, as without the option
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    dense = dequantize_fp8_block(stored[kv_b], stored[kv_b + "_scale_inv"], BLOCK)
    assert torch.equal(model.get_parameter(kv_b), dense)
    assert model.model.layers[1].self_attn.kv_b_proj.__class__ is nn.Linear


def test_loader_dequantises_without_the_option(v3_fp8_ckpt: HFCheckpoint) -> None:
    stored = _stored(v3_fp8_ckpt)
    model = load_model(v3_fp8_ckpt.path)
    assert not _fp8_modules(model)
    name = "model.layers.2.mlp.shared_experts.down_proj.weight"
    dense = dequantize_fp8_block(stored[name], stored[name + "_scale_inv"], BLOCK)
    assert torch.equal(model.get_parameter(name), dense)


def test_blocks_other_than_128_stay_dequantised(v3_ckpt: HFCheckpoint, tmp_path) -> None:
    """The FP8 GEMMs take DeepSeek's 128 x 128 blocks only; other blocks load dense."""
    from tests.engine.hf_checkpoints import make_fp8_copy

    small = make_fp8_copy(v3_ckpt, tmp_path / "b32", block=(32, 32))
    assert not _fp8_modules(load_model(small.path, fp8_linears=True))


@contextlib.contextmanager
def _quantise_inputs_of(hf_model: nn.Module, names: set[str]) -> Iterator[None]:
    """Within the block, each module of ``hf_model`` named in ``names`` sees its input as
    dequantise(quantise_per_token_group(x)) (groups of 128, the last one ragged): what an
    FP8 linear multiplies."""
    from dsmesh.kernels.fp8 import dequantize_fp8_per_token_group
    from dsmesh.kernels.fp8_linear import quantize_activation_ref

    def rounded(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        k = x.shape[-1]
        q, scale = quantize_activation_ref(x.reshape(-1, k))
        padded = torch.nn.functional.pad(q.float(), (0, -k % 128))
        a = dequantize_fp8_per_token_group(padded, scale)[:, :k]
        return (a.to(x.dtype).view(x.shape), *args[1:])

    modules = dict(hf_model.named_modules())
    handles = [modules[n].register_forward_pre_hook(rounded) for n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def test_fp8_linears_on_cpu_agree_with_transformers(v3_fp8_ckpt: HFCheckpoint) -> None:
    """The torch reference against transformers on the dequantised weights with the same
    input rounding on the same linears: logits to 1e-4 (HF_TOLERANCE of the dense tests);
    without the rounding they differ by far more (the activations really are quantised)."""
    model = load_model(v3_fp8_ckpt.path, fp8_linears=True)
    held = _fp8_modules(model)
    assert {m.backend for m in held.values()} == {"torch"}
    prompts = random_prompts([1, 5, 17, 64, 100], 256, seed=3)
    ours = torch.cat(prefill_logits(model, prompts))
    with _quantise_inputs_of(v3_fp8_ckpt.hf_model, set(held)):
        ref = torch.cat([hf_logits(v3_fp8_ckpt.hf_model, p) for p in prompts])
    assert relative_error(ours, ref) <= 1e-4
    plain = torch.cat([hf_logits(v3_fp8_ckpt.hf_model, p) for p in prompts])
    assert relative_error(ours, plain) > 1e-2


def test_fused_projections_keep_the_same_values(v3_fp8_ckpt: HFCheckpoint) -> None:
    """set_kernels fuses gate and up of the shared experts (2 x 32 rows: not whole 128-row
    blocks here, so they stay apart) and q_a with kv_a only where the first fills whole
    scale blocks; the outputs equal the unfused modules'."""
    from dsmesh.engine.model.fp8_linear import fuse_fp8_linears
    from dsmesh.kernels.fp8 import quantize_fp8_block

    first, second = Fp8Linear(256, 128), Fp8Linear(256, 72)
    for module, seed in ((first, 0), (second, 1)):
        w = torch.randn(module.out_features, 256, generator=torch.Generator().manual_seed(seed))
        q, s = quantize_fp8_block(w)
        module.weight.data, module.weight_scale_inv.data = q, s
    x = torch.randn(3, 256)
    separate = torch.cat([first(x), second(x)], dim=1)
    fused = fuse_fp8_linears(first, second)
    assert fused is not None and fused[1].shape == (2, 2)
    from dsmesh.kernels.fp8_linear import fp8_linear

    assert torch.equal(fp8_linear(x, *fused, "torch"), separate)
    assert torch.equal(torch.cat([first(x), second(x)], dim=1), separate)  # views of it
    assert fuse_fp8_linears(Fp8Linear(256, 72), Fp8Linear(256, 128)) is None  # ragged first


def test_fused_fp8_input_projection_agrees_with_transformers(tmp_path) -> None:
    """q_lora_rank 128 fills one scale block, so q_a_proj and kv_a_proj_with_mqa run as one
    FP8 GEMM (weights and scale rows concatenated); the logits still equal transformers'
    with the same input rounding."""
    from tests.engine.hf_checkpoints import make_fp8_copy, make_hf_v3

    wide = HFCheckpoint(*make_hf_v3(tmp_path / "q128", q_lora_rank=128, seed=5))
    ckpt = make_fp8_copy(wide, tmp_path / "fp8")
    model = load_model(ckpt.path, fp8_linears=True)
    attn = model.model.layers[0].self_attn
    assert attn.fused_input_fp8 is not None
    weight, scale_inv = attn.fused_input_fp8
    assert weight.shape == (128 + 48, 64) and scale_inv.shape == (2, 1)
    assert attn.q_a_proj.weight.data_ptr() == weight.data_ptr()  # a view: no copy
    prompts = random_prompts([2, 30], 256, seed=6)
    ours = torch.cat(prefill_logits(model, prompts))
    with _quantise_inputs_of(ckpt.hf_model, set(_fp8_modules(model))):
        ref = torch.cat([hf_logits(ckpt.hf_model, p) for p in prompts])
    assert relative_error(ours, ref) <= 1e-4


def test_engine_generates_with_fp8_linears_on_cpu(v3_fp8_ckpt: HFCheckpoint) -> None:
    """--fp8-linears on CPU (the torch reference): greedy tokens, every one transformers'
    top-1 on the same prefix (teacher forcing, the same input rounding), and the start-up
    table names the path."""
    engine = LLMEngine(
        EngineConfig(
            model=str(v3_fp8_ckpt.path), device="cpu", page_size=8, max_total_tokens=2048,
            fp8_linears=True,
        )
    )  # fmt: skip
    assert _fp8_modules(engine.model)
    prompts = random_prompts([3, 17, 40], 256, seed=9)
    ids = {engine.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)): i
           for i, p in enumerate(prompts)}  # fmt: skip
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[ids[o.request_id]].extend(o.new_token_ids)
    agree = total = 0
    with _quantise_inputs_of(v3_fp8_ckpt.hf_model, set(_fp8_modules(engine.model))):
        for i, prompt in enumerate(prompts):
            ref = hf_logits(v3_fp8_ckpt.hf_model, prompt + out[i])[len(prompt) - 1 : -1]
            agree += int((ref.argmax(-1) == torch.tensor(out[i])).sum())
            total += len(out[i])
    assert total == 36 and agree == total
    table = describe_kernels(engine.model, engine.config, engine.model.kernels, "torch")
    row = next(line for line in table.splitlines() if "dense linears" in line)
    assert "torch FP8 reference" in row


def test_footprint_counts_what_the_fp8_model_holds(v3_fp8_ckpt: HFCheckpoint) -> None:
    """weight_bytes(fp8_linears=True) is the bytes a model loaded so holds (one byte a
    weight of each FP8 linear, its float32 scales; the rest in float32 here)."""
    model = load_model(v3_fp8_ckpt.path, fp8_linears=True)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" not in n
    )
    assert weight_bytes(model.config, 4, fp8_linears=True).total == held
    assert weight_bytes(model.config, 4).total > held


# ---- GPU -----------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
def test_decode_step_with_fp8_linears_replays_in_cuda_graphs(
    v3_fp8_ckpt: HFCheckpoint,
) -> None:
    """bf16 with the FP8 linears on the chosen GEMM (DeepGEMM where installed, else Triton;
    this toy's widths are not whole 128-blocks, so Triton serves most of them) and the fused
    decode MoE adding the FP8 shared experts' output: the captured decode steps equal the
    same runner without capture (to 1e-3: the same kernels on the same inputs) and stay
    close to the eager path."""
    from dsmesh.engine.model.kernel_choice import KernelChoice
    from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
    from tests.engine.test_cuda_graph import (
        _eager_decode,
        _prefilled,
        _set_kernels,
        _static_decode,
    )

    model = load_model(v3_fp8_ckpt.path, torch.bfloat16, "cuda", fp8_linears=True)
    kernels = KernelChoice.resolve(torch.device("cuda"), torch.bfloat16)
    assert kernels.fp8_linear in ("triton", "deep_gemm")
    prompts = random_prompts([1, 3, 6, 13, 30], model.config.vocab_size, seed=5)
    page_size, steps = 4, 6
    pool, pages, first = _prefilled(model, prompts, page_size, steps)
    _set_kernels(model, kernels, pool)
    assert {m.backend for m in _fp8_modules(model).values()} == {kernels.fp8_linear}
    fed, eager = _eager_decode(model, pool, prompts, pages, first, page_size, steps)
    runner = CudaGraphRunner(model, pool, max_batch=8, max_tokens_per_request=64)
    assert runner.use_graphs
    static = _static_decode(runner, prompts, pages, fed)
    plain = CudaGraphRunner(model, pool, max_batch=8, max_tokens_per_request=64, use_graphs=False)
    uncaptured = _static_decode(plain, prompts, pages, fed)
    assert runner.num_replays == steps
    for s, p in zip(static, uncaptured, strict=True):
        assert relative_error(s, p) < 1e-3
    errs = [relative_error(s, e) for s, e in zip(static, eager, strict=True)]
    assert max(errs) < 3e-2, errs


@needs_cuda
@pytest.mark.gpu
def test_tiny_v3_fp8_checkpoint_greedy_on_cuda_agrees_with_cpu(tmp_path) -> None:
    """The bench's tiny-v3 checkpoint (every linear in FP8, dsmesh/bench/checkpoint.py) served
    on CUDA (bf16, CUDA graphs, FP8 linears on the Triton GEMM even where DeepGEMM is chosen:
    the toy widths are not whole 128-blocks) against the CPU's float32 reference path, teacher
    forced: at least 85% of the CUDA run's greedy tokens are the CPU's top-1 after the same
    prefix. bf16 and float32 round differently, and this checkpoint's weights (std 0.02)
    leave near-ties; the same comparison on the CPU (the torch reference in bf16 against
    float32) agreed on 91 of 96 tokens (2026-12-06)."""
    from dsmesh.bench.checkpoint import write_random_checkpoint

    path = write_random_checkpoint("tiny-v3", tmp_path / "tiny-v3", device="cpu")
    # the toy experts (32 x 64) are not whole 128-blocks: they load dense
    config = EngineConfig(
        model=str(path), device="cuda", max_total_tokens=4096, fp8_experts=False,
        fp8_linears=True,
    )  # fmt: skip
    engine = LLMEngine(config)
    backends = {m.backend for m in _fp8_modules(engine.model).values()}
    assert len(backends) == 1 and backends <= {"triton", "deep_gemm"}  # deep_gemm: Triton here
    prompts = random_prompts([5, 33, 100], 512, seed=11)
    ids = {engine.add_request(p, SamplingParams(max_new_tokens=32, ignore_eos=True)): i
           for i, p in enumerate(prompts)}  # fmt: skip
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[ids[o.request_id]].extend(o.new_token_ids)
    cpu = load_model(path, fp8_linears=True)
    agree = total = 0
    for i, prompt in enumerate(prompts):
        logits = prefill_logits(cpu, [prompt + out[i]])[0][len(prompt) - 1 : -1]
        agree += int((logits.argmax(-1) == torch.tensor(out[i])).sum())
        total += len(out[i])
    assert total == 96 and agree >= 0.85 * total, (agree, total)
