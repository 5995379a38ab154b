"""What prefill, decode and unified instances share: the engine worker thread, the
engine attached to the mesh (broker, EPLB, EP group), the KV layout signature and metrics."""
