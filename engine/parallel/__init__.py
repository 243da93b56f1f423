"""Tensor parallelism: one model split over several processes (ranks). Every rank runs the same `Worker` over its
shard of the weights and its share of the KV heads; rank 0 also runs the engine (scheduler, block allocator,
sampling) and sends each step's plan to the others (`rank_process.run_rank`)."""
