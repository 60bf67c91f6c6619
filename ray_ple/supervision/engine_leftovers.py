"""What a replica's processes leave in /dev/shm and as socket files, removed once unused.

vLLM's message queues (`multiprocessing.shared_memory`, `psm_*`) and `multiprocessing`
semaphores (`sem.mp-*`, e.g. the executor's worker lock in vLLM's engine core) are unlinked by
their owner on an orderly exit, or by the resource tracker of the process tree. A replica
ended by a verdict (SIGKILL to every process of it), or one whose children Ray kills at the end
of a stop, loses both: the names stay in /dev/shm with every page they touched until the node
restarts. The supervisor takes the inventory of the replica's shared-memory files once its
engine has started (a verdict kills first, reading nothing) and, once every process of it is
gone, removes those that no live process maps or holds open.

The same holds for vLLM's ZMQ `ipc://` endpoints: socket files in the temp dir, unlinked by
ZMQ when the binding socket closes, left behind by a SIGKILL (a few per replica). They are
taken in the same inventory (the paths the replica's processes have bound, from
/proc/net/unix) and removed once no socket is bound to them any more. The inventory covers
every process under the replica (`files_of_tree`): the engine core binds two endpoints of its
own, and was missed while the inventory read only the watched processes.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

import psutil

SHM_DIR = "/dev/shm/"
_DELETED = " (deleted)"


def shm_files_of(pids: Iterable[int]) -> set[str]:
    """Named files under /dev/shm that these processes map or hold open.

    A file mapped under its own name is found by that name. glibc's `sem_open` (every
    `multiprocessing` lock of a spawned process: `sem.mp-*`) maps a temporary file, links it
    under the semaphore's name and unlinks the temporary one, so the mapping shows a deleted
    name: such files are found by inode among the names in /dev/shm.
    """
    found: set[str] = set()
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.rstrip("\n").split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(SHM_DIR):
                        if parts[5].endswith(_DELETED):
                            inodes.add(int(parts[4]))
                        else:
                            found.add(parts[5])
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                    if target.startswith(SHM_DIR):
                        if target.endswith(_DELETED):
                            inodes.add(os.stat(f"{fd_dir}/{fd}").st_ino)
                        else:
                            found.add(target)
                except OSError:
                    continue
        except OSError:
            continue  # gone, or not ours to read
    if inodes:
        try:
            found |= {e.path for e in os.scandir(SHM_DIR) if e.inode() in inodes}
        except OSError:
            pass
    return found


def _bound_unix_paths() -> dict[int, str]:
    """Socket inode -> path of every unix socket on this node bound to a file."""
    out = {}
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith("/"):
                    out[int(parts[6])] = parts[7]
    except OSError:
        pass
    return out


def socket_files_of(pids: Iterable[int]) -> set[str]:
    """Socket files these processes have bound (vLLM's ZMQ `ipc://` endpoints)."""
    inodes: set[int] = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return {path for ino, path in _bound_unix_paths().items() if ino in inodes}


def files_of(pids: Iterable[int]) -> set[str]:
    """Everything these processes would leave behind if killed: shm files and socket files."""
    pids = list(pids)
    return shm_files_of(pids) | socket_files_of(pids)


def files_of_tree(root: int) -> set[str]:
    """`files_of` every live descendant of `root`: vLLM's engine core, which binds its own
    ZMQ endpoints and is not one of the processes the supervisor watches. A child whose pid
    was reused while its files were read (psutil compares start times) adds nothing."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return set()
    found: set[str] = set()
    for child in children:
        files = files_of([child.pid])
        if child.is_running():
            found |= files
    return found


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def in_use(paths: set[str]) -> set[str]:
    """Of `paths`, those some live process on this node maps or holds open (shm files) or
    has a socket bound to (socket files)."""
    pids = (int(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    return (shm_files_of(pids) | set(_bound_unix_paths().values())) & paths


def remove_unused(paths: Iterable[str]) -> list[str]:
    """Unlink every one of `paths` that still exists, is this uid's and that no live process
    uses; outside /dev/shm only socket files."""
    left = {p for p in paths if p.startswith(SHM_DIR) and os.path.exists(p) or _is_socket(p)}
    removed = []
    for path in sorted(left - in_use(left)) if left else []:
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # removed meanwhile
    return removed
