"""A wake-up hint for the offload actor, so that an idle pair costs no CPU.

The counters in the control block are the truth; a ring carries no data, a lost ring only
delays the offload actor until its next poll, and a spurious one is ignored.
"""

from __future__ import annotations

import socket
import time

from ray_ple.testing import timing


def bell_address(token: str) -> bytes:
    return b"\0ray-ple-bell-" + token.encode()


class DoorbellListener:
    def __init__(self, token: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(bell_address(token))

    def wait(self, timeout_s: float) -> bool:
        """Block until a ring or the timeout; drain queued rings. True if rung."""
        self._sock.settimeout(timeout_s)
        try:
            self._sock.recv(16)
        except TimeoutError:
            return False
        if timing.ENABLED:
            timing.record("wake", time.monotonic_ns())
        self._sock.setblocking(False)
        try:
            while True:
                self._sock.recv(16)
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        self._sock.close()


class Doorbell:
    def __init__(self, token: str) -> None:
        self._addr = bell_address(token)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)

    def ring(self) -> None:
        if timing.ENABLED:
            timing.record("post", time.monotonic_ns())
        try:
            self._sock.sendto(b"!", self._addr)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            pass  # a ring is pending already, or the listener is gone (its deadline will say)

    def close(self) -> None:
        self._sock.close()
