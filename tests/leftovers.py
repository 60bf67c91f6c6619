"""What a ray-ple run could leave behind: memory, processes, and named segments.

Pair segments and node tables have no name once set up (O_TMPFILE, memfd), so a leak of them
shows only as memory: `Shmem` in /proc/meminfo, which counts every tmpfs page, named or not.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from typing import NamedTuple

import psutil

# Tolerance for `Footprint.nameless_shmem` coming back to its level after a replica ends.
# Other processes on the machine (concurrent vLLM engines of other test runs, other Ray
# clusters) move Shmem by hundreds of MiB at a time; most of that is named (vLLM's message
# queues, 160 and 240 MiB each, live in /dev/shm) and is subtracted. What remains moving is
# shared anonymous memory and unlinked files of other processes (a Ray object store holds
# only what is put in it). 64 MiB stays below one leaked vLLM queue and above that churn;
# a leaked tiny pair segment (KiB) stays below it, and is caught by the process checks (a
# nameless segment lives exactly as long as a process holds it).
SHMEM_TOLERANCE = 64 << 20
MLOCK_TOLERANCE = 16 << 20


def ple_shm_entries(shm_dir: str = "/dev/shm", since: frozenset[str] = frozenset()) -> list[str]:
    """ray-ple's names in `shm_dir`, less those in `since` (a snapshot taken when a session
    started: another run's names are not this session's leftovers)."""
    return sorted(n for n in os.listdir(shm_dir) if "ray-ple" in n and n not in since)


def named_shm_bytes(shm_dir: str = "/dev/shm") -> int:
    """Bytes allocated to files that have a name under `shm_dir`."""
    total = 0
    for root, _dirs, files in os.walk(shm_dir):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:  # gone meanwhile
                pass
    return total


def meminfo(key: str) -> int:
    """A /proc/meminfo size in bytes; KeyError where the kernel has no such line."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def shmem_bytes() -> int:
    """Shared memory in use system-wide (/proc/meminfo Shmem). Segments have no name once set
    up, so this, not /dev/shm, is where a second table copy or a leaked segment shows."""
    return meminfo("Shmem")


def meminfo_count(key: str) -> int:
    """A /proc/meminfo count (HugePages_*), 0 where the kernel has no such line."""
    try:
        return meminfo(key) // 1024
    except KeyError:
        return 0


class Footprint(NamedTuple):
    """What the running processes of a cluster hold, as memory and as processes."""

    nameless_shmem: int  # Shmem minus the named /dev/shm files: memfds, O_TMPFILE, shared anon
    mlocked: int  # pinned (mlock'ed) memory, system-wide
    hugetlb: int  # huge pages in use or reserved, system-wide (a node table on the pool)
    processes: Counter  # title -> count of replica processes under the given raylets

    def differs(self, base: Footprint) -> list[str]:
        """What is left over `base`: memory that grew (memory that shrank was freed by
        someone else on the machine: a benchmark ending beside the suite gave 130 -> 9 MiB),
        and any change in the replica's processes."""
        out = []
        if self.nameless_shmem - base.nameless_shmem > SHMEM_TOLERANCE:
            out.append(f"nameless Shmem {base.nameless_shmem >> 20} -> "
                       f"{self.nameless_shmem >> 20} MiB")
        if self.mlocked - base.mlocked > MLOCK_TOLERANCE:
            out.append(f"Mlocked {base.mlocked >> 20} -> {self.mlocked >> 20} MiB")
        if self.hugetlb > base.hugetlb:
            out.append(f"hugetlb {base.hugetlb >> 20} -> {self.hugetlb >> 20} MiB")
        if self.processes != base.processes:
            out.append(f"processes {dict(base.processes)} -> {dict(self.processes)}")
        return out


REPLICA_KINDS = ("PleLLMServer", "OffloadActor", "Supervisor", "VLLM")


def cluster_processes(raylets: list[int]) -> Counter:
    """Titles of a replica's processes under these raylets (replica, engine, offload actors,
    supervisor). Serve's own (proxies come and go with the nodes that hold replicas) and
    Ray's idle workers are left out."""
    titles: Counter = Counter()
    for pid in raylets:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in children:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if not cmd.startswith(("ray::", "VLLM")) or not any(k in cmd for k in REPLICA_KINDS):
                continue
            titles[cmd.split()[0].split(".")[0][:60]] += 1  # ray::Class, not .method
    return titles


def hugetlb_bytes() -> int:
    """Huge pages taken from the pool (in use, or reserved and not yet touched)."""
    try:
        size = meminfo("Hugepagesize")
    except KeyError:  # no hugetlb in this kernel
        return 0
    pages = (meminfo_count("HugePages_Total") - meminfo_count("HugePages_Free")
             + meminfo_count("HugePages_Rsvd"))
    return pages * size


def footprint(raylets: list[int]) -> Footprint:
    return Footprint(shmem_bytes() - named_shm_bytes(), meminfo("Mlocked"), hugetlb_bytes(),
                     cluster_processes(raylets))


# The marker of one test session: set in the session's environment before anything starts, so
# every process it starts (Ray clusters, their workers, vLLM engines, forked sides) carries it
# and another run's processes on the same machine (a `serve run`, a second suite) do not.
SESSION_VAR = "RAY_PLE_TEST_SESSION"


def mark_session() -> str:
    """Give this process, and so every process it starts from now on, a new session marker."""
    os.environ[SESSION_VAR] = uuid.uuid4().hex
    return os.environ[SESSION_VAR]


def session_of(pid: int) -> str | None:
    """The session marker in a process's environment; None where it has none, or where it
    cannot be read: gone, a zombie, or another user's (a session's own processes run as its
    user, or were started by it as root, and root reads every environment)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # ENOENT: gone; EACCES/EPERM: another user's
        return None
    key = SESSION_VAR.encode() + b"="
    for entry in env.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key):].decode(errors="replace")
    return None


def ple_processes(session: str | None = None) -> list[str]:
    """Processes of ray-ple's own (offload actors, serve replicas, vLLM engines of ours) that
    carry `session` (default: this process's marker; every one on the machine where this
    process has none)."""
    session = session or os.environ.get(SESSION_VAR)
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == me:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if not any(k in cmd for k in ("OffloadActor", "PleLLMServer", "ray-ple-offload",
                                      "offload_proc.py")):
            continue
        if session is None or session_of(p.info["pid"]) == session:
            found.append(f"{p.info['pid']}: {cmd[:120]}")
    return found


def hugetlb_pool() -> tuple[int, int]:
    """(free pages, page bytes) of the host's default hugetlb pool."""
    return meminfo_count("HugePages_Free"), meminfo("Hugepagesize")
