"""The node table's segment: a sealed memfd, on the host's hugetlb pool where it fits.

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
import secrets
import stat
import time
from pathlib import Path

import numpy as np

from ray_ple.errors import PleEnvironmentError, PleShmError
from ray_ple.protocol.shm import PAGE, SharedSegment, page_align

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
SEAL_WAIT_S = 5.0  # how long `seal` waits out pinned pages (EBUSY) at setup
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


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


class TableSegment(SharedSegment):
    """A node table's segment: a memfd that `seal()` freezes once written, then mapped
    read-only by every holder (`writable=False` for one received from a peer)."""

    def __init__(self, fd: int, size: int, token: str, owner: bool,
                 writable: bool = True) -> None:
        super().__init__(fd, size, token, owner, writable)
        self.hugetlb = os.fstat(fd).st_blksize > PAGE  # on the host's hugetlb pool

    @classmethod
    def create(cls, kind: str, size: int, shm_dir: str = "/dev/shm", *,
               huge: bool = False) -> TableSegment:
        """Create and reserve a sealable memfd of `size` bytes; one clear error if it can't.
        `huge`: on the host's hugetlb pool (see the module docstring)."""
        if huge:
            return cls._create_huge(kind, size)
        return super().create(kind, size, shm_dir)

    @staticmethod
    def _new_file(kind: str, token: str, shm_dir: str) -> tuple[int, str]:
        try:
            fd = os.memfd_create(f"ray-ple-{kind}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise PleShmError(f"cannot create a sealable {kind} segment: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)
        except OSError as exc:
            os.close(fd)
            raise PleShmError(f"cannot create a sealable {kind} segment: {exc}") from exc
        return fd, "shared memory (memfd)"

    @classmethod
    def _create_huge(cls, kind: str, size: int) -> TableSegment:
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

    def seal(self) -> None:
        """Freeze the segment once written: no write, resize or new seal by anyone from now
        on; this holder keeps a read-only mapping. Every view of the writable mapping must be
        gone (the kernel refuses the write seal while a writable mapping exists).

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
