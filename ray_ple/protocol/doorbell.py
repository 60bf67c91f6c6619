"""A wake-up hint for the offload actor, so that an idle pair costs no CPU.

The counters in the control block are the truth; a ring carries no data, a lost ring only
delays the offload actor until its next poll, and a spurious one is ignored.

Same user only (`ray_ple.protocol.peers`): the listener binds its name itself at setup (taken
by anyone else: one clear error naming the holder) and the kernel stamps every datagram with
its sender's credentials (`SO_PASSCRED`), so a ring from another uid is dropped unseen. The
ringing side needs no check: a ring carries nothing, and the name is ours for as long as the
listener lives.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from ray_ple.protocol.peers import CRED_SPACE, bind_own, datagram_uid

_TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds


def bell_address(token: str) -> bytes:
    return b"\0ray-ple-bell-" + token.encode()


class DoorbellListener:
    def __init__(self, token: str) -> None:
        self._uid = os.getuid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        bind_own(self._sock, bell_address(token), "the offload actor's doorbell")
        self._timeout_s: float | None = None  # the receive timeout set on the socket

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
        self._set_timeout(timeout_s)
        while True:
            try:
                if self._ours():
                    return True
            except BlockingIOError:  # the timeout, as the kernel reports it
                return False
            left = deadline - time.monotonic()  # another user's datagram: wait out the rest
            if left <= 0:
                return False
            self._set_timeout(left)

    def close(self) -> None:
        self._sock.close()


class Doorbell:
    def __init__(self, token: str) -> None:
        self._addr = bell_address(token)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)

    def ring(self) -> None:
        try:
            self._sock.sendto(b"!", self._addr)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            pass  # a ring is pending already, or the listener is gone (its deadline will say)

    def close(self) -> None:
        self._sock.close()
