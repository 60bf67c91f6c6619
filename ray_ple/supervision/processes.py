"""The processes of one replica, each held by a pidfd.

Liveness and kills never act on a pid number alone: a pid is adopted only through a pidfd
opened while the process is known to be ours (a direct report of the process itself, or a
descendant of the replica checked after the pidfd was opened), and every signal goes through
that pidfd, so a recycled pid can neither be killed nor mistaken for the live process.
"""

from __future__ import annotations

import os
import select
import signal

import psutil

from ray_ple.protocol.fatal import Failure, Reason


def proc_state(pid: int) -> str | None:
    """One-letter state from /proc (None when gone; 'Z' is gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def descends_from(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


class ProcessSet:
    """Watched processes: `what` by pid, a pidfd each, one poller that wakes on any exit."""

    def __init__(self) -> None:
        self._fds: dict[int, tuple[int, str]] = {}
        self.poller = select.poll()

    def add(self, pid: int, what: str) -> bool:
        """Hold `pid` from now on; False if it is already gone (the caller decides)."""
        if pid in self._fds:
            return True
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        self._fds[pid] = (fd, what)
        self.poller.register(fd, select.POLLIN)
        return True

    def adopt_descendants(self, root: int) -> None:
        """Hold every current descendant of `root`, each vouched for after its pidfd opened."""
        try:
            children = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            if child.pid in self._fds:
                continue
            try:
                fd = os.pidfd_open(child.pid)
            except OSError:
                continue
            if not descends_from(child.pid, root):  # the pid was recycled meanwhile
                os.close(fd)
                continue
            self._fds[child.pid] = (fd, _name(child))
            self.poller.register(fd, select.POLLIN)

    def named(self) -> dict[int, str]:
        return {pid: what for pid, (_, what) in self._fds.items()}

    def exited(self, pid: int) -> bool:
        fd, _ = self._fds[pid]
        return bool(select.select([fd], [], [], 0)[0])

    def liveness(self) -> Failure | None:
        """Every held process alive and running: exited, or stopped (SIGSTOP), is fatal."""
        for pid, (_, what) in self._fds.items():
            if self.exited(pid):
                return Failure(Reason.PEER_DEAD, f"{what} (pid {pid}) died")
            if proc_state(pid) in ("T", "t"):  # the pidfd vouches that `pid` is still ours
                return Failure(Reason.PEER_STOPPED, f"{what} (pid {pid}) is stopped")
        return None

    def kill_all(self) -> list[str]:
        """SIGKILL through every pidfd; never raises (what failed is returned)."""
        errors = []
        for pid, (fd, what) in self._fds.items():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass  # already exited
            except Exception as exc:  # noqa: BLE001 - reported, the others are still killed
                errors.append(f"{pid}:{what}:{exc!r}")
        return errors

    def running(self) -> list[str]:
        return [f"{pid}:{what}:{proc_state(pid)}" for pid, (_, what) in self._fds.items()
                if not self.exited(pid)]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"
