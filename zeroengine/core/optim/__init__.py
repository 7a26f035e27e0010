"""The optimizer step over the shard: ShardedOptimizer, the inner optimizer, tensor-wise owners,
precision and loss scaling, schedulers."""
