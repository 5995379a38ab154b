"""The offline engine on CUDA with plain torch ops (no custom kernels yet): same greedy tokens
as on the CPU in float32, and sane bfloat16. Skipped cleanly without a GPU; run on an
H200."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v3")


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (k,), generator=g).tolist() for k in (1, 5, 17, 40, 77, 100)[:n]]


def run(model_dir, device: str, dtype: str, **kw) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            page_size=16,
            max_total_tokens=8192,
            **kw,
        )
    )
    out = engine.generate(prompts(), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert engine.num_pages_in_use == 0
    return [r.output_ids for r in out]


def test_cuda_float32_greedy_equals_cpu(model_dir) -> None:
    assert run(model_dir, "cuda", "float32") == run(model_dir, "cpu", "float32")


def test_cuda_chunked_prefill_and_naive_attention(model_dir) -> None:
    ref = run(model_dir, "cuda", "float32")
    assert run(model_dir, "cuda", "float32", max_batch_tokens=7) == ref
    assert run(model_dir, "cuda", "float32", attention_mode="naive") == ref


def test_cuda_bfloat16_first_tokens_mostly_agree(model_dir) -> None:
    bf16 = run(model_dir, "cuda", "bfloat16")
    fp32 = run(model_dir, "cuda", "float32")
    first = sum(a[0] == b[0] for a, b in zip(bf16, fp32, strict=True))
    assert all(len(o) == 16 for o in bf16)
    assert first >= len(fp32) - 2, (bf16, fp32)
