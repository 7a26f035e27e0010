"""Where an NVMe-offloaded run keeps its swap files, and why a crash leaves nothing to misread.

Each rank swaps under ``<nvme_path>/zeroengine_swap/rank<r>-<pid>-<token>/``: one directory per
live process, holding an ``owner`` file with the pid and the host. Swap files are scratch, never
state: nothing is ever read from a directory another process made, so a run killed mid-write
leaves nothing a restart could mistake for valid state (resuming goes through checkpoints,
which are written atomically elsewhere). The directory is removed when the engine closes and at
interpreter exit; a process killed with SIGKILL cannot do that, so every new ``SwapDir``
first removes the directories under the same ``nvme_path`` whose owner process is gone (same
host, pid not alive) - the cleanup on the next start.
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import socket
import time

ROOT_NAME = "zeroengine_swap"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


class SwapDir:
    def __init__(self, nvme_path: str, rank: int):
        if not nvme_path:
            raise ValueError("offload to nvme needs nvme_path (a directory on the NVMe drive)")
        self.root = os.path.join(os.fspath(nvme_path), ROOT_NAME)
        os.makedirs(self.root, exist_ok=True)
        self.removed_stale = remove_stale(self.root)
        name = f"rank{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(self.root, name)
        os.makedirs(self.path)
        with open(os.path.join(self.path, "owner"), "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
        atexit.register(self.remove)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.remove)


def remove_stale(root: str) -> list[str]:
    """Remove swap directories under ``root`` whose owner (on this host) is no longer alive;
    returns their names. Directories of other hosts (a shared file system) are left alone."""
    removed = []
    host = socket.gethostname()
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "owner")) as f:
                pid_text, owner_host = f.read().split()
        except (OSError, ValueError):
            # no owner file: a directory whose creation was cut short (its files never held
            # anything readable) - older than a minute means nobody is still creating it
            if time.time() - os.path.getmtime(path) > 60:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
            continue
        if owner_host == host and not _alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed
