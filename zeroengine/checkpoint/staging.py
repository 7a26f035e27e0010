"""Host buffers an asynchronous save copies the rank's states into, kept from one save to the
next: the copy then writes into pages already mapped (a fresh allocation would fault every page
in again, which costs about as much as the copy itself), and the memory is visible as one
number in ``memory_report()`` (``checkpoint_staging``)."""
from __future__ import annotations

import torch


class StagingPool:
    def __init__(self, pin: bool = False):
        self.pinned = pin  # page-locked (CUDA: device-to-host copies run asynchronously)
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        """The staging tensor for ``name``, reused when the dtype and size are the same."""
        shape = torch.Size(shape)
        held = self._buffers.get(name)
        if held is None or held.dtype != dtype or held.numel() != shape.numel():
            held = torch.empty(shape.numel(), dtype=dtype, pin_memory=self.pinned)
            self._buffers[name] = held
        return held.view(shape)

    def copy(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A staged copy of ``value`` (on the host, contiguous)."""
        out = self.buffer(name, value.dtype, value.shape)
        out.copy_(value.detach(), non_blocking=self.pinned)
        return out

    def keep_only(self, names) -> None:
        """Drop buffers no save used this time (a model that changed shape)."""
        names = set(names)
        for name in [n for n in self._buffers if n not in names]:
            del self._buffers[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())
