"""Speculative decoding with the checkpoint's MTP layer: the speculative worker (verify the
drafts in one target forward, then draft the next ones), its CUDA graphs, and the acceptance
policies (greedy and rejection sampling)."""
