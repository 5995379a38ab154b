"""The DeepSeek model: its shape read from the checkpoint (config.py), its modules (MLA with
its decode and prefill attention backends, MoE with routing and dispatch, norms, rope), the
batch a forward takes, the kernels the modules run, the MTP layer, weight loading and the
tiny default checkpoint. Nothing here schedules, samples or keeps requests."""
