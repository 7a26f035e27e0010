"""An engine's checkpoint saves, synchronous or in the background.

``save(..., async_save=True)`` copies the rank's states into reused host staging buffers
(snapshot.py's ``capture``), hands the write to one background thread and returns a
``concurrent.futures.Future`` at once: its ``result()`` is the checkpoint's path, or raises the
commit protocol's CheckpointError, on every rank. Writing, fsync, checksums and the commit's
reports run in that thread on a process group of their own (Comm.host_side_twin), so they
never interleave with training's collectives. One save is in flight at a time: a second save
waits for the first, and so do ``load_checkpoint``, ``close()`` and interpreter exit (the
writer thread is joined before ``atexit`` handlers run), so a script whose last line is a save
leaves a complete checkpoint. This is what DCP's ``async_save`` and DeepSpeed's decoupled
checkpoint engine do.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from .commit import agree, attempt
from .format import CheckpointError
from .snapshot import capture
from .staging import StagingPool

log = logging.getLogger("zeroengine")


class CheckpointSaver:
    def __init__(self, engine, async_default: bool = False):
        self._engine = engine
        self.async_default = async_default  # the config's checkpoint.async_save
        self._comm = None
        self._staging: StagingPool | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def comm(self):
        """Collective on first use: the checkpoint protocol's own group."""
        if self._comm is None:
            self._comm = self._engine.comm.host_side_twin()  # collective
        return self._comm

    def save(self, save_dir: str, tag: str | None, client_state, node_local: bool,
             save_latest: bool, async_save: bool | None):
        from .sharded import checked_tag, unsupported_layout
        engine = self._engine
        async_save = self.async_default if async_save is None else async_save
        tag = checked_tag(tag, engine)
        self.wait()
        if async_save and engine.optimizer.swap is not None:
            raise NotImplementedError(
                f"save_checkpoint(async_save=True) {unsupported_layout(engine)}: the master "
                "and state are streamed from the swap files during the save, which must then "
                "hold the training loop; save with async_save=False (checkpoint.async_save "
                "false)")
        comm = self.comm()
        if async_save and self._staging is None:
            self._staging = StagingPool(pin=engine.device.type == "cuda")
        snapshot, err = attempt(capture, engine, save_dir, tag, client_state, node_local,
                                save_latest, self._staging if async_save else None)
        if err is not None:  # the others learn it in their first report (Snapshot.write)
            agree(comm, f"save_checkpoint of {os.path.join(save_dir, tag)}", err,
                  outcome="nothing was written")
        if not async_save:
            return snapshot.write(comm)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="zeroengine-checkpoint",
                                                initializer=_yield_to_training)
        self._pending = self._executor.submit(_write_logged, snapshot, comm)
        return self._pending

    def wait(self) -> None:
        """Until the save in flight (if any) is complete; its error stays in its Future (and
        was logged when it happened)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()

    def staging_nbytes(self) -> int:
        return self._staging.nbytes() if self._staging is not None else 0

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._staging = None


def _yield_to_training() -> None:
    """The writer thread runs at a lower CPU priority (nice +10, this thread only: Linux
    applies setpriority to a thread id), so where the training loop and the write compete for
    cores the loop wins and the write takes the idle time (collective waits, data loading)."""
    import threading
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    except (OSError, AttributeError):  # not Linux, or not allowed: same priority then
        pass


def _write_logged(snapshot, comm) -> str:
    """The background write; a failure is logged at once on every rank (the Future keeps it
    for ``result()``), so an unread Future never hides a failed save."""
    try:
        return snapshot.write(comm)
    except CheckpointError as err:
        log.error("asynchronous %s", err)
        raise
    except Exception:
        log.exception("asynchronous save_checkpoint of %s failed", snapshot.final)
        raise
