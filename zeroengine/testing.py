"""Run a function on N local ranks (separate processes) and collect what each returns; used by
the tests and benchmarks.

The function must be importable (module level) and its arguments and result picklable. Each rank
gets the torchrun environment variables, so zeroengine.init_distributed() finds its group the
way it would under torchrun. One thread per rank keeps N ranks from fighting over 2 cores.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        # Plain pickle: torch's queue would share tensor memory that dies with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        from .distributed.bootstrap import destroy_group
        destroy_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0,
              expect_dead: tuple[int, ...] = ()) -> list:
    """``fn(*args)`` on each of ``world_size`` ranks; their results in rank order. A rank that
    fails or dies fails the call, except the ranks in ``expect_dead`` (a test that kills one):
    their exit is expected and their result is None."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        for rank in expect_dead:
            results[rank] = None
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except queue_module.Empty:
                # A rank killed outright (os._exit, a signal) reports nothing: notice it
                # instead of waiting out the timeout while its peers hang in a collective.
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead:
                    errors.append(f"rank {dead[0]} died with exit code "
                                  f"{procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout:.0f} s") from None
                continue
            if rank in expect_dead:
                errors.append(f"rank {rank} was expected to die but returned")
            elif ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")  # the others may now hang
    finally:
        for p in procs:
            p.join(timeout=5 if errors or expect_dead else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
