"""The commit protocol of every checkpoint save and load: each rank does its local part (write
its files, or read and verify into staging), catches whatever went wrong, and then every rank
reports success or its error in one small collective that it reaches whatever happened
locally. Only when every rank succeeded does the caller publish (save) or apply (load); else
every rank raises the same ``CheckpointError`` naming the failing rank(s), the file and the OS
error, and the process group stays in step (no rank is left waiting in a collective its peers
abandoned).

The reports travel on a group of their own (``Comm.host_side_twin()``): an asynchronous save
runs them from a background thread, where they must never interleave with training's
collectives.
"""
from __future__ import annotations

from ..distributed.comm import Comm
from .format import CheckpointError


def describe(error: BaseException) -> str:
    """One line naming what failed: a CheckpointError's own message (it names the file), an
    OSError's errno text and file, or the exception's type and first line."""
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{type(error).__name__}: [Errno {error.errno}] {error.strerror}{where}"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:500]


def agree(comm: Comm, action: str, error: BaseException | None, payload=None,
          outcome: str = "") -> list:
    """Collective: every rank's ``payload`` (in rank order) when no rank reports an ``error``;
    otherwise the same CheckpointError on every rank, naming each failing rank and its error.
    A peer that died before reporting (killed, out of memory) also ends in a CheckpointError
    here, as soon as the transport notices, instead of a hang. ``outcome``: what the failure
    leaves behind, appended to the message."""
    outcome = f" ({outcome})" if outcome else ""
    mine = (None if error is None else describe(error), payload)
    try:
        rows = comm.all_gather_object(mine)
    except Exception as err:  # noqa: BLE001 - a peer gone mid-protocol, whatever gloo says
        local = f"; this rank (rank {comm.rank}): {mine[0]}" if mine[0] else ""
        raise CheckpointError(
            f"{action} failed: a peer rank stopped before reporting its part (it exited, was "
            f"killed, or timed out): {describe(err)}{local}{outcome}") from None
    failed = [(rank, row[0]) for rank, row in enumerate(rows) if row[0] is not None]
    if len(failed) == 1:
        raise CheckpointError(f"{action} failed on rank {failed[0][0]}: {failed[0][1]}{outcome}")
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise CheckpointError(f"{action} failed on ranks {ranks}: {detail}{outcome}")
    return [row[1] for row in rows]


def attempt(fn, *args, **kwargs):
    """(result, None) or (None, the exception): a rank's local part, caught so that the rank
    still reaches ``agree``."""
    try:
        return fn(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - reported to every rank by agree()
        return None, err
