"""What a replica's processes leave in /dev/shm, removed once nobody uses it.

vLLM's message queues (`multiprocessing.shared_memory`, `psm_*`) and `multiprocessing`
semaphores (`sem.mp-*`) are unlinked by their owner on an orderly exit, or by the resource
tracker of the process tree. A replica ended by a verdict (SIGKILL to every process of it), or
one whose children Ray kills at the end of a stop, loses both: the names stay in /dev/shm with
every page they touched until the node restarts. The supervisor takes the inventory of the
replica's shared-memory files just before the replica ends and, once every process of it is
gone, removes those that no live process maps or holds open.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SHM_DIR = "/dev/shm/"
_DELETED = " (deleted)"


def shm_files_of(pids: Iterable[int]) -> set[str]:
    """Named files under /dev/shm that these processes map or hold open."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.rstrip("\n").split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(SHM_DIR):
                        found.add(parts[5])
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                if target.startswith(SHM_DIR):
                    found.add(target)
        except OSError:
            continue  # gone, or not ours to read
    return {p for p in found if not p.endswith(_DELETED)}


def in_use(paths: set[str]) -> set[str]:
    """Of `paths`, those some live process on this node maps or holds open."""
    pids = (int(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    return shm_files_of(pids) & paths


def remove_unused(paths: Iterable[str]) -> list[str]:
    """Unlink every one of `paths` that still exists and that no live process uses."""
    left = {p for p in paths if os.path.exists(p)}
    removed = []
    for path in sorted(left - in_use(left)) if left else []:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # removed meanwhile
    return removed
