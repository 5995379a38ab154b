"""The engine's options: runtime choices for one engine (the model's shape comes from its
checkpoint), each declared once, validated before anything is built.

Every field made with :func:`~dsmesh.options.fields.option` is also a command-line flag of
every command that runs an engine, and what ``dsmesh up`` forwards to the engines it starts
(dsmesh/options/fields.py). Fields whose default is ``None`` are derived at start-up from the
device, the model and the process's role (dsmesh/engine/derived.py): an explicit value wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dsmesh.engine.kv.budget import CPU_MAX_TOTAL_TOKENS, DEFAULT_MEM_FRACTION
from dsmesh.engine.kv.pool import KV_CACHE_DTYPES
from dsmesh.engine.model.kernel_choice import KERNEL_SETS, MOE_BACKENDS
from dsmesh.engine.model.mla import ATTENTION_MODES
from dsmesh.engine.model.mla_decode_backend import ATTENTION_BACKENDS
from dsmesh.engine.model.mtp import SPECULATIVE_METHODS
from dsmesh.engine.model.weights import WEIGHT_READS
from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option

# what the process is for; picks derived defaults (dsmesh/engine/derived.py)
ROLES = ("offline", "prefill", "decode", "unified")
DERIVED = "derived from the device, the model and the role (docs/OPTIONS.md, 'Derived defaults')"


@dataclass(frozen=True)
class EngineConfig:
    """Runtime choices for one engine; the model's shape comes from its checkpoint."""

    model: str | None = option(
        None, "checkpoint folder (default: the tiny built-in model)", forward=False
    )
    device: str = option(
        "auto", "auto, cpu, cuda, cuda:N (auto: cuda when available)", forward=False
    )
    dtype: str = option(
        "auto",
        "compute dtype: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    page_size: int = option(16, "tokens per KV page", parse=argtypes.positive)
    max_total_tokens: int | None = option(
        None,
        "KV pool size in tokens",
        parse=argtypes.positive,
        default_text=f"from --mem-fraction on CUDA, {CPU_MAX_TOTAL_TOKENS} on CPU",
    )
    mem_fraction: float | None = option(
        None,
        "fraction of the GPU's memory this process may use for weights + KV pool; the pool "
        "gets what the loaded weights leave; the rest is left for activations, CUDA graphs "
        "and the CUDA context (CUDA only, unused with --max-total-tokens)",
        parse=argtypes.share,
        metavar="F",
        forward=False,  # ``dsmesh up`` splits its own between the processes of a GPU
        default_text=str(DEFAULT_MEM_FRACTION),
    )
    # fp8_e4m3: e4m3 values, two float32 scales per token in each page (dsmesh/kernels/kv_fp8.py)
    kv_cache_dtype: str = option(
        "auto",
        "KV cache values: auto = the model's dtype; fp8_e4m3 = FP8 with per-token scales, "
        "about twice the tokens per GB (decode attention: Triton, not FlashInfer)",
        choices=KV_CACHE_DTYPES,
    )
    max_running_requests: int | None = option(
        None, "requests in the running batch at most", parse=argtypes.positive, default_text=DERIVED
    )
    max_batch_tokens: int | None = option(
        None,
        "new tokens per forward (also the prefill chunk size)",
        parse=argtypes.positive,
        default_text=DERIVED,
    )
    admit_interval: int = option(
        1,
        "while requests decode, new requests join the batch at most every N steps, so that "
        "their prompt chunks share one forward (1 = every step; dsmesh/engine/sched/scheduler.py)",
        parse=argtypes.positive,
    )
    attention_mode: str = option(
        "auto",
        "MLA path: auto = naive for prefill, weight-absorbed for decode",
        choices=ATTENTION_MODES,
    )
    prefix_cache: bool | None = option(
        None,
        "share full prompt pages between requests with a common prefix",
        default_text="on in services, off in dsmesh generate and offline benchmarks",
    )
    tbo: bool = option(
        False,
        "two-batch overlap: each forward runs as two micro-batches whose MoE dispatch/combine "
        "overlaps the other's compute",
        cli=False,  # an expert-parallel flag (dsmesh/cli/common.py add_ep_args)
        up=True,  # ``dsmesh up`` forwards it to the expert-parallel instances
    )
    weights_read: str = option(
        "auto",
        "how the checkpoint reaches the device: staged = file by file through reused pinned "
        "buffers, copied asynchronously (dsmesh/engine/model/staged_read.py); mmap = tensor by "
        "tensor through safetensors' memory map; auto = staged on CUDA, mmap on CPU",
        choices=WEIGHT_READS,
    )
    cuda_graphs: bool = option(
        True,
        "replay decode steps as CUDA graphs, one per batch-size bucket (CUDA only; not with "
        "attention mode naive; with --tbo the graphs hold both micro-batches; under expert "
        "parallelism the ranks agree on each graph step)",
    )
    cuda_graph_max_batch: int | None = option(
        None,
        "largest decode batch replayed as a CUDA graph (larger ones run eagerly)",
        parse=argtypes.positive,
        default_text="the running-request limit",
    )
    cuda_graph_warmup_tokens: int = option(
        4096,
        "decode graphs for every batch bucket and contexts up to this many tokens are "
        "captured at start-up (the rest on first use, which stalls the running batch); 0 = "
        "all on first use",
        parse=argtypes.count,
    )
    cuda_graph_ready_batches: int = option(
        4,
        "decode graphs of the N smallest batch buckets are captured before the instance is "
        "ready, the larger ones after it, one per idle gap of the engine (until then their "
        "steps run uncaptured); 0 = all before ready (expert-parallel groups always)",
        parse=argtypes.count,
        metavar="N",
    )
    cuda_graph_min_tokens: int = option(
        1024,
        "contexts up to this many tokens share one page table in the captured graphs",
        parse=argtypes.positive,
    )
    decode_attention: str = option(
        "auto",
        "MLA decode kernel: auto = FlashInfer's where it is installed and fits, else "
        "dsmesh's Triton kernel (kernel); flashinfer = FlashInfer's (bash "
        "scripts/setup-gpu.sh); torch = the reference (dsmesh/engine/model/mla_decode_backend.py)",
        choices=ATTENTION_BACKENDS,
    )
    kernels: str = option(
        "auto",
        "auto = dsmesh's Triton kernels on CUDA (fused glue, routing, prefill attention); "
        "torch = the torch references everywhere (A/B runs); chosen once at start",
        choices=KERNEL_SETS,
    )
    moe_backend: str = option(
        "auto",
        "decode-sized MoE: auto/fused = one fused kernel (bf16/fp16 on CUDA), grouped = "
        "grouped GEMMs",
        choices=MOE_BACKENDS,
    )
    overlap_decode: bool = option(
        True,
        "with CUDA graphs, launch a greedy decode step before the previous one's "
        "bookkeeping, so that host work overlaps the GPU (only when the next batch is "
        "certain to be the same requests; docs/GPU.md)",
    )
    contiguous_prompts: bool = option(
        False,
        "prefix cache evictions keep each prompt chunk's pages one run of consecutive "
        "pages: set by the prefill and decode services, between which a prompt's KV is "
        "copied a run per layer",
        cli=False,
    )
    split_mixed_steps: bool = option(
        True,
        "with CUDA graphs, a step mixing decode rows and prompt chunks replays a decode "
        "graph for the decode rows and runs only the prompt chunks eagerly (docs/GPU.md)",
    )
    fp8_experts: bool | None = option(
        None,
        "FP8 checkpoints: keep the routed experts in FP8 and run the FP8 grouped GEMM on "
        "CUDA; --no-fp8-experts dequantises them to --dtype at load (and the other linears too, "
        "unless --fp8-linears)",
        default_text="on for FP8 checkpoints on CUDA with Triton, else off",
    )
    fp8_linears: bool | None = option(
        None,
        "FP8 checkpoints: keep the attention projections (but kv_b_proj) and the dense MLPs / "
        "shared experts in FP8 with their 128x128 block scales and run block-scaled FP8 GEMMs "
        "(DeepGEMM where installed, else Triton); --no-fp8-linears dequantises them to --dtype "
        "at load",
        default_text="as --fp8-experts",
    )
    speculative: str | None = option(
        None,
        "speculative decoding: mtp = draft with the checkpoint's MTP layer "
        "(num_nextn_predict_layers > 0) and verify the drafts in one forward; off by default "
        "(dsmesh/engine/speculative/)",
        choices=SPECULATIVE_METHODS,
    )
    num_draft_tokens: int = option(
        1,
        "tokens drafted per step with --speculative (the MTP layer applied K times)",
        parse=argtypes.positive,
        metavar="K",
    )
    speculative_max_batch: int = option(
        128,
        "decode batches larger than N run without speculation (128: on one H200, K = 1 "
        "gains at every batch up to 128 at simulated acceptance 0.6 and 0.8, projected to "
        "V3's 61 layers; dsmesh/bench/mtp.py)",
        parse=argtypes.count,
        metavar="N",
    )
    # BENCHMARK ONLY (dsmesh/bench/mtp.py): accept each draft with this probability instead of
    # verifying it, emitting the target's tokens (random weights accept nothing); the output
    # is not the model's. None = real verification.
    spec_forced_acceptance: float | None = option(
        None, "benchmarks only: accept each draft with this probability", cli=False
    )
    role: str = option(
        "offline",
        "what the process is for: offline (dsmesh generate, benchmarks), prefill, decode or "
        "unified; set by each service",
        choices=ROLES,
        cli=False,
    )

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

    @property
    def is_resolved(self) -> bool:
        """Whether every derived option has its value (dsmesh/engine/derived.py)."""
        return None not in (
            self.max_running_requests,
            self.max_batch_tokens,
            self.prefix_cache,
            self.fp8_experts,
            self.fp8_linears,
            self.cuda_graph_max_batch,
        )

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
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
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
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
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
    from dsmesh.engine.model.tiny_model import default_model_dir

    return default_model_dir()
