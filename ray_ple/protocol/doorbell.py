"""A wake-up hint for the offload actor, so that an idle pair costs no CPU.

The counters in the control block are the truth; a ring carries no data, a lost ring only
delays the offload actor until its next poll, and a spurious one is ignored.

Same user only (`ray_ple.protocol.peers`): the listener binds its name itself at setup (taken
by anyone else: one clear error naming the holder) and the kernel stamps every datagram with
its sender's credentials (`SO_PASSCRED`), so a ring from another uid is dropped unseen.

One ringer only, chosen by the kernel: the ringing side binds its own name next to the
listener's (`ring_address`, taken by anyone else: one clear error at attach) and the listener
connects its socket to that name as soon as it is bound. From then on the kernel refuses
every other sender's datagram (EPERM, nothing queued), and the ringer's datagrams skip the
listener's queue limit (`net.unix.max_dgram_qlen`), so no flood of datagrams on the public
name can fill the queue and make a ring fail: a ring fails only while this ringer's own
earlier rings are still unread, which wake the listener anyway. The wait stays one system
call per wake-up once connected.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from ray_ple.log import log_event
from ray_ple.protocol.peers import CRED_SPACE, bind_own, datagram_uid

_TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds


def bell_address(token: str) -> bytes:
    """The listener's abstract name (the offload actor's)."""
    return b"\0ray-ple-bell-" + token.encode()


def ring_address(token: str) -> bytes:
    """The ringer's abstract name (the worker's): the one sender the listener accepts."""
    return b"\0ray-ple-ring-" + token.encode()


class DoorbellListener:
    def __init__(self, token: str) -> None:
        self._uid = os.getuid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        bind_own(self._sock, bell_address(token), "the offload actor's doorbell")
        self._ringer = ring_address(token)
        self._connected = False  # to the ringer: the kernel takes no one else's datagrams
        self._timeout_s: float | None = None  # the receive timeout set on the socket

    def _connect(self) -> None:
        """Accept datagrams from the ringer's socket only, once it is bound (one system call
        per try, and only until the worker has attached)."""
        try:
            self._sock.connect(self._ringer)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # not bound yet
        self._connected = True
        log_event("doorbell_connected", ringer=self._ringer[1:].decode(errors="replace"))

    def _ours(self) -> bool:
        """Take one datagram; True if our own user sent it (no credentials: not ours)."""
        _, ancdata, _, _ = self._sock.recvmsg(16, CRED_SPACE)
        return datagram_uid(ancdata) == self._uid

    def _set_timeout(self, timeout_s: float) -> None:
        """The kernel's own receive timeout (`SO_RCVTIMEO`): a blocking `recvmsg` returns at
        a ring or at the timeout in one system call, where Python's socket timeout polls
        first and needs the timeout set again on every wait."""
        if timeout_s != self._timeout_s:
            usec = max(1, round(timeout_s * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                  _TIMEVAL.pack(usec // 1_000_000, usec % 1_000_000))
            self._timeout_s = timeout_s

    def wait(self, timeout_s: float) -> bool:
        """Block until a ring of our user or the timeout. True if rung.

        Queued rings are not drained: one left over wakes a later wait early, which the
        offload side takes as spurious (the counters are the truth)."""
        deadline = time.monotonic() + timeout_s
        if not self._connected:
            self._connect()
        self._set_timeout(timeout_s)
        while True:
            try:
                if self._ours():
                    return True
            except BlockingIOError:  # the timeout, as the kernel reports it
                return False
            if not self._connected:  # a flood before the ringer was bound: stop it now
                self._connect()
            left = deadline - time.monotonic()  # another user's datagram: wait out the rest
            if left <= 0:
                return False
            self._set_timeout(left)

    def close(self) -> None:
        self._sock.close()


class Doorbell:
    """The worker's side: one per pair, bound to `ring_address` for the pair's lifetime."""

    def __init__(self, token: str) -> None:
        self._addr = bell_address(token)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        bind_own(self._sock, ring_address(token), "the worker's doorbell")
        self._sock.setblocking(False)

    def ring(self) -> bool:
        """Ring; False where no ring was sent: earlier rings of ours are still queued (they
        wake the listener), or the listener is gone (its deadline will say). A listener that
        takes another ringer refuses this one (PermissionError, raised: never silent)."""
        try:
            self._sock.sendto(b"!", self._addr)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            return False
        return True

    def close(self) -> None:
        self._sock.close()
