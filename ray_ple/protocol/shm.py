"""Shared-memory segments that leave nothing behind.

A segment is a tmpfs file (so the size of `/dev/shm` is checked and reserved up front with
`posix_fallocate`: a full tmpfs is one clear error at setup, never a SIGBUS later) that is
unlinked microseconds after creation. From then on it has no name: a peer opens it through
`/proc/<creator pid>/fd/<fd>` (same user, checked by the kernel) and the kernel frees the
memory with its last holder, whatever kills whom. The header's random token makes a
reused fd number or a guessed pid useless.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ray_ple.errors import PleHandleError, PleShmError

PAGE = mmap.PAGESIZE
_NAME = re.compile(r"^ray-ple-(?P<kind>[a-z]+)-(?P<pid>\d+)-[0-9a-f]{32}$")


def page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class SegmentRef(BaseModel):
    """Where a peer finds a live segment (process-local; never enters a compile cache)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    pid: int = Field(gt=0)
    fd: int = Field(ge=0)
    inode: int = Field(gt=0)
    size: int = Field(gt=0)
    token: str = Field(pattern=r"^[0-9a-f]{32}$")


def open_segment(ref: SegmentRef) -> int:
    """An fd of a peer's segment; its inode and size must be the ones the handle names."""
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise PleHandleError(
            f"cannot open segment fd {ref.fd} of pid {ref.pid} (peer gone or another "
            f"user): {exc.strerror}"
        ) from exc
    st = os.fstat(fd)
    if st.st_ino != ref.inode or st.st_size != ref.size:
        os.close(fd)
        raise PleHandleError(
            f"segment of pid {ref.pid} fd {ref.fd} is inode {st.st_ino} size {st.st_size}, "
            f"handle says inode {ref.inode} size {ref.size}"
        )
    return fd


def free_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def shmem_bytes() -> int:
    """Shared memory in use system-wide (/proc/meminfo Shmem). Segments have no name once set
    up, so this, not /dev/shm, is where a second table copy or a leaked segment shows."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Shmem in /proc/meminfo")


class SharedSegment:
    """A mapped segment, either created here or attached from a peer's `SegmentRef`."""

    def __init__(self, fd: int, size: int, token: str, owner: bool) -> None:
        self.fd, self.size, self.token, self.owner = fd, size, token, owner
        self.inode = os.fstat(fd).st_ino
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, kind: str, size: int, shm_dir: str = "/dev/shm") -> SharedSegment:
        """Create, reserve and unlink a segment of `size` bytes; one clear error if it can't."""
        size = page_align(size)
        if not os.path.isdir(shm_dir):
            raise PleShmError(f"shared-memory directory {shm_dir} does not exist")
        avail = free_bytes(shm_dir)
        if avail < size:
            raise PleShmError(
                f"{shm_dir} too small for the ray-ple {kind} segment: need {size} bytes, "
                f"{avail} free (size /dev/shm for slots + table + object store)"
            )
        token = secrets.token_hex(16)
        path = Path(shm_dir) / f"ray-ple-{kind}-{os.getpid()}-{token}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise PleShmError(f"cannot create a segment in {shm_dir}: {exc}") from exc
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise PleShmError(
                    f"{shm_dir} too small for the ray-ple {kind} segment: could not reserve "
                    f"{size} bytes ({exc.strerror})"
                ) from exc
            raise PleShmError(f"cannot reserve {size} bytes in {shm_dir}: {exc}") from exc
        finally:
            path.unlink(missing_ok=True)
        return cls(fd, size, token, owner=True)

    @classmethod
    def attach(cls, ref: SegmentRef) -> SharedSegment:
        """Open and map a peer's segment (see `open_segment`)."""
        return cls(open_segment(ref), ref.size, ref.token, owner=False)

    def ref(self) -> SegmentRef:
        return SegmentRef(pid=os.getpid(), fd=self.fd, inode=self.inode, size=self.size,
                          token=self.token)

    def address(self) -> int:
        """Host address of the mapping (this process only)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def close(self) -> None:
        """Drop this holder; the kernel frees the memory when the last one is gone."""
        try:
            self.map.close()
        except BufferError:
            pass  # views still alive: the mapping goes with them
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def sweep_orphans(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove named segments whose creator died inside the create-to-unlink window."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m['pid']}"):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
    return removed
