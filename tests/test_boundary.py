"""Where the boundary is: who can reach a pair's memory, and what a step may post into it.

The pair segment is a nameless 0600 tmpfs file; the worker opens it through
`/proc/<offload pid>/fd/<n>`. The kernel refuses that path to another uid (the `/proc/<pid>/fd`
access check and the file's mode), and allows it to a process of the same uid: every process of
the serving user is inside the boundary (on a Ray node, every job's workers), another user is
not. The children here are real: forked, and dropped to uid 65534 where the row says so (the
suite runs as root). Posting: the slot holds int32 ids, and a wider id is refused before it
is stored, since a store would wrap it into a valid, wrong row.
"""

from __future__ import annotations

import errno
import os
import struct

import numpy as np
import pytest

from ray_ple.config import PleDeadlines
from ray_ple.errors import PleConfigError, PleHandleError
from ray_ple.protocol.layout import ControlBlock, PairLayout, State
from ray_ple.protocol.shm import SharedSegment, open_segment
from ray_ple.protocol.transaction import Phase, WorkerEnd

NOBODY = 65534
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to become uid 65534")


def _in_child(uid: int | None, flags: int, segment: SharedSegment) -> tuple[int, int]:
    """(errno of a raw open of the segment through /proc, or 0; 1 if `open_segment` raised
    `PleHandleError`, else 0) in a forked child running as `uid` (None: ours)."""
    ref = segment.ref()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            try:
                os.close(os.open(f"/proc/{ref.pid}/fd/{ref.fd}", flags | os.O_CLOEXEC))
                raw = 0
            except OSError as exc:
                raw = exc.errno
            try:
                os.close(open_segment(ref))
                refused = 0
            except PleHandleError:
                refused = 1
            os.write(w, struct.pack("ii", raw, refused))
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 8)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert len(got) == 8, "the child reported"
    return struct.unpack("ii", got)


@root_only
@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR], ids=["O_RDONLY", "O_RDWR"])
def test_another_uid_is_refused_the_pair_segment_by_the_kernel(flags):
    segment = SharedSegment.create("pair", 1 << 16)
    try:
        assert os.fstat(segment.fd).st_mode & 0o777 == 0o600
        raw, refused = _in_child(NOBODY, flags, segment)
    finally:
        segment.close()
    assert raw in (errno.EACCES, errno.EPERM), errno.errorcode.get(raw, raw)
    assert refused == 1, "ray-ple's own attach is one PleHandleError for another uid"


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR], ids=["O_RDONLY", "O_RDWR"])
def test_a_process_of_the_same_uid_is_inside_the_boundary(flags):
    """What the rows above are measured against: the same open, by a process of our own uid
    that holds no handle, succeeds. Same uid is one trust domain (as in Ray itself)."""
    segment = SharedSegment.create("pair", 1 << 16)
    try:
        raw, refused = _in_child(None, flags, segment)
    finally:
        segment.close()
    assert (raw, refused) == (0, 0)


def test_an_id_wider_than_the_slot_is_refused_before_anything_is_posted():
    """2**32 + 3 as int64 would be stored as 3: a valid row, the wrong one. `begin` refuses
    any id array that is not int32 before it stores a byte; the pair stays as it was."""
    layout = PairLayout.compute(8, (64,))
    segment = SharedSegment.create("pair", layout.size)
    try:
        block = ControlBlock(segment, layout)
        block.write_header(segment.token, "0" * 64)
        block.set_state(State.READY)
        worker = WorkerEnd(block, 0, PleDeadlines(), ("slot0",))
        before = (block.counters(), block.announced, block.token_count, block.ids.copy())
        for ids in (np.array([2**32 + 3], dtype=np.int64),
                    np.array([1, 2**32 + 3], dtype=np.int64),
                    np.array([3], dtype=np.uint32), np.array([[1, 2]], dtype=np.int32)):
            with pytest.raises(PleConfigError, match="int32"):
                worker.begin(ids)
            after = (block.counters(), block.announced, block.token_count, block.ids.copy())
            assert after[:3] == before[:3] and (after[3] == before[3]).all(), "nothing posted"
            assert worker.phase is Phase.IDLE and block.state is State.READY
        assert worker.begin(np.array([3, 5], dtype=np.int32)) == 1, "int32 ids still post"
        assert list(block.ids[:2]) == [3, 5] and block.posted == 1
    finally:
        segment.close()
