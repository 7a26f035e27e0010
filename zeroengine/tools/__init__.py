"""What runs around the engine: the zeroengine CLI, the demo training job, the memory
estimate and the scale model."""
