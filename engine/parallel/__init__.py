"""Tensor parallelism: one model split over several processes (ranks). Rank 0 runs the engine (scheduler,
block allocator, sampling); the other ranks run `worker.run_worker`, each over its shard of the weights and
its share of the KV heads, stepping when rank 0's step message arrives."""
