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
        with open(f"/proc/{pid}/stat", "rb") as f:
            return _state(f.read())
    except OSError:
        return None


def _state(stat: bytes) -> str | None:
    try:
        state = stat.rsplit(b")", 1)[1].split(None, 1)[0].decode()
    except IndexError:
        return None
    return None if state in ("Z", "X") else state


def _stat_state(fd: int) -> str | None:
    """`proc_state` through a /proc/<pid>/stat kept open: one pread, no open or path walk
    (the supervisor reads every process's state 50 times a second)."""
    try:
        return _state(os.pread(fd, 1024, 0))
    except OSError:  # ESRCH once the process is gone
        return None


def descends_from(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


class ProcessSet:
    """Watched processes: `what` by pid, a pidfd each, one poller that wakes on any exit."""

    def __init__(self) -> None:
        self._fds: dict[int, tuple[int, str]] = {}
        self._stat: dict[int, int] = {}  # pid -> its /proc/<pid>/stat, opened after the pidfd
        self._pid_of: dict[int, int] = {}  # pidfd -> pid
        self.poller = select.poll()

    def _hold(self, pid: int, fd: int, what: str) -> None:
        self._fds[pid] = (fd, what)
        self._pid_of[fd] = pid
        self.poller.register(fd, select.POLLIN)
        try:  # opened after the pidfd, whose poll says whether `pid` is still this process
            self._stat[pid] = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # gone already: the pidfd reports the exit

    def add(self, pid: int, what: str) -> bool:
        """Hold `pid` from now on; False if it is already gone (the caller decides)."""
        if pid in self._fds:
            return True
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        self._hold(pid, fd, what)
        return True

    def adopt(self, pid: int, what: str, root: int) -> bool:
        """Hold `pid` if it descends from `root`, checked after its pidfd opened: a pid
        recycled before the open fails the check, one recycled after it cannot be the
        process the pidfd holds. False (nothing held) otherwise."""
        if pid in self._fds:
            return descends_from(pid, root)
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        if not descends_from(pid, root):
            os.close(fd)
            return False
        self._hold(pid, fd, what)
        return True

    def adopt_descendants(self, root: int) -> None:
        """Hold every current descendant of `root`, each vouched for after its pidfd opened."""
        try:
            children = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            if child.pid not in self._fds:
                self.adopt(child.pid, _name(child), root)

    def discard(self, pid: int) -> None:
        """Stop holding `pid` (one that turned out not to be ours)."""
        fd, _ = self._fds.pop(pid)
        self.poller.unregister(fd)
        del self._pid_of[fd]
        os.close(fd)
        if (stat := self._stat.pop(pid, None)) is not None:
            os.close(stat)

    def close(self) -> None:
        """Let go of every fd (the watcher's way out)."""
        for pid in list(self._fds):
            self.discard(pid)

    def named(self) -> dict[int, str]:
        return {pid: what for pid, (_, what) in self._fds.items()}

    def exited(self, pid: int) -> bool:
        fd, _ = self._fds[pid]
        return bool(select.select([fd], [], [], 0)[0])

    def liveness(self) -> Failure | None:
        """Every held process alive and running: exited, or stopped (SIGSTOP), is fatal.
        One poll of every pidfd, then one pread per process: cheap enough for 50 Hz."""
        for fd, _ in self.poller.poll(0):
            pid = self._pid_of[fd]
            return Failure(Reason.PEER_DEAD, f"{self._fds[pid][1]} (pid {pid}) died")
        for pid, fd in self._stat.items():  # no exit seen above: each `pid` is still ours
            if _stat_state(fd) in ("T", "t"):
                return Failure(Reason.PEER_STOPPED,
                               f"{self._fds[pid][1]} (pid {pid}) is stopped")
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
