"""Same user only: the one rule for every local socket that hands out memory or rings a side.

Abstract Unix socket names (the node-table broker, the doorbells) have no file permissions:
any process of any user on the node can bind a free name or connect to a bound one. So every
channel checks the kernel's word on who is at the other end (`SO_PEERCRED` on a connected
stream, `SCM_CREDENTIALS` on each datagram) and refuses any other uid; a name found taken by
another user is one clear `PleEnvironmentError` at setup that names the holder, never a hang
and never a silent fallback (`docs/design-notes.md#shared-memory`, "Same user only").
"""

from __future__ import annotations

import errno
import os
import socket
import struct

from ray_ple.errors import PleEnvironmentError

_UCRED = struct.Struct("3i")  # pid, uid, gid (struct ucred)
CRED_SPACE = socket.CMSG_SPACE(_UCRED.size)  # recvmsg ancillary room for one SCM_CREDENTIALS


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix stream socket."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def datagram_uid(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """Sender uid the kernel attached to a datagram (receiver has `SO_PASSCRED`); None if absent."""
    for level, kind, data in ancdata:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS) and \
                len(data) >= _UCRED.size:
            return _UCRED.unpack_from(data)[1]
    return None


def require_same_uid(uid: int, pid: int, what: str) -> None:
    """Refuse a peer of another user (the one check every side makes)."""
    if uid != os.getuid():
        raise PleEnvironmentError(
            f"{what}: the peer is pid {pid} of uid {uid}, not this user (uid {os.getuid()}); "
            f"another user holds a ray-ple socket name on this node, refusing it")


def _socket_inodes(name: bytes) -> set[int]:
    """Inodes of the sockets bound to abstract `name` (as /proc/net/unix prints it: @...)."""
    want = "@" + name[1:].decode(errors="replace")
    inodes = set()
    with open("/proc/net/unix") as f:
        next(f, None)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7] == want and parts[6] != "0":
                inodes.add(int(parts[6]))
    return inodes


def name_holder(name: bytes) -> tuple[int | None, int | None]:
    """(pid, uid) of a process holding abstract socket `name`; None where it cannot be seen
    (another user's process is visible to root only)."""
    targets = {f"socket:[{i}]" for i in _socket_inodes(name)}
    if not targets:
        return None, None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return int(pid), os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
    return None, None


def describe_holder(name: bytes) -> str:
    pid, uid = name_holder(name)
    if pid is None:
        return "a process this user cannot see (another user's)"
    return f"pid {pid} of uid {uid}"


def bind_own(sock: socket.socket, name: bytes, what: str) -> None:
    """Bind `name` or fail clearly: a name a client depends on is never left to someone else."""
    try:
        sock.bind(name)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PleEnvironmentError(
                f"{what}: the socket name {name[1:].decode(errors='replace')!r} is taken by "
                f"{describe_holder(name)}") from exc
        raise PleEnvironmentError(f"{what}: cannot bind its socket: {exc.strerror}") from exc
