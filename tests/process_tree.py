"""Run a command that starts processes of its own (a launcher and its ranks) with a time limit
that leaves nothing behind and says where a hung run stood.

``subprocess.run(timeout=...)`` kills only the launcher: torchrun starts each rank in a session
of its own, so a hung rank outlives the test, spinning on the 2 cores for the rest of the suite,
and the failure shows nothing of where it hung. Here a run past its limit gets SIGABRT in every
process it started first - Python's faulthandler (turned on through PYTHONFAULTHANDLER) prints
each thread's stack into the output - and then SIGKILL in whatever is left.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass
class TreeRun:
    returncode: int
    output: str  # stdout and stderr, interleaved as written
    timed_out: bool


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited while we looked
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces or ')'
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_process_tree(cmd: list[str], *, timeout: float, cwd: str | None = None,
                     env: dict | None = None, grace: float = 30.0) -> TreeRun:
    """``cmd`` to its end or to ``timeout`` seconds; on a timeout every process it started
    dumps its Python stacks (SIGABRT), ``grace`` seconds later all of them are killed."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    # Output into a file, not a pipe: an orphan holding a pipe's end open would block the read.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            started = descendants(proc.pid)
            _signal_all(started, signal.SIGABRT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            _signal_all([proc.pid, *descendants(proc.pid), *started], signal.SIGKILL)
            proc.wait()
        out.seek(0)
        return TreeRun(proc.returncode, out.read(), timed_out)
