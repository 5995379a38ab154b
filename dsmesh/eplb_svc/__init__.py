"""Expert-parallel load balancer: placements from measured expert load (EPLB issue)."""
