"""The node's one read-only host copy of each PLE table, shared by every offload actor.

The copy is a sealed `TableSegment` (a nameless memfd, freed by the kernel with its last
holder, so a crash cannot leak it; written once, then sealed against writes and resizes and
mapped read-only by every holder). Holders find each other through an abstract Unix socket
named after the table's fingerprint (`table_broker`): the first to bind it listens at once,
loads the table from the checkpoint's safetensors (`table_file`, never through a GPU), seals
it, and then hands the segment's fd to whoever connects (SCM_RIGHTS). Any holder takes the
name over when the server goes, so the copy stays shareable while anyone holds it.

The name is public and computable, so nothing it leads to is trusted
(`docs/design-notes.md#shared-memory`, "Same user only"): a receiver checks the broker's uid
(`SO_PEERCRED`) before it reads a byte, then the fd (`check_sealed`: owner, type, seals, and
the size it computed from the checkpoint, not the one written in the segment) before it maps
it; a name held by another user is one clear `PleEnvironmentError` at setup naming that user,
never a hang and never its rows.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time

import numpy as np

from ray_ple.config import HugePages
from ray_ple.errors import PleEnvironmentError, PleModelError, PleShmError
from ray_ple.log import log_event
from ray_ple.offload.table_broker import bind_name, broker_name, hand_over, receive_table
from ray_ple.offload.table_file import TableFile, check_shape, load_rows
from ray_ple.offload.table_segment import TableSegment
from ray_ple.protocol.geometry import TableGeometry
from ray_ple.protocol.peers import name_holder
from ray_ple.protocol.shm import PAGE, page_align
from ray_ple.table_source import TableSource

_HDR = struct.Struct("<QIIQQ32s")  # magic, version, ready, rows, row_bytes, fingerprint
_MAGIC = 0x31424154454C5052  # "RPLETAB1"
_REFUSED_S = 0.5  # a holder of ours listens right after it binds: longer refused is not ours
# How often a holder that does not serve tries to take the name over. A newcomer that binds
# the name between a server's end and a holder's take-over loads a second copy (the node
# then holds two until one side's holders are gone), so this window is kept short; a bind
# attempt is one socket() + bind() + close().
_TAKEOVER_S = 0.05


def table_segment_size(shape: TableGeometry) -> int:
    """Bytes of the table's segment (header page + rows): what a received fd must hold."""
    return page_align(PAGE + shape.table_bytes)


def want_huge_pages(seg: TableSegment) -> bool:
    """Ask for transparent huge pages on a table mapping; False where the host refuses.

    A random row of E4B (21,504 B) touches six 4 KiB pages, each a TLB miss on a large
    table. Shared memory gets huge pages only where the host allows them for shmem
    (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`: `advise` honours this hint,
    `always`/`within_size` need none, `never` ignores it); the loader asks before it
    writes (the page cache is filled then) and every holder asks for its own mapping.
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        seg.map.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


class NodeTable:
    """This process's hold on the node table: a read-only (rows, row_bytes) view."""

    def __init__(self, segment: TableSegment, shape: TableGeometry, fp: str,
                 listener: socket.socket | None, name: bytes) -> None:
        self.segment, self.shape, self.fingerprint = segment, shape, fp
        self.huge_pages = segment.hugetlb or want_huge_pages(segment)
        segment.populate()  # no page fault on a step's first touch of a row
        self.rows = np.ndarray((shape.rows, shape.row_bytes), np.uint8, segment.map, PAGE)
        self.rows.flags.writeable = False
        self._name = name
        self._listener = listener
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ray-ple-table-broker",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Serve the fd while holding the name; otherwise try to take the name over."""
        while not self._closed.is_set():
            if self._listener is None:
                self._listener = bind_name(self._name)
                if self._listener is None:
                    self._closed.wait(_TAKEOVER_S)
                    continue
                self._listener.listen(64)
            try:
                self._listener.settimeout(0.5)
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                hand_over(conn, self.fingerprint, self.segment)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        self._thread.join(timeout=2)
        self.rows = np.empty((0, self.shape.row_bytes), np.uint8)  # our view goes first
        self.segment.close()


def _header(seg: TableSegment) -> tuple[int, int, int, int, int, str]:
    magic, version, ready, rows, row_bytes, fp = _HDR.unpack_from(seg.map, 0)
    return magic, version, ready, rows, row_bytes, fp.hex()


def acquire_table(source: TableSource, *, shm_dir: str, deadline_s: float,
                  huge_pages: HugePages = "auto") -> NodeTable:
    """Hold this node's copy of `source`, loading it if no one on the node has it yet
    (`huge_pages`: see `PleConfig.huge_pages`; the loader decides, sharers map its copy)."""
    with TableFile.open(source) as table:
        return _acquire(table, source, shm_dir, deadline_s, huge_pages)


def _acquire(table: TableFile, source: TableSource, shm_dir: str, deadline_s: float,
             huge_pages: HugePages) -> NodeTable:
    loc = table.loc
    check_shape(loc, source.table)
    fp = table.fingerprint(source.table)
    name, size = broker_name(fp), table_segment_size(source.table)
    deadline = time.monotonic() + deadline_s
    refused_since: float | None = None
    while time.monotonic() < deadline:
        listener = bind_name(name)
        if listener is not None:
            listener.listen(64)  # at once: a peer that connects while we load sees our uid
            return _load_and_serve(listener, name, table, source, fp, shm_dir, huge_pages)
        try:
            seg = receive_table(name, fp, size, deadline)
        except ConnectionRefusedError:
            now = time.monotonic()
            refused_since = refused_since if refused_since is not None else now
            if now - refused_since >= _REFUSED_S:
                pid, uid = name_holder(name)
                seen_long = now - refused_since >= 4 * _REFUSED_S
                if uid != os.getuid() and (uid is not None or seen_long):
                    who = (f"pid {pid} of uid {uid}" if uid is not None
                           else "a process this user cannot see (another user's)")
                    raise PleEnvironmentError(
                        f"node table {fp[:12]}: its broker name is taken by {who}, which does "
                        f"not serve it; refusing to wait") from None
            time.sleep(0.05)
            continue
        refused_since = None
        if seg is None:
            time.sleep(0.05)  # the holder just went away
            continue
        magic, _, ready, rows, row_bytes, got_fp = _header(seg)
        if (magic, ready, rows, row_bytes, got_fp) != (_MAGIC, 1, source.table.rows,
                                                       source.table.row_bytes, fp):
            seg.close()
            raise PleModelError(f"node table {fp[:12]} served by a peer does not match")
        if huge_pages == "require" and not seg.hugetlb:
            seg.close()
            raise PleEnvironmentError(
                f"node table {fp[:12]}: ple.huge_pages is 'require' but the node's copy, "
                f"loaded by another holder, is on 4 KiB pages")
        log_event("table_hold", role="sharer", fingerprint=fp[:12],
                  bytes=source.table.table_bytes, hugetlb=seg.hugetlb)
        return NodeTable(seg, source.table, fp, None, name)
    raise PleModelError(f"table {fp[:12]} not available within {deadline_s}s")


def _table_segment(size: int, shm_dir: str, huge_pages: HugePages,
                   fp: str) -> TableSegment:
    """The loader's new segment: on the hugetlb pool where `huge_pages` asks and the pool
    holds it (a step's first gather is bound by memory latency, and 2 MiB pages take most of
    its page walks away: 3-18% on the H200 host, bench/README.md, huge pages), else 4 KiB
    shmem pages as before; "require" makes a short pool the one error."""
    if huge_pages != "off":
        try:
            return TableSegment.create("table", size, shm_dir, huge=True)
        except PleShmError as exc:  # a short pool is refused before a page is taken
            if huge_pages == "require":
                raise
            log_event("table_huge_pages", fingerprint=fp[:12], used=False, reason=str(exc))
    return TableSegment.create("table", size, shm_dir)


def _load_and_serve(listener: socket.socket, name: bytes, table: TableFile,
                    source: TableSource, fp: str, shm_dir: str,
                    huge_pages: HugePages) -> NodeTable:
    """Load the table into a new sealed segment, then serve it on `listener` (already ours)."""
    try:
        seg = _table_segment(PAGE + source.table.table_bytes, shm_dir, huge_pages, fp)
    except BaseException:
        listener.close()
        raise
    try:
        if not seg.hugetlb:
            want_huge_pages(seg)
        load_rows(seg, table, source.table, fp)
        _HDR.pack_into(seg.map, 0, _MAGIC, 1, 1, source.table.rows, source.table.row_bytes,
                       bytes.fromhex(fp))
        seg.seal()
    except BaseException:
        listener.close()
        seg.close()
        raise
    log_event("table_hold", role="loader", fingerprint=fp[:12], bytes=source.table.table_bytes,
              hugetlb=seg.hugetlb)
    return NodeTable(seg, source.table, fp, listener, name)
