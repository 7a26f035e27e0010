"""A rank stopped from outside says so in its log before it goes.

When one rank fails, torchrun (srun, mpirun, a Kubernetes controller) stops the others with
SIGTERM; by default they vanish without a line, and a reader of rank 1's log cannot tell a
crash of rank 1 from a stop caused by rank 0. The handler writes one line - which rank, the
signal, where the rank was - and then dies of the same signal, so exit codes and the
launcher's view are what they would have been.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


def install(rank: int) -> None:
    """Report SIGTERM on this rank, unless the program (or a framework) handles it already."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_term(signum, frame):
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in " \
            f"{frame.f_code.co_name}" if frame is not None else "unknown"
        sys.stderr.write(
            f"[rank {rank}] zeroengine: rank {rank} stopped by SIGTERM from outside (at {where}). "
            "Launchers (torchrun, srun, mpirun, Kubernetes) stop every rank when one rank fails "
            "or the job is cancelled: unless this rank logged an error above, the first rank "
            "that failed says why in its own log\n")
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
