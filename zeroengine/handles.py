"""One vocabulary for asynchronous work: a ``Handle`` for anything in flight (a collective, a
host<->device copy) and ``StreamRole`` for where it runs on CUDA.

On CUDA, asynchronous work is issued from the side stream of its role, which first waits for the
compute stream (the inputs were produced there); an event recorded after the work is what
``Handle.wait`` orders the caller's stream after, without blocking the host. ``host_wait``
blocks the host instead (before the CPU reads what a copy wrote). Off CUDA the same handle
wraps torch's Work objects, or nothing for work that already ran.

Memory: a handle keeps references to the tensors its side-stream work reads or writes until it
is waited for. After ``wait`` the compute stream is ordered after that work, so memory the
caller frees from then on is reused by the caching allocator only for work that runs later on
the compute stream. This replaces ``Tensor.record_stream`` (FSDP2 made the same change):
record_stream makes the allocator keep a block until it *observes* the side stream past the
recorded point, at a later allocation, which can keep a whole bucket's memory out of reach
for longer than needed. The rule it relies on: every handle is waited for before its tensors
are dropped. GradReducer (``_finish_reduce``), ParamFetcher (``_wait`` before a free),
ShardedOptimizer (its all-gathers) and OptimizerOffload (``finish_step``) all do.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


class Handle:
    """Asynchronous work; ``wait()`` makes its result usable by what the caller runs next."""

    def __init__(self, work=None, after: Callable[[], None] | None = None, event=None,
                 keep: tuple = ()):
        # one torch Work, or several (a collective built from point-to-point messages)
        self._works = [] if work is None else list(work) if isinstance(work, list) else [work]
        self._after = after  # a fix-up run once the work is complete (fallbacks, p2p sums)
        self._event = event  # CUDA: recorded on the side stream after the work
        self._keep = keep  # tensors the side stream uses, alive until waited for
        self.context: tuple | None = None  # (comm, op, what, step), to explain a failure

    def then(self, fn: Callable[[], None]) -> "Handle":
        """Run ``fn`` after the work and any earlier fix-up, at ``wait`` (e.g. unpack what a
        quantized collective received). Returns self."""
        before = self._after
        self._after = fn if before is None else lambda: (before(), fn())
        return self

    def done(self) -> bool:
        """True once wait() would not block (but for the fix-up, which wait runs)."""
        if self._event is not None:
            return self._event.query()
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        """Order the caller's later work after this (on CUDA the host does not block; torch
        Work objects on CPU block until complete), then run the fix-up."""
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
        self._finish()

    def host_wait(self) -> None:
        """Block the host until the work is complete: before the CPU reads what it wrote."""
        if self._event is not None:
            self._event.synchronize()
        self._finish()

    def _finish(self) -> None:
        self._event = None
        self._keep = ()
        start = time.perf_counter() if self._works else None
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as err:
            if self.context is None:
                raise
            self.context[0].raise_explained(err, *self.context[1:])
        self._works = []
        if start is not None and self.context is not None:
            # the caller blocked here: communication that compute did not hide (exposed)
            self.context[0].record_wait(self.context[1], time.perf_counter() - start)
        if self._after is not None:
            after, self._after = self._after, None
            after()


class StreamRole:
    """A named kind of asynchronous work, with one CUDA side stream per device (made on first
    use). Roles keep kinds that complete at different times apart: a gradient reduction does
    not delay an on-demand gather queued after it on the host."""

    def __init__(self, name: str):
        self.name = name
        self._streams: dict[int, torch.cuda.Stream] = {}

    def __repr__(self) -> str:
        return f"StreamRole({self.name!r})"

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device=device)
        return stream

    def run(self, tensors: list[torch.Tensor], launch: Callable[[], Handle]) -> Handle:
        """``launch()`` issues asynchronous work on ``tensors``; on CUDA issue it from this
        role's side stream (after the compute stream's producers, and making the side stream
        wait for an NCCL collective's own stream) and return a handle on its event. Off CUDA,
        ``launch()`` as it is."""
        if not tensors or not any(t.is_cuda for t in tensors):
            return launch()
        device = next(t.device for t in tensors if t.is_cuda)
        stream = self.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            inner = launch()
            for work in inner._works:
                work.wait()  # NCCL: the side stream (not the host) waits for the collective
            event = torch.cuda.Event()
            event.record(stream)
        return Handle(None, inner._after, event, keep=tuple(tensors))


REDUCE = StreamRole("reduce")  # gradient reductions during backward
GATHER = StreamRole("gather")  # parameter all-gathers waited for right away
PREFETCH = StreamRole("prefetch")  # stage-3 gathers issued ahead of their use
COPY = StreamRole("copy")  # offload's host<->device copies


def copy_async(dst: torch.Tensor, src: torch.Tensor, role: StreamRole = COPY) -> Handle:
    """``dst.copy_(src)``: between host and device, non-blocking on the role's side stream;
    otherwise now (the handle is already done)."""
    if not (dst.is_cuda or src.is_cuda):
        dst.copy_(src)
        return Handle()
    return role.run([dst, src], lambda: _copy_now(dst, src))


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> Handle:
    dst.copy_(src, non_blocking=True)
    return Handle()
