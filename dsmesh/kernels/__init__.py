"""Compute kernels in Triton, each beside a plain-torch reference: MLA decode and prefill
attention, fused decode MoE, grouped-GEMM MoE (bf16 and FP8), FP8 quantisation, routing
top-k, fused norms and rope (docs/KERNELS.md)."""
