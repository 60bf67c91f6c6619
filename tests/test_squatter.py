"""Another user on the node cannot serve the table or ring a side.

`docs/design-notes.md#shared-memory`, "Same user only".

Real squatters: forked processes that drop to uid 65534 (so the suite must run as root) and
bind the names ray-ple computes, serving a forged table that is right in every other way.
The same-uid rows show what the checks are for: a same-uid broker's sealed table is taken.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil
import pytest

from ray_ple.errors import PleEnvironmentError, PleShmError
from ray_ple.offload.table_broker import broker_name
from ray_ple.offload.table_file import fingerprint, locate_tensor
from ray_ple.offload.table_segment import SEALS
from ray_ple.offload.table_store import _HDR, _MAGIC, acquire_table, table_segment_size
from ray_ple.protocol.doorbell import Doorbell, DoorbellListener, bell_address
from ray_ple.protocol.shm import PAGE
from ray_ple.table_source import TableSource
from tests.leftovers import ple_shm_entries, shmem_bytes
from tests.rig import spec_for, write_checkpoint

NOBODY = 65534
ROWS, LAYERS, DIM = 8192, 8, 64  # 8 MiB of bf16: well above the noise of /proc/meminfo
FORGED = 0xAB

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="needs root to become uid 65534")
pytestmark = ROOT_ONLY


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> TableSource:
    path = tmp_path_factory.mktemp("squat") / "ckpt"
    write_checkpoint(path, rows=ROWS, layers=LAYERS, ple_dim=DIM)
    return spec_for(path, max_tokens=8).sources[0]


def _forged_fd(source: TableSource, fp: str, size: int, sealed: bool) -> int:
    """A memfd shaped like the node table (header and all) whose rows are the squatter's."""
    fd = os.memfd_create("ray-ple-table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o600)
    os.posix_fallocate(fd, 0, size)  # real memory, as a served table is
    header = bytearray(PAGE)
    _HDR.pack_into(header, 0, _MAGIC, 1, 1, source.table.rows, source.table.row_bytes,
                   bytes.fromhex(fp))
    os.pwrite(fd, bytes(header), 0)
    os.pwrite(fd, bytes([FORGED]) * min(size - PAGE, 1 << 20), PAGE)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _serve(name: bytes, fd: int, fp: str, size: int, listen: bool = True) -> None:
    """The broker's side of the protocol, as a squatter would speak it (never returns)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    if listen:
        sock.listen(8)
    yield_ready()
    while True:
        if not listen:
            time.sleep(1)
            continue
        conn, _ = sock.accept()
        meta = json.dumps({"fingerprint": fp, "size": size, "token": "0" * 32}).encode()
        socket.send_fds(conn, [meta], [fd])
        conn.close()


_READY_FD = -1


def yield_ready() -> None:
    os.write(_READY_FD, b"r")


@contextmanager
def squatter(body: Callable[[], None], uid: int | None = NOBODY) -> Iterator[int]:
    """Run `body` in a forked child (as `uid`, unless None) until the block ends; yield its pid
    once it calls `yield_ready()`. The child is killed and reaped on the way out."""
    global _READY_FD
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: never returns into pytest
        code = 0
        try:
            os.close(r)
            _READY_FD = w
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            body()
        except BaseException:  # noqa: BLE001 - the parent sees it as "not ready"
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 10)
        assert ready and os.read(r, 1) == b"r", "the squatter did not come up"
        yield pid
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _mapped_memfds() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:ray-ple" in line]


def _held_memfds() -> list[str]:
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:ray-ple" in target:
            held.append(target)
    return held


def _names(source: TableSource) -> tuple[str, bytes, int]:
    fp = fingerprint(locate_tensor(source), source.table)
    return fp, broker_name(fp), table_segment_size(source.table)


_CHILDREN_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before() -> None:
    """Processes this pytest already had (multiprocessing's resource tracker, started by an earlier
    test of the session) are not this test's leftovers."""
    _CHILDREN_BEFORE.clear()
    _CHILDREN_BEFORE.update(p.pid for p in psutil.Process().children(recursive=True))


def _assert_nothing_left(base_shmem: int) -> None:
    assert _mapped_memfds() == [] and _held_memfds() == []
    assert ple_shm_entries() == []
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in _CHILDREN_BEFORE]
    assert new == [], "no process of the test is left"
    table = ROWS * LAYERS * DIM * 2
    deadline = time.monotonic() + 10
    while abs(shmem_bytes() - base_shmem) > table // 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert abs(shmem_bytes() - base_shmem) <= table // 4, "Shmem back to its level"


def test_broker_of_another_uid_is_refused_naming_it(source):
    fp, name, size = _names(source)
    base = shmem_bytes()

    def body() -> None:
        _serve(name, _forged_fd(source, fp, size, sealed=True), fp, size)

    with squatter(body) as pid:
        assert shmem_bytes() - base > 0.5 * size, "the squatter's table is real memory"
        t0 = time.monotonic()
        with pytest.raises(PleEnvironmentError, match=f"pid {pid} of uid {NOBODY}"):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
        assert time.monotonic() - t0 < 5, "refused at once, not at the deadline"
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is mapped"
    _assert_nothing_left(base)


def test_name_held_by_another_uid_without_serving_is_refused(source):
    fp, name, size = _names(source)
    base = shmem_bytes()

    def body() -> None:
        _serve(name, -1, fp, size, listen=False)

    with squatter(body) as pid:
        t0 = time.monotonic()
        with pytest.raises(PleEnvironmentError, match=f"pid {pid} of uid {NOBODY}"):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
        assert time.monotonic() - t0 < 5, "refused at once, not at the deadline"
    _assert_nothing_left(base)


def test_same_uid_broker_is_trusted(source):
    """The control for the rows below: a sealed table of the right size from our own user is
    mapped (read-only) and served, rows and all."""
    fp, name, size = _names(source)
    base = shmem_bytes()

    def body() -> None:
        _serve(name, _forged_fd(source, fp, size, sealed=True), fp, size)

    with squatter(body, uid=None):
        table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
        assert table.rows[0, 0] == FORGED and not table.rows.flags.writeable
        assert [line.split()[1] for line in _mapped_memfds()] == ["r--s"]
        table.close()
    _assert_nothing_left(base)


@pytest.mark.parametrize("case", ["short", "long", "unsealed"])
def test_bad_table_fd_of_our_uid_is_refused_before_mapping(source, case):
    fp, name, size = _names(source)
    base = shmem_bytes()
    fd_size = {"short": size - PAGE, "long": size + PAGE, "unsealed": size}[case]

    def body() -> None:  # the meta and the header both claim the right size
        _serve(name, _forged_fd(source, fp, fd_size, sealed=case != "unsealed"), fp, size)

    with squatter(body, uid=None):
        match = "not sealed" if case == "unsealed" else f"holds {fd_size} bytes"
        with pytest.raises(PleShmError, match=match):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
        assert _mapped_memfds() == [] and _held_memfds() == []
    _assert_nothing_left(base)


def test_loaded_table_is_sealed_and_mapped_read_only(source):
    """On 4 KiB shmem pages, where a write meets the seal (hugetlbfs refuses every write)."""
    base = shmem_bytes()
    table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30, huge_pages="off")
    try:
        assert fcntl.fcntl(table.segment.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        assert os.fstat(table.segment.fd).st_mode & 0o777 == 0o600
        assert [line.split()[1] for line in _mapped_memfds()] == ["r--s"]
        with pytest.raises(PermissionError):
            os.pwrite(table.segment.fd, b"x", PAGE)
    finally:
        table.close()
    _assert_nothing_left(base)


def test_ring_from_another_uid_is_not_a_ring():
    token = os.urandom(16).hex()
    listener = DoorbellListener(token)

    def body() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for _ in range(3):
            sock.sendto(b"!", bell_address(token))
        yield_ready()  # only once the rings are queued at the listener
        time.sleep(60)

    try:
        with squatter(body):  # ready: its rings were sent, so the kernel queued them
            assert listener.wait(0.5) is False, "a ring of uid 65534 woke the listener"
            bell = Doorbell(token)
            bell.ring()
            assert listener.wait(2) is True, "a ring of our own user wakes it"
            bell.close()
    finally:
        listener.close()


def test_doorbell_name_taken_by_another_uid_is_refused_naming_it():
    token = os.urandom(16).hex()

    def body() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(bell_address(token))
        yield_ready()
        time.sleep(60)

    with squatter(body) as pid:
        with pytest.raises(PleEnvironmentError, match=f"taken by pid {pid} of uid {NOBODY}"):
            DoorbellListener(token)
