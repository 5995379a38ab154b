"""The KV cache: the paged pool of MLA latents, its page allocator, the prefix cache (a radix
tree of full pages) with the chained page hashes that name prefixes to other processes, and
the pool's size from a memory budget."""
