"""Shared-memory segments that leave nothing behind.

A pair segment is a tmpfs file created without a name (`O_TMPFILE` in `shm_dir`; where that is
unsupported, a named file unlinked right after `open`, before anything else, and swept by
`sweep_orphans` if its creator died in between), mode 0600. Its size is reserved up front with
`posix_fallocate` against `shm_dir`'s tmpfs: a full tmpfs is one clear error at setup, never a
SIGBUS later. A peer opens it through `/proc/<creator pid>/fd/<fd>` (same user, checked by the
kernel) and the kernel frees the memory with its last holder, whatever kills whom. The header's
random token makes a reused fd number or a guessed pid useless.

The node table's segment (a sealed memfd, on the hugetlb pool where it fits) builds on
`SharedSegment` in `ray_ple/offload/table_segment.py`.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field

from ray_ple.errors import PleHandleError, PleShmError

PAGE = mmap.PAGESIZE
_NAME = re.compile(r"^ray-ple-(?P<kind>[a-z]+)-(?P<pid>\d+)-[0-9a-f]{32}$")


def page_align(n: int, page: int = PAGE) -> int:
    return (n + page - 1) // page * page


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


def _open_nameless(kind: str, token: str, shm_dir: str) -> int:
    """An fd of a new 0600 tmpfs file in `shm_dir` that has no name (or has one for the
    microseconds between open and unlink, where `O_TMPFILE` is unsupported)."""
    try:
        return os.open(shm_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise PleShmError(f"cannot create a segment in {shm_dir}: {exc}") from exc
    path = Path(shm_dir) / f"ray-ple-{kind}-{os.getpid()}-{token}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PleShmError(f"cannot create a segment in {shm_dir}: {exc}") from exc
    path.unlink(missing_ok=True)
    return fd


class SharedSegment:
    """A mapped segment, either created here or attached from a peer's `SegmentRef`;
    `writable=False` maps it read-only (the node table, sealed)."""

    def __init__(self, fd: int, size: int, token: str, owner: bool,
                 writable: bool = True) -> None:
        st = os.fstat(fd)
        self.fd, self.size, self.token, self.owner = fd, size, token, owner
        self.inode = st.st_ino
        self.writable = writable
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)

    @classmethod
    def create(cls, kind: str, size: int, shm_dir: str = "/dev/shm") -> Self:
        """Create and reserve a nameless segment of `size` bytes; one clear error if it can't."""
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
        fd, where = cls._new_file(kind, token, shm_dir)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise PleShmError(
                    f"{where} too small for the ray-ple {kind} segment: could not reserve "
                    f"{size} bytes ({exc.strerror})"
                ) from exc
            raise PleShmError(f"cannot reserve {size} bytes in {where}: {exc}") from exc
        try:
            return cls(fd, size, token, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _new_file(kind: str, token: str, shm_dir: str) -> tuple[int, str]:
        """(fd of the new file, where its bytes come from, for errors)."""
        return _open_nameless(kind, token, shm_dir), shm_dir

    @classmethod
    def attach(cls, ref: SegmentRef) -> SharedSegment:
        """Open and map a peer's segment (see `open_segment`)."""
        return cls(open_segment(ref), ref.size, ref.token, owner=False)

    def ref(self) -> SegmentRef:
        return SegmentRef(pid=os.getpid(), fd=self.fd, inode=self.inode, size=self.size,
                          token=self.token)

    def address(self) -> int:
        """Host address of a writable mapping (this process only)."""
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
    """Remove named segments whose creator died between open and unlink (no `O_TMPFILE`)."""
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
