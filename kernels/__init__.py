"""Compute kernels (MLA decode attention, grouped-GEMM MoE, FP8 quantisation, routing top-k),
each beside a plain-torch reference. GPU backends arrive with the GPU-path issue."""
