"""The asynchronous file I/O engine (ops/aio.py, csrc/aio): every backend writes and reads back
the same bytes at any offset, O_DIRECT-aligned or not, and fails by name (file, offset)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zeroengine.ops import aio

BACKENDS = ["built", "python"]


def engine(backend: str, **kw) -> aio.AsyncFileIO:
    return aio.AsyncFileIO(backend=None if backend == "built" else "python", **kw)


def test_built_backend_is_the_one_the_machine_allows():
    # setup.py builds io_uring where liburing-dev is installed (.ci/run installs it), else the
    # thread pool: a build that silently lost io_uring would show here
    io = aio.AsyncFileIO()
    expected = "io_uring" if os.path.exists("/usr/include/liburing.h") else "threads"
    assert io.backend == expected
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_aligned_roundtrip(tmp_path, backend):
    io = engine(backend, block_size=1 << 16, queue_depth=8, thread_count=2)
    n = (3 << 20) + 4096  # not a multiple of the block size: a short last block
    src = aio.aligned_empty(n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator()
                            .manual_seed(0)))
    path = tmp_path / "x.bin"
    handles = [io.write(src[:n // 2], path, 0), io.write(src[n // 2:], path, n // 2)]
    for h in handles:
        h.wait()
    io.sync()
    assert os.path.getsize(path) == n
    dst = aio.aligned_empty(n)
    h = io.read(dst, path)
    h.wait()
    assert h.done() and torch.equal(src, dst)
    io.close()


@settings(max_examples=examples(25), deadline=None)
@given(numel=st.integers(1, 5000), offset=st.integers(0, 20000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       backend=st.sampled_from(BACKENDS))
def test_any_offset_and_dtype(tmp_path_factory, numel, offset, dtype, backend):
    path = tmp_path_factory.mktemp("aio") / "t.bin"
    io = engine(backend, block_size=4096, queue_depth=4, thread_count=2)
    src = torch.randn(numel).to(dtype) if dtype.is_floating_point else \
        torch.arange(numel, dtype=dtype)
    io.write(src, path, offset).wait()
    back = torch.empty_like(src)
    io.read(back, path, offset).wait()
    assert torch.equal(src, back)
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_failures_name_the_file_and_offset(tmp_path, backend):
    io = engine(backend)
    missing = tmp_path / "missing.bin"
    with pytest.raises((RuntimeError, OSError), match="missing.bin"):
        io.read(aio.aligned_empty(4096), missing).wait()
    short = tmp_path / "short.bin"
    io.write(aio.aligned_empty(8192), short).wait()
    with pytest.raises((RuntimeError, OSError), match=r"short.bin at offset 8192.*short"):
        io.read(aio.aligned_empty(8192), short, 4096 * 2).wait()
    io.close()


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="multiple of 4096"):
        aio.AsyncFileIO(block_size=1000)


def test_swap_dirs_are_private_and_cleaned(tmp_path):
    """A killed run's swap directory is removed by the next start; a live one is kept; the
    engine's own goes at close."""
    import subprocess
    import sys

    from zeroengine.core.offload.swap_files import ROOT_NAME, SwapDir
    # a process that makes its swap directory, writes into it, and is killed mid-run
    code = ("import sys, time; from zeroengine.core.offload.swap_files import SwapDir; "
            f"d = SwapDir({str(tmp_path)!r}, 3); open(d.file('master.bin'), 'wb').write(b'x'); "
            "print(d.path, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    killed_dir = proc.stdout.readline().strip()
    live = SwapDir(tmp_path, 0)  # the other process is still alive: its directory stays
    assert os.path.isdir(killed_dir) and live.removed_stale == []
    proc.kill()
    proc.wait()
    again = SwapDir(tmp_path, 1)
    assert again.removed_stale == [os.path.basename(killed_dir)]
    assert not os.path.exists(killed_dir) and os.path.isdir(live.path)
    live.remove()
    again.remove()
    assert os.listdir(tmp_path / ROOT_NAME) == []


CLOSE_RIGHT_AFTER = """
import sys
from zeroengine.ops import aio
for _ in range(3000):
    io = aio.AsyncFileIO(4096, 4, 1)
    buf = aio.aligned_empty(1 << 16)
    handle = io.write(buf, sys.argv[1], 0)
    handle.wait()
    del buf, handle  # the engine's reference to the buffer may be the last one
    io.close()
"""


@pytest.mark.parametrize("attempt", range(3))
def test_closing_right_after_a_wait_never_hangs(tmp_path, attempt):
    """The I/O thread must never drop the last reference to a Python-made buffer: freeing it
    takes the GIL, which close() holds while it joins that thread. The engine that did
    hung in about one run of 3000 write-wait-close rounds in three."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", CLOSE_RIGHT_AFTER, str(tmp_path / "f.bin")],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
