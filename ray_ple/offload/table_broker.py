"""The fd broker of a node table: an abstract Unix socket named after the table's
fingerprint, over which a holder hands the sealed segment's fd (SCM_RIGHTS) to holders of
its own user.

The name is public and computable, so a receiver trusts nothing it leads to: the broker's
uid (`SO_PEERCRED`) is checked before a byte is read, then the fd (`check_sealed`) before it
is mapped; a broker sends nothing to a peer of another user. Who binds the name, and when a
holder takes it over, is `table_store`'s.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time

from ray_ple.errors import PleModelError
from ray_ple.offload.table_segment import TableSegment, check_sealed, segment_size
from ray_ple.protocol.peers import peer_cred, require_same_uid


def broker_name(fp: str) -> bytes:
    """The broker's abstract socket name; anyone can compute it, hence the uid checks."""
    return f"\0ray-ple-table-{os.getuid()}-{fp}".encode()


def bind_name(name: bytes) -> socket.socket | None:
    """A socket bound to `name`, or None where someone holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(name)
        return sock
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise


def hand_over(conn: socket.socket, fp: str, segment: TableSegment) -> None:
    """Send the segment's fd to the peer on `conn` if it is of this user; nothing otherwise."""
    if peer_cred(conn)[1] != os.getuid():
        return
    meta = json.dumps({"fingerprint": fp, "size": segment.size,
                       "token": segment.token}).encode()
    try:
        socket.send_fds(conn, [meta], [segment.fd])
    except OSError:
        pass


def receive_table(name: bytes, fp: str, size: int, deadline: float) -> TableSegment | None:
    """The holder's segment, mapped read-only once the broker and the fd pass every check;
    None while no one serves it yet. Raises ConnectionRefusedError if the name is bound but
    no one listens (see `table_store.acquire_table`)."""
    what = f"node table {fp[:12]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            sock.connect(name)
        except (BlockingIOError, TimeoutError):
            return None
        pid, uid, _ = peer_cred(sock)
        require_same_uid(uid, pid, f"{what} broker")  # before a byte of it is read
        sock.settimeout(max(0.05, deadline - time.monotonic()))  # the holder may be loading
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        except (TimeoutError, ConnectionResetError):
            return None
    finally:
        sock.close()
    if not fds:
        return None
    try:
        meta = json.loads(msg)
        if meta.get("fingerprint") != fp:
            raise PleModelError(f"{what}: the broker serves table {meta.get('fingerprint')}")
        check_sealed(fds[0], size, f"{what} served by pid {pid}")
        return TableSegment(fds[0], segment_size(fds[0], size), str(meta.get("token", "")),
                             owner=False, writable=False)
    except BaseException:
        os.close(fds[0])
        raise
