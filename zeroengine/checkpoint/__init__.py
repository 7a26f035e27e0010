"""Sharded checkpoints: every rank writes what it owns; any world size and stage loads them."""
from .format import CheckpointError
from .restore import load_checkpoint
from .sharded import save_checkpoint
from .weights.hf_export import save_16bit_model, save_pretrained

__all__ = ["CheckpointError", "load_checkpoint", "save_16bit_model", "save_checkpoint",
           "save_pretrained"]
