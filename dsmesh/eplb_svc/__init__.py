"""Expert-parallel load balancer: placements from measured expert load (docs/EPLB.md)."""
