"""The replica's reaper: one small process, outside Ray, that outlives the replica only to
remove what its processes left on the node.

However a replica ends (Ctrl-C or SIGTERM to `serve run`, `serve shutdown`, a redeploy, a
verdict, SIGKILL of the replica, `ray stop`), Ray may stop its raylet first, and then no
destructor and no supervisor of the replica runs. So the replica makes, before its engine
starts, a temp folder of its own (`replica_tmpdir`) and points `TMPDIR` and `tempfile` there:
what vLLM and `multiprocessing` put in the temp dir (ZMQ `ipc://` socket files, the
`vllm_dist_*` rendezvous file, `pymp-*` folders) lands in it, and belongs to this replica by
where it is. torch's compile cache keeps its usual place (`TORCHINDUCTOR_CACHE_DIR`).
Then it starts the reaper (`start_reaper`) as an orphan in its own session, out of reach of
Ray's process-tree kills. While any process of the replica's tree runs, the reaper takes
their inventory every second: what they map or hold open in /dev/shm (vLLM's message queues
`psm_*`, `multiprocessing` semaphores `sem.mp-*`) and the socket files they have bound. Once
every process of the tree is gone it removes each of those that still exists, belongs to this
uid and that no live process maps, holds open or has bound, and the replica's temp folder
unless a live process works or holds a file in it; then it exits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from ray_ple.log import log_event
from ray_ple.supervision.engine_leftovers import files_of, remove_unused

POLL_S = 1.0


def replica_tmpdir() -> str:
    """A new temp folder of this replica (0700), made the temp dir of this process and of the
    processes it starts; torch's compile cache stays where it was."""
    base = tempfile.gettempdir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(base, f"torchinductor_{_user()}"))
    path = tempfile.mkdtemp(prefix="ray-ple-replica-", dir=base)
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    return path


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no name for this uid: torch uses the same fallback
        return str(os.getuid())


def start_reaper(root: int, tag: str, tmpdir: str | None = None) -> None:
    """Start the reaper of the process tree under `root` (this replica) and of its temp
    folder: an orphan in its own session (the shell that starts it exits at once), its lines
    in this process's log."""
    cmd = [sys.executable, "-m", "ray_ple.supervision.reaper", "--root", str(root),
           "--tag", tag] + (["--tmpdir", tmpdir] if tmpdir else [])
    subprocess.run(["sh", "-c", '"$@" &', "reaper", *cmd], start_new_session=True, check=True,
                   timeout=30, stdin=subprocess.DEVNULL)


def _used_under(folder: str) -> bool:
    """Does a live process work in `folder` or hold a file under it?"""
    for pid in (int(e.name) for e in os.scandir("/proc") if e.name.isdigit()):
        try:
            names = [os.readlink(f"/proc/{pid}/cwd")]
            names += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(n == folder or n.startswith(folder + "/") for n in names):
            return True
    return False


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
        if root is not None and _running(root):
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


def reap(root: int, tag: str, tmpdir: str | None = None, poll_s: float = POLL_S) -> list[str]:
    """Watch the tree under `root` until it is gone, then remove what it left."""
    tree = Tree(root)
    inventory: set[str] = set()
    log_event("reaper_started", replica=tag, root=root, tmpdir=tmpdir)
    while running := tree.refresh():
        inventory |= files_of(running)
        inventory = {p for p in inventory if os.path.lexists(p)}
        time.sleep(poll_s)
    removed = remove_unused(inventory)
    if (tmpdir and os.path.isdir(tmpdir) and os.lstat(tmpdir).st_uid == os.getuid()
            and not _used_under(tmpdir)):
        shutil.rmtree(tmpdir, ignore_errors=True)
        removed.append(tmpdir)
    log_event("reaper_done", replica=tag, root=root, pids=sorted(tree.procs), removed=removed)
    return removed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=int, required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--tmpdir")
    args = ap.parse_args()
    os.chdir("/")  # the reaper keeps no folder in use
    reap(args.root, args.tag, args.tmpdir)


if __name__ == "__main__":
    main()
