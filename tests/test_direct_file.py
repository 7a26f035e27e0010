"""checkpoint/direct_file.py: the bytes written around the page cache are exactly the bytes
given, whatever the lengths of the writes against the bounce buffer and the 4096-byte blocks,
and where O_DIRECT is refused (at open, at a write, or for the padding past a file-size limit)
the file is still written whole."""
from __future__ import annotations

import errno
import os
import resource
import signal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zeroengine.checkpoint import direct_file
from zeroengine.checkpoint.direct_file import SequentialFile


@pytest.fixture
def small_bounce(monkeypatch):
    monkeypatch.setattr(direct_file, "BOUNCE", 3 * direct_file.ALIGN)


def write_pieces(path, pieces) -> SequentialFile:
    out = SequentialFile(str(path))
    try:
        for piece in pieces:
            out.write(piece)
        out.finish()
    finally:
        out.close()
    return out


@settings(max_examples=examples(60), deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 7, 4095, 4096, 4097, 12287, 12288, 12289,
                                         30000]), max_size=8))
def test_bytes_are_the_bytes_given(tmp_path_factory, lengths):
    direct_file.BOUNCE, saved = 3 * direct_file.ALIGN, direct_file.BOUNCE
    try:
        pieces = [os.urandom(n) for n in lengths]
        path = tmp_path_factory.mktemp("direct") / "f"
        # every other piece as a tensor (how a rank file's values come), the rest as bytes
        out = write_pieces(path, [torch.frombuffer(bytearray(p), dtype=torch.uint8) if i % 2
                                  and p else p for i, p in enumerate(pieces)])
    finally:
        direct_file.BOUNCE = saved
    assert out.direct, "O_DIRECT was refused on the test's filesystem: the fallback ran instead"
    assert path.read_bytes() == b"".join(pieces) and out.size == sum(lengths)


def test_refused_at_open_writes_through_the_page_cache(tmp_path, monkeypatch, small_bounce):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", no_direct)
    pieces = [os.urandom(5000), os.urandom(20000)]
    out = write_pieces(tmp_path / "f", pieces)
    assert not out.direct and (tmp_path / "f").read_bytes() == b"".join(pieces)


def test_refused_at_the_first_write(tmp_path, monkeypatch, small_bounce):
    real_pwrite = os.pwrite
    refused = []

    def refuse_direct(fd, data, at):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(at)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, at)
    monkeypatch.setattr(os, "pwrite", refuse_direct)
    pieces = [os.urandom(30000), os.urandom(3)]
    write_pieces(tmp_path / "f", pieces)
    assert refused == [0] and (tmp_path / "f").read_bytes() == b"".join(pieces)


def test_padding_past_a_file_size_limit(tmp_path, small_bounce):
    """The last block is padded to 4096 bytes before it is written; a file-size limit that the
    data keeps within but the padding crosses must not fail the save."""
    size = 2 * direct_file.ALIGN + 100
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))
    try:
        data = os.urandom(size)
        write_pieces(tmp_path / "f", [data])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert (tmp_path / "f").read_bytes() == data


def test_a_real_limit_still_fails(tmp_path, small_bounce):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (direct_file.ALIGN * 2, hard))
    try:
        with pytest.raises(OSError) as err:
            write_pieces(tmp_path / "f", [os.urandom(direct_file.ALIGN * 5)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert err.value.errno == errno.EFBIG
