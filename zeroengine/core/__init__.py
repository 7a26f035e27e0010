"""The engine itself: layout of parameters in flat buffers, gradient reduction, stage-3
parameter fetching, the sharded optimizer step, offload and precision."""
