"""Shared-memory segments that leave nothing behind.

A pair segment is a tmpfs file created without a name (`O_TMPFILE` in `shm_dir`; where that is
unsupported, a named file unlinked right after `open`, before anything else, and swept by
`sweep_orphans` if its creator died in between), mode 0600. Its size is reserved up front with
`posix_fallocate` against `shm_dir`'s tmpfs: a full tmpfs is one clear error at setup, never a
SIGBUS later. A peer opens it through `/proc/<creator pid>/fd/<fd>` (same user, checked by the
kernel) and the kernel frees the memory with its last holder, whatever kills whom. The header's
random token makes a reused fd number or a guessed pid useless.

The node table is a sealed segment: a memfd (`MFD_ALLOW_SEALING`; tmpfs files cannot be
sealed), written once, then sealed against writes, resizes and further seals and mapped
read-only by every holder; a receiver refuses an fd that is not such a segment of its own
user and of the size it computed itself (`check_sealed`). Its memory is shmem like
`/dev/shm`'s (it shows in `Shmem` and in the cgroup's memory) but is not charged to the
`shm_dir` tmpfs, so `shm_dir`'s free space is still checked first: the sizing that makes room
for the table in `/dev/shm` stays the one budget, and a node short of it gets the same clear
error as before.

A node table may instead sit on the host's hugetlb pool (`huge=True`: `MFD_HUGETLB`, 2 MiB
pages, what a pod's `hugepages-2Mi` resource grants): `posix_fallocate` takes every page up
front, so a short pool is one clear error at setup (never a SIGBUS later), and that
reservation is the budget (not `shm_dir`'s tmpfs). The size is rounded up to the huge page
size, which a receiver reads from the fd (`st_blksize`), never from its peer.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ray_ple.errors import PleEnvironmentError, PleHandleError, PleShmError

PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
SEAL_WAIT_S = 5.0  # how long `seal` waits out pinned pages (EBUSY) at setup
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_NAME = re.compile(r"^ray-ple-(?P<kind>[a-z]+)-(?P<pid>\d+)-[0-9a-f]{32}$")


def page_align(n: int, page: int = PAGE) -> int:
    return (n + page - 1) // page * page


def huge_page_size() -> int:
    """The host's default huge page size (`Hugepagesize` of /proc/meminfo), what
    `MFD_HUGETLB` uses; 0 where the kernel has no hugetlb support."""
    return _meminfo().get("Hugepagesize", 0) * 1024


def _meminfo() -> dict[str, int]:
    """/proc/meminfo's numbers as written (kB, or pages for HugePages_*)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def hugetlb_room() -> tuple[int, str]:
    """(bytes a new segment could take from the default hugetlb pool, where that comes from):
    the pool's free pages less those other mappings reserved, capped by this cgroup's hugetlb
    limit (v2 `hugetlb.<size>.max`, v1 `hugetlb.<size>.limit_in_bytes`: a pod's
    `hugepages-2Mi`)."""
    page = huge_page_size()
    if not page:
        return 0, "no hugetlb support"
    info = _meminfo()
    room = max(0, info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)) * page
    where = f"hugetlb pool free {room >> 20} MiB"
    size = f"{page >> 30}GB" if page >= 1 << 30 else f"{page >> 20}MB"
    for limit, used in ((f"/sys/fs/cgroup/hugetlb.{size}.max",
                         f"/sys/fs/cgroup/hugetlb.{size}.current"),
                        (f"/sys/fs/cgroup/hugetlb/hugetlb.{size}.limit_in_bytes",
                         f"/sys/fs/cgroup/hugetlb/hugetlb.{size}.usage_in_bytes")):
        try:
            cap = int(Path(limit).read_text()) - int(Path(used).read_text())
        except (OSError, ValueError):  # absent, or "max": no cap here
            continue
        room, where = min(room, max(0, cap)), f"{where}, cgroup room {max(0, cap) >> 20} MiB"
        break
    return room, where


def segment_size(fd: int, size: int) -> int:
    """What a segment of `size` bytes holds on the fd's own pages: page-aligned, and rounded
    up to the huge page size on hugetlbfs (whose `st_blksize` is that size)."""
    return page_align(size, max(PAGE, os.fstat(fd).st_blksize))


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
    if (kib := _meminfo().get("Shmem")) is None:
        raise RuntimeError("no Shmem in /proc/meminfo")
    return kib * 1024


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


def check_sealed(fd: int, size: int, what: str) -> None:
    """Refuse an fd handed over by a peer unless it is a sealed segment of this user of exactly
    `size` bytes (a size the receiver computed itself, never one the peer wrote)."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        raise PleEnvironmentError(f"{what}: the fd belongs to uid {st.st_uid}, not this user "
                                  f"(uid {os.getuid()})")
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
        raise PleShmError(f"{what}: the fd is not a private shared-memory file "
                          f"(mode {oct(st.st_mode)})")
    if st.st_size != (want := segment_size(fd, size)):
        raise PleShmError(f"{what}: the fd holds {st.st_size} bytes, the table needs {want} "
                          f"({size} in {max(PAGE, st.st_blksize)} B pages)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise PleShmError(f"{what}: the fd is not a sealable memfd ({exc.strerror})") from exc
    if seals & SEALS != SEALS:
        raise PleShmError(f"{what}: the fd is not sealed against writes and resizes "
                          f"(seals {seals:#x}, need {SEALS:#x})")


class SharedSegment:
    """A mapped segment, either created here or attached from a peer's `SegmentRef`;
    `writable=False` maps it read-only (the node table, sealed)."""

    def __init__(self, fd: int, size: int, token: str, owner: bool,
                 writable: bool = True) -> None:
        st = os.fstat(fd)
        self.fd, self.size, self.token, self.owner = fd, size, token, owner
        self.inode = st.st_ino
        self.hugetlb = st.st_blksize > PAGE  # on the host's hugetlb pool (`huge=True`)
        self.writable = writable
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)

    @classmethod
    def create(cls, kind: str, size: int, shm_dir: str = "/dev/shm", *,
               sealable: bool = False, huge: bool = False) -> SharedSegment:
        """Create and reserve a nameless segment of `size` bytes; one clear error if it can't.
        `sealable`: a memfd that `seal()` can later freeze; `huge`: a sealable memfd on the
        host's hugetlb pool (see the module docstring)."""
        if huge:
            return cls._create_huge(kind, size)
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
        if sealable:
            try:
                fd = os.memfd_create(f"ray-ple-{kind}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError as exc:
                raise PleShmError(f"cannot create a sealable {kind} segment: {exc}") from exc
            try:
                os.fchmod(fd, 0o600)
            except OSError as exc:
                os.close(fd)
                raise PleShmError(f"cannot create a sealable {kind} segment: {exc}") from exc
        else:
            fd = _open_nameless(kind, token, shm_dir)
        where = "shared memory (memfd)" if sealable else shm_dir
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

    @classmethod
    def _create_huge(cls, kind: str, size: int) -> SharedSegment:
        page = huge_page_size()
        if not page or not hasattr(os, "MFD_HUGETLB"):
            raise PleShmError(f"no hugetlb pages on this host for the ray-ple {kind} segment")
        size = page_align(size, page)
        room, where = hugetlb_room()
        if room < size:  # before fallocate would take (and zero) every free page in vain
            raise PleShmError(f"the host's hugetlb pool cannot hold the ray-ple {kind} "
                              f"segment: {size >> 20} MiB in {page >> 20} MiB pages, {where} "
                              f"(a pod's hugepages-{page >> 20}Mi, or vm.nr_hugepages)")
        try:
            fd = os.memfd_create(f"ray-ple-{kind}",
                                 os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        except OSError as exc:
            raise PleShmError(f"cannot create a hugetlb {kind} segment: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)  # every huge page now, or one error now
            return cls(fd, size, secrets.token_hex(16), owner=True)
        except OSError as exc:
            os.close(fd)
            raise PleShmError(
                f"the host's hugetlb pool cannot hold the ray-ple {kind} segment: "
                f"{size >> 20} MiB in {page >> 20} MiB pages ({exc.strerror}; {where})") from exc
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, ref: SegmentRef) -> SharedSegment:
        """Open and map a peer's segment (see `open_segment`)."""
        return cls(open_segment(ref), ref.size, ref.token, owner=False)

    def seal(self) -> None:
        """Freeze a `sealable` segment once written: no write, resize or new seal by anyone
        from now on; this holder keeps a read-only mapping. Every view of the writable mapping
        must be gone (the kernel refuses the write seal while a writable mapping exists).

        The kernel also refuses it (EBUSY) while a page of the file holds an extra reference
        (a splice in flight, a per-CPU LRU batch), after waiting about 150 ms itself; such a
        pin is transient, so setup waits up to `SEAL_WAIT_S` before that is its one error.
        """
        self.map.close()
        deadline = time.monotonic() + SEAL_WAIT_S
        while True:
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
                break
            except OSError as exc:
                if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise PleShmError(f"cannot seal the segment: {exc}") from exc
        self.writable = False
        self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)

    def ref(self) -> SegmentRef:
        return SegmentRef(pid=os.getpid(), fd=self.fd, inode=self.inode, size=self.size,
                          token=self.token)

    def populate(self) -> None:
        """Map every page of this mapping now, for reading.

        A random row of a table not touched yet by this process costs a minor page fault
        (the kernel maps 16 pages around it, so the rest of the row is cheap): measured on
        2 cores, 64 random 3 KB row parts took 199 us cold against 54 us populated. A step's
        first touches would pay that, on the critical path of the first slot; populating at
        setup moves it off (about 0.08 s per GB, once per holder). Kernels before 5.14 lack
        MADV_POPULATE_READ: there one read per page does the same.
        """
        try:
            self.map.madvise(_MADV_POPULATE_READ)
        except OSError:
            int(np.frombuffer(self.map, np.uint8)[::PAGE].sum())

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
