"""Running the model: the model runner (model, KV pool, kernel choice, decode graphs, one
forward of a scheduled step) and the CUDA graphs of decode steps with their buckets."""
