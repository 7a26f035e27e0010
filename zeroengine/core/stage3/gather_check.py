"""Stage 3's gather-order check: every gather is a collective, so every rank must gather the
same segment for the same purpose in the same order. Each gather exchanges (check number,
segment, purpose) on a host-side group beside the gather itself; a mismatch raises the same
RankDivergenceError on every rank, saying what each was doing, before the gathered values are
used (a mismatch of equal sizes would otherwise pair silently)."""
from __future__ import annotations

import enum
from typing import Callable

from ...distributed.comm import Comm
from ...errors import RankDivergenceError

Key = tuple[int, int]  # (index of the partitioned group, segment)


class GatherPurpose(enum.IntEnum):
    """Why a segment is gathered, as the gather-order check compares it across ranks (an int
    on the wire)."""
    FORWARD = 0
    FORWARD_NO_GRAD = 1
    BACKWARD = 2
    USER = 3
    REFRESH = 4

    @property
    def described(self) -> str:
        return _DESCRIBED[self]


_DESCRIBED = {GatherPurpose.FORWARD: "a forward",
              GatherPurpose.FORWARD_NO_GRAD: "a forward without gradients (evaluation, "
              "generation)", GatherPurpose.BACKWARD: "a backward",
              GatherPurpose.USER: "a gathered_parameters block",
              GatherPurpose.REFRESH: "the refresh after a step"}
NO_KEY = (-1, -1)  # the check at the start of a forward, before any segment


def _described(purpose: int) -> str:
    """A purpose another rank sent: described, or '?' for a number this version does not
    know."""
    try:
        return GatherPurpose(purpose).described
    except ValueError:
        return "?"


class GatherOrderCheck:
    def __init__(self, comm: Comm, names_of: Callable[[Key], str]):
        """``names_of``: a segment's parameter names, for the message."""
        self.comm, self._names_of = comm, names_of
        self.checks = 0  # gathers compared across ranks so far

    def exchange(self, key: Key, purpose: GatherPurpose, async_op: bool = False):
        """Every rank must gather the same segment for the same purpose (each gather is a
        collective): exchange (check number, segment, purpose) on the host-side check group and
        raise on every rank, with what each was doing, if they differ. With ``async_op`` the
        exchange runs beside the gather and the returned callable compares: the gathered
        values are used only after it passed (ParamFetcher._wait), so mismatched gathers -
        same sizes pair silently - never reach the model."""
        self.checks += 1
        rows = self.comm.gather_ints([self.checks, key[0], key[1], int(purpose)],
                                     what="the stage-3 gather-order check", async_op=async_op)
        if async_op:
            return lambda: self._compare(rows())
        self._compare(rows)
        return None

    def _compare(self, rows: list[list[int]]) -> None:
        if all(row == rows[0] for row in rows):
            return
        doing = "; ".join(
            f"rank {r}: " + ("starting" if (gi, s) == NO_KEY else
                             f"gathering {self._names_of((gi, s))} for")
            + f" {_described(p)} (check #{n})" for r, (n, gi, s, p) in enumerate(rows))
        raise RankDivergenceError(
            f"stage-3 ranks diverged: {doing}. "
            "At stage 3 every forward and backward is collective: each rank must run the same "
            "passes of the model in the same order. Run evaluation and generate() on every rank "
            "(each on its own data), not on rank 0 only; for rank-0-only work take the weights "
            "with engine.consolidated_state_dict() into a separate model; for MoE-style blocks "
            "that run on some ranks only, list them in zero_optimization.stage3_leaf_modules")
