"""CUDA graphs of the model's own decode forward (dsmesh/engine/runner/cuda_graph.py).

On CPU the runner's forward over its fixed buffers runs without capture: its logits must
equal the eager ForwardBatch path, and the engine's greedy tokens through it must equal the
eager engine and transformers, with the torch references and with the GPU's fused kernels
(in Triton's interpreter). On a GPU the same scenarios replay real CUDA graphs (float32:
torch attention, masked experts) and, in bfloat16, the Triton MLA decode kernel with the
fused MoE.
The scenario has padded batch buckets, requests joining and leaving between steps, and
contexts that cross page buckets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.mla_decode_backend import make_decode_backend
from dsmesh.engine.model.moe import DenseMLP
from dsmesh.engine.model.moe_dispatch import LocalDispatcher
from dsmesh.engine.runner.cuda_graph import (
    CudaGraphRunner,
    GraphCaptureError,
    graph_support_problem,
)
from dsmesh.engine.runner.graph_buckets import batch_buckets, bucket_for, page_bucket
from dsmesh.engine.sampling.params import SamplingParams
from tests.engine.hf_checkpoints import HFCheckpoint, random_prompts, relative_error

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Seven requests: lengths cross page boundaries (page size 8), max_new differs so requests
# leave at different steps; three join later (see _scenario).
LENGTHS = [1, 5, 17, 33, 8, 64, 100]
MAX_NEW = [16, 3, 9, 16, 5, 12, 7]
JOIN_AT = {4: 2, 5: 2, 6: 5}  # request index -> step after which it is added


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(256)[-3:] == [64, 128, 256]
    assert [bucket_for(n, batch_buckets(256)) for n in (1, 3, 5, 129)] == [1, 4, 8, 256]
    with pytest.raises(ValueError):
        bucket_for(7, [1, 2, 4])
    assert [page_bucket(n, 100) for n in (1, 3, 64, 65, 100)] == [1, 4, 64, 100, 100]
    # short contexts share the smallest table
    assert [page_bucket(n, 100, 16) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 100]
    assert page_bucket(3, 8, 16) == 8
    with pytest.raises(ValueError):
        page_bucket(101, 100)


def test_host_sized_dispatchers_are_refused_with_a_reason(v3_ckpt: HFCheckpoint) -> None:
    """A dispatcher whose collectives are sized on the host (all-to-all with per-step
    splits) cannot be captured: the engine then runs decode eagerly instead of failing."""

    class HostSized(LocalDispatcher):
        capturable = False

    model = load_model(v3_ckpt.path)
    assert graph_support_problem(model) is None
    model.moe_layers()[0].dispatcher = HostSized(4)
    assert "dispatcher HostSized" in (graph_support_problem(model) or "")
    cfg = model.config
    pool = MLAKVPool(cfg.num_hidden_layers, 8, 4, cfg.mla.kv_cache_dim, torch.float32)
    with pytest.raises(ValueError, match="dispatcher HostSized"):
        CudaGraphRunner(model, pool, max_batch=2, max_tokens_per_request=32)


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
def test_gate_and_up_share_one_weight(request, ckpt_name: str) -> None:
    """At load, each dense MLP's (dense layers and shared experts) gate and up weights move
    into one tensor for one GEMM; the modules keep views with the checkpoint's values, the
    output equals the two-GEMM forward, and choosing kernels again keeps the weight."""
    ckpt = request.getfixturevalue(ckpt_name)
    model = load_model(ckpt.path)
    hf = ckpt.hf_model.state_dict()
    mlps = {n: m for n, m in model.named_modules() if isinstance(m, DenseMLP)}
    assert any(n.endswith("shared_experts") for n in mlps) and any(n.endswith(".mlp") for n in mlps)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name, mlp in mlps.items():
        weight = mlp.gate_up_weight
        assert weight is not None
        split = mlp.gate_proj.weight.shape[0]
        assert torch.equal(weight[:split], hf[f"{name}.gate_proj.weight"])
        assert torch.equal(weight[split:], hf[f"{name}.up_proj.weight"])
        assert mlp.gate_proj.weight.data_ptr() == weight.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == weight[split:].data_ptr()
        two_gemms = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), two_gemms, rtol=1e-6, atol=1e-6)
    model.set_kernels(KernelChoice.reference())
    assert all(m.gate_up_weight is mlps[n].gate_up_weight for n, m in mlps.items())


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
def test_input_projections_share_one_weight(request, ckpt_name: str, tmp_path) -> None:
    """At load, q (V2: q_proj, V3: q_a_proj) and kv_a weights move into one tensor for one
    GEMM; the modules keep views with the checkpoint's values, and saving still works."""
    ckpt = request.getfixturevalue(ckpt_name)
    model = load_model(ckpt.path)
    hf = ckpt.hf_model.state_dict()
    for attn in (layer.self_attn for layer in model.model.layers):
        prefix = f"model.layers.{attn.layer_idx}.self_attn."
        q = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
        q_name = "q_proj" if attn.q_lora_rank is None else "q_a_proj"
        weight = attn.fused_input_weight
        assert weight is not None
        split = q.weight.shape[0]
        assert torch.equal(weight[:split], hf[prefix + q_name + ".weight"])
        assert torch.equal(weight[split:], hf[prefix + "kv_a_proj_with_mqa.weight"])
        assert q.weight.data_ptr() == weight.data_ptr()
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == weight[split:].data_ptr()
    model.set_kernels(KernelChoice.reference())  # choosing again keeps the fused weight
    assert model.model.layers[-1].self_attn.fused_input_weight is weight
    # Saving the model still works: the views do not overlap, which safetensors accepts.
    from dsmesh.engine.model.weights import official_state_dict, save_checkpoint_weights

    save_checkpoint_weights(official_state_dict(model), tmp_path)
    assert (tmp_path / "model.safetensors").stat().st_size > 0


def test_redundant_experts_and_swaps_in_the_captured_forward(v3_ckpt: HFCheckpoint) -> None:
    """Redundant replicas are chosen on the device, so the runner's forward takes them; a
    new placement is copied into the same device tables (captured graphs read it)."""
    from dsmesh.engine.model.expert_location import ExpertLocation

    cfg = load_model(v3_ckpt.path).config
    n_moe, n_exp = len(cfg.moe_layer_ids), cfg.moe.n_routed_experts
    p2l = torch.cat([torch.arange(n_exp), torch.arange(2)]).repeat(n_moe, 1)
    location = ExpertLocation.from_physical_to_logical(p2l, n_exp)
    plain = load_model(v3_ckpt.path)
    model = load_model(v3_ckpt.path, expert_location=location)
    for moe in model.moe_layers():  # replicas carry the same weights as their experts
        for phys, logical in enumerate(p2l[0].tolist()):
            src = plain.moe_layers()[moe.moe_layer_idx].experts
            moe.experts.w13.data[phys] = src.w13[logical]
            moe.experts.w2.data[phys] = src.w2[logical]
    assert graph_support_problem(model) is None
    table = model.moe_layers()[0].expert_map.table
    assert table.shape == (n_exp, 3) and table[0].tolist() == [0, n_exp, -1]
    page_size, steps = 4, 3
    prompts = random_prompts([3, 9, 14], cfg.vocab_size, seed=3)
    pool, pages, first = _prefilled(plain, prompts, page_size, steps)
    fed, eager = _eager_decode(plain, pool, prompts, pages, first, page_size, steps)
    runner = CudaGraphRunner(model, pool, max_batch=4, max_tokens_per_request=32, use_graphs=False)
    for e, s in zip(eager, _static_decode(runner, prompts, pages, fed), strict=True):
        assert relative_error(s, e) < 1e-5
    swapped = torch.cat([torch.arange(n_exp), torch.tensor([3, 4])]).repeat(n_moe, 1)
    for moe in model.moe_layers():
        moe.location = ExpertLocation.from_physical_to_logical(swapped, n_exp)
    assert model.moe_layers()[0].expert_map.table is table  # updated in place
    assert table[0].tolist() == [0, -1, -1] and table[3].tolist() == [3, n_exp, -1]


def _prefilled(model, prompts, page_size, max_new):
    """Pool and page lists with every prompt prefilled (eagerly); returns next tokens too."""
    cfg = model.config
    need = [pages_for(len(p) + max_new, page_size) for p in prompts]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    pool = MLAKVPool(
        cfg.num_hidden_layers, sum(need) + 4, page_size, cfg.mla.kv_cache_dim, dtype, device
    )
    pool.allocator.allocate(4)  # pages other requests own: never touched
    pages = [pool.allocator.allocate(n) for n in need]
    chunks = [SequenceChunk(p, 0, torch.tensor(pg)) for p, pg in zip(prompts, pages, strict=True)]
    logits = model(ForwardBatch.build(chunks, page_size, device), pool)
    return pool, pages, logits.argmax(-1).tolist()


def _eager_decode(model, pool, prompts, pages, tokens, page_size, steps):
    """Greedy decode of all rows together on the eager path: (tokens fed, logits) per step."""
    fed, out = [], []
    lens = [len(p) for p in prompts]
    device = next(model.parameters()).device
    for _ in range(steps):
        chunks = [
            SequenceChunk([t], n, torch.tensor(pg))
            for t, n, pg in zip(tokens, lens, pages, strict=True)
        ]
        logits = model(ForwardBatch.build(chunks, page_size, device), pool)
        fed.append(tokens)
        out.append(logits.cpu())
        tokens = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    return fed, out


def _static_decode(runner, prompts, pages, fed):
    """The same steps through the runner, fed the eager path's tokens (teacher forcing), so
    a rounding-level difference cannot change later inputs."""
    out = []
    lens = [len(p) for p in prompts]
    for tokens in fed:
        out.append(runner.run(tokens, lens, pages).clone().cpu())
        lens = [n + 1 for n in lens]
    return out


def _set_kernels(model, kernels: KernelChoice, pool: MLAKVPool) -> None:
    attn = model.model.layers[0].self_attn
    name = kernels.decode_attention
    shape = (attn.num_heads, attn.kv_lora_rank, attn.rope_dim, attn.scale)
    backend = make_decode_backend(
        name, name, pool.buffer.device, shape, pool.buffer.dtype, pool.page_size, 16
    )
    model.set_kernels(kernels, backend)


def _static_vs_eager(
    ckpt: HFCheckpoint,
    device: str,
    dtype: torch.dtype,
    kernels: KernelChoice | None = None,
    compare_uncaptured: bool = False,
    **runner_kw,
):
    """Five rows (bucket 8: three padding rows), contexts crossing page buckets; with
    ``compare_uncaptured`` also the same runner settings without graphs. ``kernels``
    replaces load_model's choice for the eager steps and the runner alike."""
    uncaptured = compare_uncaptured
    page_size, steps = 4, 6
    model = load_model(ckpt.path, dtype, device)
    prompts = random_prompts([1, 3, 6, 13, 30], model.config.vocab_size, seed=5)
    pool, pages, first = _prefilled(model, prompts, page_size, steps)
    if kernels is not None:
        _set_kernels(model, kernels, pool)
    fed, eager = _eager_decode(model, pool, prompts, pages, first, page_size, steps)
    # Same pool, same pages, same tokens: the static path rewrites (up to rounding) the KV
    # values the eager path wrote, then reads them.
    runner = CudaGraphRunner(model, pool, max_batch=8, max_tokens_per_request=64, **runner_kw)
    static = _static_decode(runner, prompts, pages, fed)
    # Padding rows wrote nothing outside the requests' pages: pages 0-3 belong to others.
    assert not bool(pool.buffer[:, :4].any())
    if uncaptured:
        kw = dict(runner_kw, use_graphs=False)
        plain = CudaGraphRunner(model, pool, max_batch=8, max_tokens_per_request=64, **kw)
        return runner, eager, static, _static_decode(plain, prompts, pages, fed)
    return runner, eager, static


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
def test_static_forward_equals_eager_on_cpu(request, ckpt_name: str) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    runner, eager, static = _static_vs_eager(ckpt, "cpu", torch.float32, use_graphs=False)
    assert runner.num_eager == len(eager) and runner.num_replays == 0
    assert runner.attention_backend == "torch"
    for step, (e, s) in enumerate(zip(eager, static, strict=True)):
        assert s.shape == e.shape == (5, ckpt.hf_model.config.vocab_size)
        assert relative_error(s, e) < 1e-5, step


def _scenario(engine: LLMEngine, vocab: int) -> dict[int, list[int]]:
    """Requests join after steps 2 and 5 and leave at their own max_new_tokens."""
    prompts = random_prompts(LENGTHS, vocab, seed=7)
    ids: dict[str, int] = {}
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def add(i: int) -> None:
        params = SamplingParams(max_new_tokens=MAX_NEW[i], ignore_eos=True)
        ids[engine.add_request(prompts[i], params)] = i

    for i in range(len(prompts)):
        if i not in JOIN_AT:
            add(i)
    step = 0
    while engine.has_unfinished() or len(ids) < len(prompts):
        for o in engine.step():
            out[ids[o.request_id]].extend(o.new_token_ids)
        step += 1
        for i, at in JOIN_AT.items():
            if at == step:
                add(i)
    assert engine.num_pages_in_use == 0
    return out


def _engine(ckpt: HFCheckpoint, device: str, dtype: str = "float32", **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(ckpt.path),
            device=device,
            dtype=dtype,
            page_size=8,
            max_total_tokens=4096,
            max_batch_tokens=64,  # the 100-token prompt is prefilled in two chunks
            **kw,
        )
    )


def _assert_matches_transformers(ckpt: HFCheckpoint, out: dict[int, list[int]]) -> None:
    prompts = random_prompts(LENGTHS, ckpt.hf_model.config.vocab_size, seed=7)
    eos = ckpt.hf_model.config.eos_token_id
    for i, prompt in enumerate(prompts):
        ref = ckpt.hf_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW[i], pad_token_id=eos
        )[0, len(prompt) :].tolist()
        assert len(ref) == MAX_NEW[i] or ref[-1] == eos
        assert out[i][: len(ref)] == ref, f"request {i}"


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
@pytest.mark.parametrize(("overlap", "split"), [(False, True), (True, True), (False, False)])
def test_engine_static_decode_matches_eager_and_transformers_on_cpu(
    request, ckpt_name: str, overlap: bool, split: bool
) -> None:
    """With ``overlap`` the engine launches greedy decode steps ahead (fed the previous
    step's tokens on the device) while requests join and leave; with ``split`` the steps
    that mix decode rows and prompt chunks run the decode rows through the runner and the
    chunks eagerly. The tokens must not move."""
    ckpt = request.getfixturevalue(ckpt_name)
    vocab = ckpt.hf_model.config.vocab_size
    eager = _scenario(_engine(ckpt, "cpu"), vocab)
    engine = _engine(ckpt, "cpu", overlap_decode=overlap, split_mixed_steps=split)
    assert engine.graph_runner is None  # CPU: cuda_graphs is ignored
    # The CUDA path's runner, without graphs, so CPU CI checks its integration too.
    engine.graph_runner = CudaGraphRunner(
        engine.model, engine.kv_pool, max_batch=8, max_tokens_per_request=512, use_graphs=False
    )
    static = _scenario(engine, vocab)
    assert engine.graph_runner.num_eager > 10
    # Requests join at steps 2 and 5 while others decode: those steps are mixed.
    assert (engine.num_split_steps >= 2) if split else (engine.num_split_steps == 0)
    if overlap:
        assert engine.num_launched_ahead > 5
    else:
        assert engine.num_launched_ahead == 0
        # Decode steps of 1..7 rows: padded buckets (3 -> 4, 5..7 -> 8), two page buckets.
        assert {b for b, _ in engine.graph_runner.keys_used} >= {2, 4, 8}
        assert len({p for _, p in engine.graph_runner.keys_used}) >= 2
    assert static == eager
    assert [len(static[i]) for i in range(len(LENGTHS))] == MAX_NEW
    _assert_matches_transformers(ckpt, static)


def _count_splits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records (rows, split row) of every decode-only batch split into micro-batches."""
    splits: list[tuple[int, int]] = []
    split_rows = ForwardBatch.split_rows

    def counted(batch: ForwardBatch, n: int) -> tuple[ForwardBatch, ForwardBatch]:
        splits.append((batch.num_tokens, n))
        return split_rows(batch, n)

    monkeypatch.setattr(ForwardBatch, "split_rows", counted)
    return splits


def test_tbo_static_forward_equals_eager_on_cpu(v3_ckpt: HFCheckpoint, monkeypatch) -> None:
    """With ``tbo`` the runner's forward is two micro-batches of half the bucket each (five
    rows in bucket 8: rows 0-3, then row 4 and three padding rows), and equals the plain
    eager forward."""
    splits = _count_splits(monkeypatch)
    runner, eager, static = _static_vs_eager(
        v3_ckpt, "cpu", torch.float32, use_graphs=False, tbo=True
    )
    assert runner.tbo and splits == [(8, 4)] * len(eager)
    for step, (e, s) in enumerate(zip(eager, static, strict=True)):
        assert relative_error(s, e) < 1e-5, step
    # a one-row bucket has nothing to split: the plain forward
    runner.run([1], [3], [[4]])
    assert len(splits) == len(eager)


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
@pytest.mark.parametrize("overlap", [False, True])
def test_engine_tbo_decode_through_the_runner_on_cpu(
    request, monkeypatch, ckpt_name: str, overlap: bool
) -> None:
    """Two-batch overlap with decode steps through the runner (uncaptured, as the engine
    builds it on CUDA: ``tbo=True``): the greedy tokens of the engine without TBO, of the
    eager TBO engine and of transformers, requests joining and leaving."""
    ckpt = request.getfixturevalue(ckpt_name)
    vocab = ckpt.hf_model.config.vocab_size
    plain = _scenario(_engine(ckpt, "cpu"), vocab)
    assert _scenario(_engine(ckpt, "cpu", tbo=True), vocab) == plain
    engine = _engine(ckpt, "cpu", tbo=True, overlap_decode=overlap)
    engine.graph_runner = CudaGraphRunner(
        engine.model,
        engine.kv_pool,
        max_batch=8,
        max_tokens_per_request=512,
        use_graphs=False,
        tbo=True,
    )
    splits = _count_splits(monkeypatch)
    static = _scenario(engine, vocab)
    runs = engine.graph_runner.num_eager
    assert runs > 10 and engine.num_split_steps >= 2
    assert (engine.num_launched_ahead > 5) if overlap else (engine.num_launched_ahead == 0)
    # every runner forward (none here is a one-row bucket) ran as two micro-batches, split
    # at half its bucket
    assert len(splits) == runs and all(n == b // 2 for b, n in splits)
    assert static == plain
    _assert_matches_transformers(ckpt, static)


def test_engine_falls_back_to_eager_when_capture_fails(v2_greedy_ckpt: HFCheckpoint) -> None:
    """A capture failure (planted: CPU cannot capture) turns graphs off for the engine and the
    step runs eagerly; no request fails and the tokens are the eager engine's."""

    class FailingCapture(CudaGraphRunner):
        def run(self, *args, **kwargs):
            raise GraphCaptureError("planted capture failure")

    vocab = v2_greedy_ckpt.hf_model.config.vocab_size
    engine = _engine(v2_greedy_ckpt, "cpu")
    engine.graph_runner = FailingCapture(
        engine.model, engine.kv_pool, max_batch=8, max_tokens_per_request=512, use_graphs=False
    )
    out = _scenario(engine, vocab)
    assert engine.graph_runner is None
    assert out == _scenario(_engine(v2_greedy_ckpt, "cpu"), vocab)


# ---- GPU: real graphs ------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tbo", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
def test_cuda_graphs_greedy_equals_eager_and_transformers(
    request, ckpt_name: str, overlap: bool, tbo: bool
) -> None:
    """With ``tbo`` the graphs hold both micro-batches."""
    ckpt = request.getfixturevalue(ckpt_name)
    vocab = ckpt.hf_model.config.vocab_size
    eager = _scenario(_engine(ckpt, "cuda", cuda_graphs=False), vocab)
    engine = _engine(ckpt, "cuda", overlap_decode=overlap, tbo=tbo)
    runner = engine.graph_runner
    assert runner is not None and runner.use_graphs and runner.tbo == tbo
    graphs = _scenario(engine, vocab)
    assert runner.num_replays > 10
    assert runner.keys_used <= set(runner.graphs)  # most captured at start-up
    if overlap:
        assert engine.num_launched_ahead > 5
    else:
        assert {b for b, _ in runner.graphs} >= {2, 4, 8}
    assert graphs == eager
    _assert_matches_transformers(ckpt, graphs)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_cuda_graphs_bfloat16_logits_close_to_eager(v3_ckpt: HFCheckpoint, attention) -> None:
    """bfloat16: grouped experts (sm90) and the Triton MLA kernel or its torch reference inside
    the graph. Replays equal the same static forward run without capture; with the kernel
    (the eager path's own attention on CUDA) they also stay close to the eager logits. The
    torch reference rounds differently from the kernel, and in bfloat16 that can flip a
    near-tied expert choice of this tiny random model, so it is held to the eager path only
    in float32 (test_cuda_graphs_greedy_equals_eager_and_transformers)."""
    kernels = KernelChoice(triton=True, decode_attention=attention, fused_moe=True)
    runner, eager, static, plain = _static_vs_eager(
        v3_ckpt, "cuda", torch.bfloat16, kernels, compare_uncaptured=True
    )
    assert runner.use_graphs and runner.num_replays == len(eager)
    assert runner.attention_backend == attention
    for step, (p, s) in enumerate(zip(plain, static, strict=True)):
        assert relative_error(s, p) < 1e-2, step
    if attention == "triton":
        # Row by row: in bf16 a near-tied expert choice of this tiny random model can flip
        # for one row (seen: one row of 30 at 0.2 after a change of attention tile size,
        # the other rows at ~0.01); wrong wiring would move every row.
        pairs = zip(eager, static, strict=True)
        errs = [relative_error(s[i], e[i]) for e, s in pairs for i in range(len(s))]
        assert sum(err > 3e-2 for err in errs) <= 1, errs
        assert sorted(errs)[len(errs) // 2] < 1.5e-2, errs


@needs_cuda
@pytest.mark.gpu
def test_cuda_graphs_with_flashinfer_attention(v2_latent_ckpt: HFCheckpoint) -> None:
    """FlashInfer's MLA kernel (optional; DeepSeek's 512 + 64 latent) inside the graphs,
    re-planned on the host before every replay: replays equal the same runner without
    capture and stay close to the eager path."""
    from dsmesh.kernels.backends import available

    if not available("flashinfer"):
        pytest.skip("FlashInfer is not installed (pip install flashinfer-python)")
    ckpt = v2_latent_ckpt
    kernels = KernelChoice(triton=True, decode_attention="flashinfer", fused_moe=True)
    runner, eager, static, plain = _static_vs_eager(
        ckpt, "cuda", torch.bfloat16, kernels, compare_uncaptured=True
    )
    assert runner.attention_backend == "flashinfer" and runner.model.kernels.triton
    assert runner.use_graphs and runner.num_replays == len(eager)
    for step, (p, s) in enumerate(zip(plain, static, strict=True)):
        assert relative_error(s, p) < 1e-2, step
    pairs = zip(eager, static, strict=True)
    errs = [relative_error(s[i], e[i]) for e, s in pairs for i in range(len(s))]
    assert sorted(errs)[len(errs) // 2] < 1.5e-2, errs


@needs_cuda
@pytest.mark.gpu
def test_flashinfer_replans_race_free_with_overlapped_decode(
    v2_latent_ckpt: HFCheckpoint,
) -> None:
    """Overlapped decode plans step n + 1 while step n may still run; the plan's uploads are
    stream-ordered and its pinned staging buffer is not rewritten before its copy ran, so the
    tokens equal those of the same engine without overlap, exactly."""
    from dsmesh.kernels.backends import available

    if not available("flashinfer"):
        pytest.skip("FlashInfer is not installed (pip install flashinfer-python)")
    ckpt = v2_latent_ckpt
    outs = []
    for overlap in (False, True):
        engine = _engine(ckpt, "cuda", dtype="bfloat16", overlap_decode=overlap)
        assert engine.graph_runner.attention_backend == "flashinfer"  # "auto" picked it
        outs.append(_scenario(engine, ckpt.hf_model.config.vocab_size))
        assert engine.graph_runner.num_replays > 10
        if overlap:
            assert engine.num_launched_ahead > 5
    assert outs[0] == outs[1]


def test_kernel_choices_are_checked() -> None:
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        EngineConfig(decode_attention="fast").validate()
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(kernels="fast").validate()
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        EngineConfig(moe_backend="fast").validate()
    EngineConfig(decode_attention="flashinfer").validate()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="decode_attention='kernel' needs CUDA"):
        KernelChoice.resolve(cpu, torch.float32, decode_attention="kernel")
    with pytest.raises(ValueError, match="moe_backend='fused' needs"):
        KernelChoice.resolve(cpu, torch.bfloat16, moe_backend="fused")
    assert KernelChoice.resolve(cpu, torch.bfloat16) == KernelChoice.reference()
    with pytest.raises(ValueError, match="attention='flashinfer' needs CUDA"):
        make_decode_backend("flashinfer", "flashinfer", cpu, (4, 32, 16, 1.0), torch.float32, 4, 8)


@needs_cuda
@pytest.mark.gpu
def test_router_gemm_in_bfloat16_equals_the_float32_gate(v3_ckpt: HFCheckpoint) -> None:
    """With router weights a bf16 checkpoint can hold, the gate computes router logits with
    one bf16 GEMM into float32: exact products, float32 sums, as the float32 gate."""
    model = load_model(v3_ckpt.path, torch.bfloat16, "cuda")
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    for moe in moes:
        moe.gate.weight.data = moe.gate.weight.to(torch.bfloat16).float()
    moes[0].gate.weight.data[0, 0] += 1e-6  # not representable: this layer keeps the gate
    cfg = model.config
    model.set_kernels(model.kernels)  # the gates prepare their bf16 weight again
    assert moes[0].gate.low_weight is None
    x = torch.randn(5, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    for moe in moes[1:]:
        low = moe.gate.low_weight
        assert low is not None
        with torch.no_grad():
            got = moe.gate(x)
            want = torch.nn.functional.linear(x.float(), moe.gate.weight)
        assert got.dtype == torch.float32
        assert relative_error(got, want) < 1e-6


@needs_cuda
@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_inputs(v2_greedy_ckpt: HFCheckpoint) -> None:
    """One captured graph, two different steps of the same bucket: replay must follow the
    buffers (a graph frozen on its capture inputs would repeat the first logits)."""
    model = load_model(v2_greedy_ckpt.path, torch.float32, "cuda")
    prompts = random_prompts([9, 9], model.config.vocab_size, seed=11)
    pool, pages, first = _prefilled(model, prompts, 4, 2)
    runner = CudaGraphRunner(model, pool, max_batch=2, max_tokens_per_request=32)
    a = runner.run(first, [9, 9], pages).clone()
    b = runner.run([first[1], first[0]], [9, 9], pages[::-1]).clone()
    assert len(runner.graphs) == 1 and runner.num_replays == 2
    torch.testing.assert_close(b, a.flip(0))
    assert relative_error(a[0], a[1]) > 1e-3  # the two rows really differ


@pytest.mark.parametrize("ckpt_name", ["v3_ckpt", "v2_greedy_ckpt"])
def test_fused_kernels_in_the_eager_and_captured_forward_equal_the_torch_path(
    request, ckpt_name
) -> None:
    """The bf16 GPU choice of kernels (fused residual-add norms, the one-launch rope and
    cache write, the Triton MLA decode and the fused MoE with shared experts) forced on the
    CPU in float32, where they run in Triton's interpreter: the model's eager decode steps
    and the runner's forward both take them (the same modules), and both equal the torch
    references. The GPU tests check the bf16 graphs themselves."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU tests (the engine picks these kernels itself there)")
    import tests.kernels.conftest  # noqa: F401 - patches Triton's interpreter for NumPy 2.4

    ckpt = request.getfixturevalue(ckpt_name)
    page_size, steps = 4, 3
    model = load_model(ckpt.path)
    prompts = random_prompts([1, 6, 13], model.config.vocab_size, seed=9)
    pool, pages, first = _prefilled(model, prompts, page_size, steps)
    fed, want = _eager_decode(model, pool, prompts, pages, first, page_size, steps)
    fused = KernelChoice(triton=True, decode_attention="triton", fused_moe=True)
    _set_kernels(model, fused, pool)
    runner = CudaGraphRunner(model, pool, max_batch=4, max_tokens_per_request=32)
    for got in (
        _eager_decode(model, pool, prompts, pages, first, page_size, steps)[1],
        _static_decode(runner, prompts, pages, fed),
    ):
        for g, w in zip(got, want, strict=True):
            assert relative_error(g, w) < 1e-5


@needs_cuda
@pytest.mark.gpu
def test_graphs_are_captured_at_start_up(v2_greedy_ckpt: HFCheckpoint) -> None:
    """Every batch bucket for contexts up to cuda_graph_warmup_tokens is captured when the
    engine starts, so serving short contexts captures nothing (no mid-request stall), and
    the tokens are the lazily captured engine's."""
    vocab = v2_greedy_ckpt.hf_model.config.vocab_size
    lazy = _engine(v2_greedy_ckpt, "cuda", cuda_graph_warmup_tokens=0)
    assert lazy.graph_runner is not None and lazy.graph_runner.graphs == {}
    expected = _scenario(lazy, vocab)
    engine = _engine(
        v2_greedy_ckpt,
        "cuda",
        cuda_graph_min_tokens=64,
        cuda_graph_warmup_tokens=256,
        cuda_graph_ready_batches=0,  # every batch bucket before ready
    )
    runner = engine.graph_runner
    assert runner is not None and runner.min_page_bucket == 8  # 64 tokens of page size 8
    # batch buckets 1..max x page buckets 8, 16, 32 (256 tokens)
    assert set(runner.graphs) == {(b, p) for b in runner.buckets for p in (8, 16, 32)}
    captured = dict(runner.graphs)
    assert _scenario(engine, vocab) == expected
    assert {k: v for k, v in runner.graphs.items() if k in captured} == captured
    assert runner.keys_used <= set(captured)  # every step replayed a start-up graph
