"""The replica's reaper: one small process, outside Ray, that outlives the replica only to
remove what its processes left on the node.

However a replica ends (Ctrl-C or SIGTERM to `serve run`, `serve shutdown`, a redeploy, a
verdict, SIGKILL of the replica, `ray stop`), Ray may stop its raylet first, and then no
destructor and no supervisor of the replica runs. The reaper is started by the replica
(`start_reaper`) as an orphan in its own session, so Ray's process-tree kills do not reach it.
While any process of the replica's tree runs, it takes their inventory every second: what
they map or hold open in /dev/shm (vLLM's message queues `psm_*`, `multiprocessing`
semaphores `sem.mp-*`), the socket files they have bound (vLLM's ZMQ `ipc://` endpoints), and
vLLM's `vllm_dist_*` rendezvous files they hold open. It also notes `multiprocessing`'s
`pymp-*` folders that appear in the temp dir while the replica runs. Once every process of the
tree is gone it removes each of those that still exists, belongs to this uid and that no live
process on the node maps, holds open, has bound or works in; then it exits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import psutil

from ray_ple.log import log_event
from ray_ple.supervision.engine_leftovers import files_of, remove_unused

POLL_S = 1.0
TMP_FILES = ("vllm_dist_",)  # temp-dir files vLLM's processes hold open while they run
TMP_DIRS = ("pymp-",)  # temp-dir folders `multiprocessing` makes (and removes at a clean exit)


def start_reaper(root: int, tag: str) -> None:
    """Start the reaper of the process tree under `root` (this replica): an orphan in its own
    session (the shell that starts it exits at once), its lines in this process's log."""
    cmd = f"{sys.executable} -m ray_ple.supervision.reaper --root {root} --tag {tag} &"
    subprocess.run(["sh", "-c", cmd], start_new_session=True, check=True, timeout=30,
                   stdin=subprocess.DEVNULL)


def _open_tmp_files(pids: Iterable[int]) -> set[str]:
    """Temp-dir files of `TMP_FILES` these processes hold open."""
    tmp = tempfile.gettempdir().rstrip("/") + "/"
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(tmp) and os.path.basename(target).startswith(TMP_FILES):
                found.add(target)
    return found


def _tmp_dirs() -> dict[str, float]:
    """`TMP_DIRS` folders in the temp dir of this uid, by path -> change time."""
    out = {}
    with os.scandir(tempfile.gettempdir()) as it:
        for e in it:
            try:
                if (e.name.startswith(TMP_DIRS) and e.is_dir(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_uid == os.getuid()):
                    out[e.path] = e.stat(follow_symlinks=False).st_ctime
            except OSError:
                continue
    return out


def _used_under(paths: set[str]) -> set[str]:
    """Of folders `paths`, those some live process works in or holds a file under."""
    used = set()
    for pid in (int(e.name) for e in os.scandir("/proc") if e.name.isdigit()):
        try:
            names = [os.readlink(f"/proc/{pid}/cwd")]
            names += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for name in names:
            for p in paths:
                if name == p or name.startswith(p + "/"):
                    used.add(p)
    return used


def _remove_tmp(files: set[str], dirs: set[str]) -> list[str]:
    """Unlink the rendezvous files nobody holds and remove the folders nobody uses (this uid's
    only)."""
    removed = []
    held = _open_tmp_files(int(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    for f in sorted(files - held):
        try:
            if os.lstat(f).st_uid == os.getuid():
                os.unlink(f)
                removed.append(f)
        except OSError:
            continue
    for d in sorted(dirs - _used_under(dirs)):
        if os.path.isdir(d) and os.lstat(d).st_uid == os.getuid():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class Tree:
    """The live processes under `root` and root itself, remembered once seen (a pid reused
    by another process is told apart by its start time)."""

    def __init__(self, root: int) -> None:
        self.procs: dict[int, psutil.Process] = {}
        self._root = root
        self._add(root)

    def _add(self, pid: int) -> None:
        try:
            self.procs.setdefault(pid, psutil.Process(pid))
        except psutil.Error:
            pass

    def refresh(self) -> list[int]:
        """Pids of the tree still running (children found since are added)."""
        root = self.procs.get(self._root)
        if root is not None and root.is_running():
            try:
                for child in root.children(recursive=True):
                    self._add(child.pid)
            except psutil.Error:
                pass
        return [pid for pid, p in self.procs.items() if _running(p)]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(root: int, tag: str, poll_s: float = POLL_S) -> list[str]:
    """Watch the tree under `root` until it is gone, then remove what it left."""
    started = time.time()
    before = set(_tmp_dirs())
    tree = Tree(root)
    inventory: set[str] = set()
    tmp_files: set[str] = set()
    log_event("reaper_started", replica=tag, root=root)
    while running := tree.refresh():
        inventory |= files_of(running)
        tmp_files |= _open_tmp_files(running)
        inventory = {p for p in inventory if os.path.lexists(p)}
        time.sleep(poll_s)
    dirs = {d for d, ctime in _tmp_dirs().items() if d not in before and ctime >= started - 1}
    removed = remove_unused(inventory) + _remove_tmp(tmp_files, dirs)
    log_event("reaper_done", replica=tag, root=root, pids=sorted(tree.procs), removed=removed)
    return removed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=int, required=True)
    ap.add_argument("--tag", required=True)
    args = ap.parse_args()
    os.chdir("/")  # the reaper keeps no folder in use
    reap(args.root, args.tag)


if __name__ == "__main__":
    main()
