"""Expert parallelism: experts spread over the ranks of an EP group, tokens moved by
dispatch/combine. The model itself is unchanged: EP only swaps the MoE layer's
ExpertLocation and MoEDispatcher."""
