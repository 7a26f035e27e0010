"""tests/process_tree.py: a run past its limit leaves no process behind and shows its stacks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from process_tree import descendants, run_process_tree

# A parent that starts a child in a session of its own (as torchrun starts its ranks), prints
# the child's pid and waits on it; the child sleeps in a named function forever.
HUNG = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import time\\ndef waiting_for_a_peer():\\n    time.sleep(3600)\\nwaiting_for_a_peer()"],
    start_new_session=True)
print("CHILD", child.pid, flush=True)
child.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_hung_run_shows_its_stacks_and_leaves_nothing_behind():
    started = time.monotonic()
    done = run_process_tree([sys.executable, "-c", HUNG], timeout=3, grace=5)
    assert done.timed_out
    assert time.monotonic() - started < 30
    child = int(done.output.split("CHILD", 1)[1].split()[0])
    assert "waiting_for_a_peer" in done.output, done.output  # faulthandler's dump of the child
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the child in its own session outlived the run"


def test_a_run_that_ends_returns_its_output_and_code():
    done = run_process_tree([sys.executable, "-c", "print('out'); import sys; "
                             "print('err', file=sys.stderr); sys.exit(3)"], timeout=60)
    assert (done.returncode, done.timed_out) == (3, False)
    assert "out" in done.output and "err" in done.output


def test_descendants_finds_grandchildren():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(c.pid, flush=True)\n"
        "c.wait()")], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    try:
        assert {parent.pid, grandchild} <= set(descendants(os.getpid()))
        assert descendants(parent.pid) == [grandchild]
    finally:
        os.kill(grandchild, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
