"""The offline engine's configuration: runtime choices for one engine (the model's shape
comes from its checkpoint), validated before anything is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dsmesh.engine.kernel_choice import KERNEL_SETS, MOE_BACKENDS
from dsmesh.engine.kv_cache import KV_CACHE_DTYPES
from dsmesh.engine.mla import ATTENTION_MODES
from dsmesh.engine.mla_decode_backend import ATTENTION_BACKENDS
from dsmesh.engine.speculative import SPECULATIVE_METHODS


@dataclass(frozen=True)
class EngineConfig:
    """Runtime choices for one engine; the model's shape comes from its checkpoint."""

    model: str | None = None  # checkpoint folder; None = the embedded tiny default model
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    # KV pool capacity in tokens (rounded up to pages). None = not given: on CUDA sized from
    # ``mem_fraction`` once the weights are loaded, on CPU 65536 (dsmesh/engine/kv_budget.py).
    max_total_tokens: int | None = None
    # Fraction of the GPU's total memory this process may use for weights + KV pool; the
    # rest is left for activations, CUDA graphs and other processes. None = 0.85. Used only
    # on CUDA when max_total_tokens is None (``dsmesh up`` splits it between the processes
    # that share a GPU).
    mem_fraction: float | None = None
    # The KV cache's values: "auto" = the model's dtype; "fp8_e4m3" = e4m3 with two float32
    # scales per token inside each page, ~half the bytes per token (dsmesh/kernels/kv_fp8.py)
    kv_cache_dtype: str = "auto"
    max_running_requests: int = 64
    max_batch_tokens: int = 2048
    # While requests decode, new requests join the batch at most every admit_interval steps
    # (their prompt chunks then share one forward); 1 = every step (dsmesh/engine/scheduler.py).
    admit_interval: int = 1
    attention_mode: str = "auto"  # "auto" (naive prefill, absorbed decode) | "naive" | "absorbed"
    prefix_cache: bool = False  # share full prompt pages between requests with equal prefixes
    tbo: bool = False  # two-batch overlap: two micro-batches per forward (MoE comm overlap)
    # Decode-only steps replay CUDA graphs captured per batch bucket (CUDA only; ignored on
    # CPU and with attention_mode "naive"; with tbo the graphs hold both micro-batches; under
    # expert parallelism the ranks agree on each graph step, see join_group).
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256  # larger decode batches run eagerly
    # Decode graphs for every batch bucket and contexts up to this many tokens are captured
    # at start-up (the rest on first use, which stalls the running batch); 0 = all on first
    # use. Contexts up to cuda_graph_min_tokens share one page table.
    cuda_graph_warmup_tokens: int = 4096
    cuda_graph_min_tokens: int = 1024
    # MLA decode attention, in graphs and for eager decode rows: "auto" (FlashInfer where it
    # is installed and fits, else dsmesh's Triton kernel; dsmesh/engine/mla_decode_backend.py),
    # "kernel" (Triton), "flashinfer" (needs flashinfer-python) or "torch" (the reference)
    decode_attention: str = "auto"
    # "auto": dsmesh's Triton kernels for the glue, routing and prefill attention on CUDA;
    # "torch": the torch references everywhere (A/B runs). Chosen once at start
    # (dsmesh/engine/kernel_choice.py).
    kernels: str = "auto"
    # Decode-sized MoE: "auto"/"fused" (one fused kernel, bf16/fp16 on CUDA) or "grouped"
    moe_backend: str = "auto"
    # With CUDA graphs, a greedy decode step launches the next one (its input tokens taken
    # on the device) before its own bookkeeping, so host work overlaps the GPU. Only when
    # the next batch is certain to be the same requests (docs/GPU.md).
    overlap_decode: bool = True
    # Prefix cache evictions keep each prompt chunk's pages one run of consecutive pages
    # (SchedulerConfig.contiguous_prompts): set by the prefill and decode services, between
    # which the prompt's KV is copied a run per layer.
    contiguous_prompts: bool = False
    # A step that mixes decode rows with prompt chunks runs the decode rows as a CUDA graph
    # replay and only the prompt chunks eagerly (two forwards, the eager one launched while
    # the graph runs), instead of one eager forward over everything (docs/GPU.md).
    split_mixed_steps: bool = True
    # FP8 checkpoints: keep the routed experts in FP8 and run the FP8 grouped GEMM (CUDA);
    # off = dequantise every weight to ``dtype`` at load
    fp8_experts: bool = False
    # Speculative decoding (dsmesh/engine/speculative.py): None = off; "mtp" drafts with the
    # checkpoint's MTP layer num_draft_tokens tokens per step, verified in one target forward.
    # Decode batches above speculative_max_batch run plain steps (128: on one H200, K = 1
    # gains at every batch up to 128 at simulated acceptance 0.6 and 0.8, projected to V3's
    # 61 layers; docs/BENCHMARKS.md, dsmesh/bench/mtp.py).
    speculative: str | None = None
    num_draft_tokens: int = 1
    speculative_max_batch: int = 128
    # BENCHMARK ONLY (dsmesh/bench/mtp.py): accept each draft with this probability instead of
    # verifying it, emitting the target's tokens (random weights accept nothing); the output
    # is not the model's. None = real verification.
    spec_forced_acceptance: float | None = None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be auto or one of {sorted(dtypes)}, got {self.dtype!r}")
        return dtypes[self.dtype]

    def validate(self) -> None:
        if self.attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode must be one of {ATTENTION_MODES}")
        if self.decode_attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"decode_attention must be one of {ATTENTION_BACKENDS}, "
                f"got {self.decode_attention!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype != "auto" and self.decode_attention == "flashinfer":
            raise ValueError(
                f"--decode-attention flashinfer cannot read --kv-cache-dtype "
                f"{self.kv_cache_dtype} pages: use --decode-attention auto or kernel (Triton)"
            )
        if self.kernels not in KERNEL_SETS:
            raise ValueError(f"kernels must be one of {KERNEL_SETS}, got {self.kernels!r}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {self.moe_backend!r}")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be > 0, got {self.max_total_tokens}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        names = (
            "page_size",
            "max_running_requests",
            "max_batch_tokens",
            "admit_interval",
            "cuda_graph_max_batch",
            "cuda_graph_min_tokens",
        )
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cuda_graph_warmup_tokens < 0:
            raise ValueError(
                f"cuda_graph_warmup_tokens must be >= 0, got {self.cuda_graph_warmup_tokens}"
            )
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_METHODS} or None, "
                f"got {self.speculative!r}"
            )
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.speculative_max_batch < 0:
            raise ValueError(
                f"speculative_max_batch must be >= 0, got {self.speculative_max_batch}"
            )
        forced = self.spec_forced_acceptance
        if forced is not None and not 0 <= forced <= 1:
            raise ValueError(f"spec_forced_acceptance must be in [0, 1], got {forced}")


def resolve_model_dir(model: str | None) -> Path:
    if model is not None:
        return Path(model)
    from dsmesh.engine.tiny_model import default_model_dir

    return default_model_dir()
