"""Glue for the job runners and model libraries people already use (each needs its extra)."""
