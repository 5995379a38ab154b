"""Running the model: the model runner (model, KV pool, kernel choice, decode graphs, one
forward of a scheduled step), the CUDA graphs of decode steps with their buckets, and
launch-ahead (the next greedy decode step launched before this one's bookkeeping)."""
