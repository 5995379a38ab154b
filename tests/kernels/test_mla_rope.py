"""The fused MLA decode preparation (q rope in place, latent RMSNorm, k rope, cache write) equals
its torch reference, and the reference equals the engine's own sequence of modules (RotaryEmbedding,
RMSNorm, MLAKVPool.write) as the decode graph runs it; the same for its FP8 page format variant
(per-token e4m3 codes and scales, --kv-cache-dtype fp8_e4m3)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.config import RopeConfig
from dsmesh.engine.model.norm import RMSNorm
from dsmesh.engine.model.rope import RotaryEmbedding
from dsmesh.kernels.mla_rope import (
    mla_decode_prep,
    mla_decode_prep_fp8,
    mla_decode_prep_fp8_ref,
    mla_decode_prep_ref,
)
from tests.kernels.conftest import needs_cuda, needs_triton
from tests.kernels.test_norm import assert_close_ulp

EPS = 1e-6
LAYER = 1


@dataclass
class Case:
    q: torch.Tensor
    kv_a: torch.Tensor
    norm: RMSNorm
    rotary: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor
    pool: MLAKVPool
    slots: torch.Tensor
    nope: int
    rope: int
    lora: int

    def flat(self) -> torch.Tensor:
        """The pool's [num_slots, lora + rope] view of ``LAYER`` (what the engine passes)."""
        return self.pool.buffer[LAYER].view(-1, self.pool.kv_dim)

    def prep_args(self, q: torch.Tensor, flat: torch.Tensor) -> tuple:
        return (q, self.kv_a, self.norm.weight, self.norm.eps, self.cos, self.sin, flat,
                self.slots, self.rotary.interleave, self.nope, self.rope, self.lora)  # fmt: skip


def make_case(t, heads, nope, rope, lora, dtype, device, interleave, pad=0, seed=0) -> Case:
    """Decode rows at scattered positions and slots; ``pad`` > 0 makes q and kv_a strided views
    (as the projections' outputs are split in the engine)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, nope + rope + pad, generator=g).to(dtype).to(device)
    q = q[..., : nope + rope]
    kv_a = torch.randn(t, lora + rope + pad, generator=g) * torch.logspace(-1, 1, t)[:, None]
    kv_a = kv_a.to(dtype).to(device)[:, : lora + rope]
    norm = RMSNorm(lora, EPS).to(device, dtype).requires_grad_(False)
    norm.weight.copy_(torch.rand(lora, generator=g) * 2 - 0.5)
    cfg = RopeConfig(scaling="yarn", factor=4.0, mscale_all_dim=0.5, interleave=interleave)
    rotary = RotaryEmbedding(cfg, rope).to(device)
    positions = torch.randint(0, 20000, (t,), generator=g).to(device)
    cos, sin = rotary.cos_sin(positions, dtype)
    pool = MLAKVPool(2, num_pages=5, page_size=4, kv_dim=lora + rope, dtype=dtype, device=device)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g))
    slots = torch.randperm(20, generator=g)[:t].to(device)
    return Case(q, kv_a, norm, rotary, cos, sin, pool, slots, nope, rope, lora)


def engine_sequence(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """What dsmesh.engine.runner.cuda_graph's ``_attention`` does with the modules -> (q_pe, cache
    rows)."""
    q_pe = c.rotary(c.q[..., c.nope :], c.cos, c.sin).contiguous()
    latent, k_pe = c.kv_a.split([c.lora, c.rope], -1)
    latent = c.norm(latent)
    k_pe = c.rotary(k_pe, c.cos, c.sin)
    pool = MLAKVPool(2, c.pool.num_pages, c.pool.page_size, c.pool.kv_dim, c.pool.buffer.dtype)
    pool.write(LAYER, c.slots.cpu(), torch.cat([latent, k_pe], dim=-1).cpu())
    return q_pe, pool.read(LAYER, c.slots.cpu())


def run_both(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, cache) after the kernel and after the reference, each from the same start."""
    q_ref, flat_ref = c.q.clone(), c.flat().clone()
    mla_decode_prep_ref(*c.prep_args(q_ref, flat_ref))
    mla_decode_prep(*c.prep_args(c.q, c.flat()))
    return c.q, c.flat(), q_ref, flat_ref


def check(c: Case, q, flat, q_ref, flat_ref, start: torch.Tensor) -> None:
    assert torch.equal(q.cpu(), q_ref.cpu())  # the rope channels, bit for bit
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[c.slots.cpu()] = True
    assert torch.equal(flat.cpu()[~written], start[~written])  # other slots untouched
    rows, rows_ref = flat.cpu()[c.slots.cpu()], flat_ref.cpu()[c.slots.cpu()]
    assert torch.equal(rows[:, c.lora :], rows_ref[:, c.lora :])  # k_pe, bit for bit
    assert_close_ulp(rows[:, : c.lora], rows_ref[:, : c.lora])  # the normalised latent


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_engine_modules(dtype, interleave) -> None:
    c = make_case(3, 4, 16, 16, 64, dtype, "cpu", interleave, pad=8)
    q_pe, rows = engine_sequence(c)
    q_ref, flat_ref = c.q.clone(), c.flat().clone()
    mla_decode_prep_ref(*c.prep_args(q_ref, flat_ref))
    assert torch.equal(q_ref[..., c.nope :], q_pe)
    assert torch.equal(q_ref[..., : c.nope], c.q[..., : c.nope])  # nope channels untouched
    assert torch.equal(flat_ref[c.slots], rows)
    assert not torch.equal(q_ref, c.q) and not torch.equal(flat_ref, c.flat())


@needs_triton
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [0, 8])
def test_kernel_equals_reference(pad, dtype, interleave, device) -> None:
    c = make_case(3, 4, 16, 16, 64, dtype, device, interleave, pad=pad, seed=1)
    start = c.flat().cpu().clone()
    check(c, *run_both(c), start)


@needs_triton
@pytest.mark.parametrize(
    ("t", "heads", "nope", "rope", "lora"),
    [(2, 2, 128, 64, 512), (2, 20, 8, 16, 64)],  # real MLA dims; heads over two blocks
)
def test_kernel_real_dims_and_head_blocks(t, heads, nope, rope, lora, device) -> None:
    c = make_case(t, heads, nope, rope, lora, torch.bfloat16, device, True, seed=2)
    start = c.flat().cpu().clone()
    check(c, *run_both(c), start)


@needs_triton
def test_kernel_float32_cos_and_weight_with_bf16_activations(device) -> None:
    """torch promotes to float32 where cos/sin or the norm weight are float32; so does the
    kernel, rounding once to bf16 where torch writes q and the cache."""
    c = make_case(3, 4, 16, 16, 64, torch.bfloat16, device, True, seed=3)
    ang = torch.rand(3, 8, generator=torch.Generator().manual_seed(4)).to(device) * 6
    c.cos, c.sin = ang.cos(), ang.sin()
    c.norm.float()
    start = c.flat().cpu().clone()
    check(c, *run_both(c), start)


@needs_triton
def test_bad_shapes_name_the_argument(device) -> None:
    c = make_case(2, 2, 8, 16, 32, torch.float32, device, True)
    flat = c.flat()

    def call(**change):
        args = dict(zip(("q", "kv_a", "norm_weight", "eps", "cos", "sin", "kv_cache_flat",
                         "slots", "interleave", "nope_dim", "rope_dim", "kv_lora_rank"),
                        c.prep_args(c.q, flat), strict=True))  # fmt: skip
        mla_decode_prep(**{**args, **change})

    with pytest.raises(ValueError, match="^q must be"):
        call(q=c.q[..., :-2])
    with pytest.raises(ValueError, match="^kv_a must be"):
        call(kv_a=c.kv_a[:1])
    with pytest.raises(ValueError, match="^norm_weight must be"):
        call(norm_weight=c.norm.weight[:8])
    with pytest.raises(ValueError, match="^cos must be"):
        call(cos=c.cos[:, :4])
    with pytest.raises(ValueError, match="^slots must be"):
        call(slots=c.slots.float())
    with pytest.raises(ValueError, match="^kv_cache_flat must be"):
        call(kv_cache_flat=flat[:, :-1])
    with pytest.raises(ValueError, match="^rope_dim must be even"):
        call(rope_dim=15)
    with pytest.raises(ValueError, match="^kv_a dtype"):
        call(kv_a=c.kv_a.double())
    with pytest.raises(ValueError, match="^q must be dense"):
        call(q=c.q.transpose(1, 2).contiguous().transpose(1, 2))
    call(slots=c.slots[:0], q=c.q[:0], kv_a=c.kv_a[:0], cos=c.cos[:0], sin=c.sin[:0])


@needs_cuda
@needs_triton
def test_kernel_in_a_cuda_graph() -> None:
    """Captured once, replayed with new rows, positions and slots: equals the reference."""
    c = make_case(4, 16, 128, 64, 512, torch.bfloat16, "cuda", True, seed=5)
    mla_decode_prep(*c.prep_args(c.q.clone(), c.flat().clone()))  # compile outside capture
    flat = c.flat()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_prep(*c.prep_args(c.q, flat))
    for seed in (6, 7):
        new = make_case(4, 16, 128, 64, 512, torch.bfloat16, "cuda", True, seed=seed)
        for mine, theirs in ((c.q, new.q), (c.kv_a, new.kv_a), (c.cos, new.cos),
                             (c.sin, new.sin), (c.slots, new.slots)):  # fmt: skip
            mine.copy_(theirs)
        q_ref, flat_ref = c.q.clone(), flat.clone()
        mla_decode_prep_ref(*c.prep_args(q_ref, flat_ref))
        start = flat.cpu().clone()
        graph.replay()
        torch.cuda.synchronize()
        check(c, c.q, flat, q_ref, flat_ref, start)


# ---- the FP8 page format (--kv-cache-dtype fp8_e4m3) ---------------------------------------


def fp8_pool(c: Case, device, seed: int = 0) -> MLAKVPool:
    """An FP8 pool of ``c``'s geometry, every slot of both layers holding random tokens."""
    pool = MLAKVPool(
        2, c.pool.num_pages, c.pool.page_size, c.pool.kv_dim, torch.float8_e4m3fn, device, c.lora
    )
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(pool.num_pages * pool.page_size)
    for layer in range(2):
        kv = torch.randn(len(slots), pool.kv_dim, generator=g).to(device)
        pool.write(layer, slots.to(device), kv)
    return pool


def fp8_args(c: Case, q: torch.Tensor, pool: MLAKVPool) -> tuple:
    kv, scales = pool.layer_pages(LAYER)
    return (q, c.kv_a, c.norm.weight, c.norm.eps, c.cos, c.sin, kv, scales, c.slots,
            c.rotary.interleave, c.nope, c.rope, c.lora)  # fmt: skip


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_reference_equals_engine_modules(dtype, interleave) -> None:
    """The FP8 reference stores what the engine's modules and an FP8 pool's ``write`` store."""
    c = make_case(3, 4, 16, 16, 64, dtype, "cpu", interleave, pad=8)
    q_pe, _ = engine_sequence(c)
    latent, k_pe = c.kv_a.split([c.lora, c.rope], -1)
    want = fp8_pool(c, "cpu")
    want.write(LAYER, c.slots, torch.cat([c.norm(latent), c.rotary(k_pe, c.cos, c.sin)], -1))
    got = fp8_pool(c, "cpu")
    q_ref = c.q.clone()
    mla_decode_prep_fp8_ref(*fp8_args(c, q_ref, got))
    assert torch.equal(q_ref[..., c.nope :], q_pe)
    assert torch.equal(got.buffer, want.buffer)  # codes and scales, byte for byte
    assert not torch.equal(got.buffer, fp8_pool(c, "cpu").buffer)


def check_fp8(c: Case, q, pool: MLAKVPool, q_ref, ref: MLAKVPool, start: torch.Tensor) -> None:
    """Rope channels bit for bit; the slots' codes equal the reference's (the rope key's bit
    for bit, the latent's up to neighbours: its norm is a few ulp from torch's), their
    scales equal (the latent's to the norm's ulps); every other byte of the pool untouched.
    The kernel rounds to e4m3 by arithmetic, so this holds in Triton's interpreter too."""
    assert torch.equal(q.cpu(), q_ref.cpu())
    ps, slots = pool.page_size, c.slots.cpu()
    at = (slots // ps, slots % ps)
    kv, scales = (x.cpu() for x in pool.layer_pages(LAYER))
    kv_ref, scales_ref = (x.cpu() for x in ref.layer_pages(LAYER))
    rope_codes, rope_ref = kv[at][:, c.lora :], kv_ref[at][:, c.lora :]
    assert torch.equal(rope_codes.view(torch.uint8), rope_ref.view(torch.uint8))
    lat, lat_ref = kv[at][:, : c.lora].view(torch.uint8), kv_ref[at][:, : c.lora].view(torch.uint8)
    assert int((lat.int() - lat_ref.int()).abs().max()) <= 1  # equal, or neighbouring codes
    assert torch.equal(scales[at][:, 1], scales_ref[at][:, 1])
    rtol = 1e-5 if c.q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(scales[at][:, 0], scales_ref[at][:, 0], rtol=rtol, atol=0)
    written = torch.zeros(pool.num_pages, ps, dtype=torch.bool)
    written[at] = True
    after = pool.buffer.cpu()
    codes, start_codes = pool.kv.view(torch.uint8).cpu(), start[..., : ps * pool.kv_dim]
    start_codes = start_codes.view(2, pool.num_pages, ps, pool.kv_dim)
    assert torch.equal(codes[0], start_codes[0]) and torch.equal(after[0], start[0])
    assert torch.equal(codes[LAYER][~written], start_codes[LAYER][~written])
    start_scales = start[..., ps * pool.kv_dim :].view(torch.float32).view(2, -1, ps, 2)
    assert torch.equal(pool.scales.cpu()[LAYER][~written], start_scales[LAYER][~written])


def run_both_fp8(c: Case, device) -> tuple:
    pool, ref = fp8_pool(c, device), fp8_pool(c, device)
    start = pool.buffer.cpu().clone()
    q_ref = c.q.clone()
    mla_decode_prep_fp8_ref(*fp8_args(c, q_ref, ref))
    mla_decode_prep_fp8(*fp8_args(c, c.q, pool))
    return c.q, pool, q_ref, ref, start


@needs_triton
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [0, 8])
def test_fp8_kernel_equals_reference(pad, dtype, interleave, device) -> None:
    c = make_case(3, 4, 16, 16, 64, dtype, device, interleave, pad=pad, seed=1)
    check_fp8(c, *run_both_fp8(c, device))


@needs_triton
def test_fp8_kernel_real_dims_and_page_size(device) -> None:
    """DeepSeek's latent (512 + 64), 20 heads over two blocks, slots spread over pages."""
    c = make_case(3, 20, 128, 64, 512, torch.bfloat16, device, True, seed=2)
    check_fp8(c, *run_both_fp8(c, device))


@needs_triton
def test_fp8_bad_arguments_name_the_argument(device) -> None:
    c = make_case(2, 2, 8, 16, 32, torch.float32, device, True)
    pool = fp8_pool(c, device)
    kv, scales = pool.layer_pages(LAYER)
    args = list(fp8_args(c, c.q, pool))
    with pytest.raises(ValueError, match="^kv_pages must be"):
        mla_decode_prep_fp8(*args[:6], kv.float(), *args[7:])
    with pytest.raises(ValueError, match="^kv_scales must be"):
        mla_decode_prep_fp8(*args[:7], scales[..., :1], *args[8:])
    with pytest.raises(ValueError, match="^q must be"):
        mla_decode_prep_fp8(c.q[..., :-2], *args[1:])


@needs_cuda
@needs_triton
def test_fp8_kernel_in_a_cuda_graph() -> None:
    """Captured once, replayed with new rows, positions and slots: equals the reference."""
    c = make_case(4, 16, 128, 64, 512, torch.bfloat16, "cuda", True, seed=5)
    pool = fp8_pool(c, "cuda")
    mla_decode_prep_fp8(*fp8_args(c, c.q.clone(), fp8_pool(c, "cuda")))  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_prep_fp8(*fp8_args(c, c.q, pool))
    for seed in (6, 7):
        new = make_case(4, 16, 128, 64, 512, torch.bfloat16, "cuda", True, seed=seed)
        for mine, theirs in ((c.q, new.q), (c.kv_a, new.kv_a), (c.cos, new.cos),
                             (c.sin, new.sin), (c.slots, new.slots)):  # fmt: skip
            mine.copy_(theirs)
        ref = fp8_pool(c, "cuda")
        ref.buffer.copy_(pool.buffer)
        q_ref = c.q.clone()
        mla_decode_prep_fp8_ref(*fp8_args(c, q_ref, ref))
        start = pool.buffer.cpu().clone()
        graph.replay()
        torch.cuda.synchronize()
        check_fp8(c, c.q, pool, q_ref, ref, start)
