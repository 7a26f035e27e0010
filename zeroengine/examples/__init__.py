"""Built-in example models and jobs."""
