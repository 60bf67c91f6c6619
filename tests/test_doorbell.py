"""A flood of datagrams from another user on the doorbell's public name delays no ring.

The flooder is real: a forked process that drops to uid 65534 (so the suite must run as root)
and sends to the listener's abstract name as fast as it can, for the whole of a ring/wait
cycle of a healthy pair. The listener's queue holds `net.unix.max_dgram_qlen` datagrams (10
by default), so before the listener took datagrams from its ringer only, every ring met a full
queue and was lost, and each wait ran to its timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import pytest

from ray_ple.errors import PleEnvironmentError
from ray_ple.protocol.doorbell import Doorbell, DoorbellListener, bell_address, ring_address

NOBODY = 65534
ROUNDS = 200
WAIT_S = 1.0  # each wait's timeout: a ring that is lost shows as a wait that reaches it

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to become uid 65534")


def _flood(token: str, report: int, started: int) -> None:
    """The flooder's body (never returns): uid 65534, datagrams as fast as it can; on
    SIGTERM it reports (sent, refused) on `report`."""
    counts = [0, 0]

    def stop(*_: object) -> None:
        os.write(report, struct.pack("qq", *counts))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    addr = bell_address(token)
    while True:
        try:
            sock.sendto(b"!", addr)
            counts[0] += 1
        except OSError:  # the queue is full (EAGAIN), or the kernel refuses us (EPERM)
            counts[1] += 1
        if counts[0] + counts[1] == 1000:
            os.write(started, b"s")


def start_flooder(token: str) -> tuple[int, int, int]:
    """Fork a uid-65534 flooder of `token`'s doorbell: (pid, its report fd, its started fd)."""
    report_r, report_w = os.pipe()
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_r)
            os.close(started_r)
            _flood(token, report_w, started_w)
        finally:
            os._exit(1)
    os.close(report_w)
    os.close(started_w)
    return pid, report_r, started_r


def test_a_flood_from_another_uid_neither_loses_a_ring_nor_delays_a_wake_up():
    token = os.urandom(16).hex()
    listener = DoorbellListener(token)
    pid, report_r, started_r = start_flooder(token)
    bell = None
    try:
        assert os.read(started_r, 1) == b"s", "the flooder is flooding"
        time.sleep(0.05)  # the listener's queue is full of its datagrams by now
        bell = Doorbell(token)  # the worker attaches while the flood goes on
        woke, rung, slow = [], [], []
        in_wait = threading.Event()

        def ringer() -> None:
            for _ in range(ROUNDS):
                if not in_wait.wait(5):
                    return
                in_wait.clear()
                time.sleep(0.001)  # the listener is blocked in its wait by now
                rung.append(bell.ring())

        t = threading.Thread(target=ringer)
        t.start()
        for _ in range(ROUNDS):
            t0 = time.monotonic()
            in_wait.set()
            got = listener.wait(WAIT_S)
            took = time.monotonic() - t0
            woke.append(got)
            if took > 0.25:
                slow.append(round(took, 3))
        t.join(10)
    finally:
        os.kill(pid, signal.SIGTERM)
        sent, refused = struct.unpack("qq", os.read(report_r, 16))
        os.waitpid(pid, 0)
        os.close(report_r)
        os.close(started_r)
        if bell is not None:
            bell.close()
        listener.close()
    assert sent + refused > 10 * ROUNDS, "the flood ran for the whole cycle"
    assert all(woke), f"{woke.count(False)} of {ROUNDS} waits ran to their timeout"
    assert len(rung) == ROUNDS and False not in rung, f"{rung.count(False)} rings not sent"
    assert not slow, f"wake-ups slower than 250 ms: {slow}"
    # after the listener took its ringer, the kernel refused the flooder: at most a queue's
    # worth (net.unix.max_dgram_qlen) of its datagrams were ever taken in
    assert sent <= 64, (sent, refused)


def test_the_ringer_name_taken_by_another_uid_is_one_error_at_attach_naming_it():
    """The one sender the listener accepts is whoever holds `ring_address`: a squatter of
    another uid on it makes the worker's attach fail clearly, never ring into its socket."""
    token = os.urandom(16).hex()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(ring_address(token))
            os.write(ready_w, b"r")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(ready_w)
    listener = DoorbellListener(token)
    try:
        assert os.read(ready_r, 1) == b"r"
        with pytest.raises(PleEnvironmentError, match=f"taken by pid {pid} of uid {NOBODY}"):
            Doorbell(token)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        listener.close()
