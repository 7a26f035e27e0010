"""The examples' training text: the Python standard library's own sources (no download), as
byte tensors, and random windows of it (the built-in GPT's batches)."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_corpus(limit: int = 8_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors: the stdlib's top-level .py files sorted by path, every
    10th file held out for validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, total = [], [], 0
    for i, path in enumerate(sorted(root.glob("*.py"))):
        data = path.read_bytes()
        (val if i % 10 == 9 else train).append(data)
        total += len(data)
        if total >= limit:
            break

    def as_tensor(chunks):
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val)


def windows(data: torch.Tensor, count: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - context - 1, (count,), generator=gen)
    return torch.stack([data[s:s + context + 1] for s in starts.tolist()])
