"""Sampling: a request's parameters, the logit adjustments, the sampler (greedy, temperature,
top-k, top-p, min-p), logprobs of sampled and prompt tokens, and grammar constraints
(llguidance matchers and the allowed-token bitmask)."""
