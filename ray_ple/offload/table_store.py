"""The node's one read-only host copy of each PLE table, shared by every offload actor.

The copy is a sealed `SharedSegment` (a nameless memfd, freed by the kernel with its last
holder, so a crash cannot leak it; written once, then sealed against writes and resizes and
mapped read-only by every holder). Holders find each other through an abstract Unix socket
named after the table's fingerprint (`broker_name`): the first to bind it listens at once,
loads the table from the checkpoint's safetensors (never through a GPU), seals it, and then
hands the segment's fd to whoever connects (SCM_RIGHTS). Any holder takes the name over when
the server goes, so the copy stays shareable while anyone holds it.

The name is public and computable, so nothing it leads to is trusted
(`docs/design-notes.md#shared-memory`, "Same user only"): a receiver checks the broker's uid
(`SO_PEERCRED`) before it reads a byte, then the fd (`check_sealed`: owner, type, seals, and
the size it computed from the checkpoint, not the one written in the segment) before it maps
it; a name held by another user is one clear `PleEnvironmentError` at setup naming that user,
never a hang and never its rows.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from ray_ple.config import HugePages
from ray_ple.errors import PleEnvironmentError, PleModelError, PleShmError
from ray_ple.log import Progress, log_event
from ray_ple.protocol.geometry import ITEMSIZE, LayerGeometry, safetensors_dtype
from ray_ple.protocol.peers import name_holder, peer_cred, require_same_uid
from ray_ple.protocol.shm import PAGE, SharedSegment, check_sealed, page_align, segment_size
from ray_ple.protocol.table_source import TableSource

_HDR = struct.Struct("<QIIQQ32s")  # magic, version, ready, rows, row_bytes, fingerprint
_MAGIC = 0x31424154454C5052  # "RPLETAB1"
_CHUNK = 64 << 20
_REFUSED_S = 0.5  # a holder of ours listens right after it binds: longer refused is not ours
# How often a holder that does not serve tries to take the name over. A newcomer that binds
# the name between a server's end and a holder's take-over loads a second copy (the node
# then holds two until one side's holders are gone), so this window is kept short; a bind
# attempt is one socket() + bind() + close().
_TAKEOVER_S = 0.05


class TensorLocation(BaseModel):
    """Where the table's bytes are in the checkpoint."""

    model_config = ConfigDict(frozen=True)
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(fd: int) -> tuple[dict, int]:
    """The safetensors header of an open file, read through its fd (never the path again)."""
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    return json.loads(os.pread(fd, n, 8)), 8 + n


# What says a file is the one that was opened: a replaced path shows another inode (our fd
# still reads the old one); a rewrite in place a new size, mtime or ctime.
_IDENTITY = ("st_size", "st_mtime_ns", "st_ino", "st_dev", "st_ctime_ns")


class TableFile:
    """The checkpoint file that holds the table, opened once: its header, its fingerprint's
    stat and its rows are all read through this one fd, so a checkpoint replaced on the path
    meanwhile is never read in part, and one rewritten in place is caught by `check_unchanged`
    after the load (one error, never mixed rows)."""

    def __init__(self, fd: int, loc: TensorLocation, stat: os.stat_result) -> None:
        self.fd, self.loc, self.stat = fd, loc, stat

    @classmethod
    def open(cls, source: TableSource) -> TableFile:
        """Find the PLE tensor in the checkpoint's safetensors files and keep its file open."""
        ckpt = Path(source.checkpoint_dir)
        files = sorted(ckpt.glob("*.safetensors"))
        index = ckpt / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = [ckpt / weight_map[n] for n in source.tensor_names
                     if n in weight_map] or files
        if not files:
            raise PleModelError(f"no .safetensors files in {ckpt}")
        for path in files:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                stat = os.fstat(fd)  # before the header: a rewrite after it shows in the end
                header, data_start = _read_header(fd)
                for name in source.tensor_names:
                    if name in header:
                        e = header[name]
                        b, end = e["data_offsets"]
                        return cls(fd, TensorLocation(
                            file=str(path.resolve()), name=name, dtype=e["dtype"],
                            shape=tuple(e["shape"]), begin=data_start + b,
                            end=data_start + end), stat)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise PleModelError(f"checkpoint {ckpt} has no PLE tensor (looked for "
                            f"{list(source.tensor_names)})")

    def fingerprint(self, layer: LayerGeometry) -> str:
        return fingerprint(self.loc, layer, self.stat)

    def check_unchanged(self) -> None:
        """Refuse what was read if the file changed since it was opened."""
        now = os.fstat(self.fd)
        changed = [k for k in _IDENTITY if getattr(now, k) != getattr(self.stat, k)]
        if changed:
            raise PleModelError(f"{self.loc.file} changed while its table {self.loc.name} was "
                                f"read ({', '.join(changed)} differ): refusing the rows; "
                                "start again once the checkpoint is written")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def locate_tensor(source: TableSource) -> TensorLocation:
    """Where the PLE tensor is in the checkpoint's safetensors files."""
    with TableFile.open(source) as f:
        return f.loc


def _check_shape(loc: TensorLocation, layer: LayerGeometry) -> None:
    if loc.shape != (layer.rows, layer.row_elems):
        raise PleModelError(f"{loc.name} has shape {list(loc.shape)}, the model config says "
                            f"[{layer.rows}, {layer.row_elems}]")


def table_segment_size(layer: LayerGeometry) -> int:
    """Bytes of the table's segment (header page + rows): what a received fd must hold."""
    return page_align(PAGE + layer.table_bytes)


def broker_name(fp: str) -> bytes:
    """The broker's abstract socket name; anyone can compute it, hence the uid checks."""
    return f"\0ray-ple-table-{os.getuid()}-{fp}".encode()


def want_huge_pages(seg: SharedSegment) -> bool:
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


def fingerprint(loc: TensorLocation, layer: LayerGeometry,
                st: os.stat_result | None = None) -> str:
    """Identity of one table copy: the tensor's file (`st`: the fstat of the fd its rows are
    read through; the path's stat for a file at rest) and entry, plus the engine dtype."""
    st = os.stat(loc.file) if st is None else st
    key = json.dumps([loc.model_dump(), st.st_size, st.st_mtime_ns, st.st_ino,
                      layer.model_dump()], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


class NodeTable:
    """This process's hold on the node table: a read-only (rows, row_bytes) view."""

    def __init__(self, segment: SharedSegment, layer: LayerGeometry, fp: str,
                 listener: socket.socket | None, name: bytes) -> None:
        self.segment, self.layer, self.fingerprint = segment, layer, fp
        self.huge_pages = segment.hugetlb or want_huge_pages(segment)
        segment.populate()  # no page fault on a step's first touch of a row
        self.rows = np.ndarray((layer.rows, layer.row_bytes), np.uint8, segment.map, PAGE)
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
                self._listener = _try_bind(self._name)
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
                if peer_cred(conn)[1] != os.getuid():
                    continue
                meta = json.dumps({"fingerprint": self.fingerprint, "size": self.segment.size,
                                   "token": self.segment.token}).encode()
                try:
                    socket.send_fds(conn, [meta], [self.segment.fd])
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        self._thread.join(timeout=2)
        self.rows = np.empty((0, self.layer.row_bytes), np.uint8)  # our view goes first
        self.segment.close()


def _try_bind(name: bytes) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(name)
        return sock
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise


def _receive(name: bytes, fp: str, size: int, deadline: float) -> SharedSegment | None:
    """The holder's segment, mapped read-only once the broker and the fd pass every check;
    None while no one serves it yet. Raises ConnectionRefusedError if the name is bound but
    no one listens (see `acquire_table`)."""
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
        return SharedSegment(fds[0], segment_size(fds[0], size), str(meta.get("token", "")),
                             owner=False, writable=False)
    except BaseException:
        os.close(fds[0])
        raise


def _header(seg: SharedSegment) -> tuple[int, int, int, int, int, str]:
    magic, version, ready, rows, row_bytes, fp = _HDR.unpack_from(seg.map, 0)
    return magic, version, ready, rows, row_bytes, fp.hex()


def _load(seg: SharedSegment, table: TableFile, layer: LayerGeometry, fp: str) -> None:
    """Read the rows into `seg` through the file's one fd, then refuse them if the file
    changed since it was opened (`TableFile.check_unchanged`)."""
    loc = table.loc
    src_dtype = safetensors_dtype(loc.dtype)
    nbytes = layer.table_bytes
    progress = Progress("table_load", nbytes, tensor=loc.name, fingerprint=fp[:12])
    dst = memoryview(seg.map)[PAGE:PAGE + nbytes]
    if src_dtype == layer.dtype:
        with open(table.fd, "rb", buffering=0, closefd=False) as f:
            f.seek(loc.begin)
            done = 0
            while done < nbytes:
                n = f.readinto(dst[done:done + _CHUNK])
                if not n:
                    raise PleModelError(f"{loc.file} ends inside {loc.name}")
                done += n
                progress.update(done)
    else:  # cast exactly as the engine would (torch CPU; CUDA stays hidden in this process)
        import torch

        src_item, rows_per_chunk = ITEMSIZE[src_dtype], max(1, _CHUNK // layer.row_bytes)
        out = torch.frombuffer(dst, dtype=getattr(torch, layer.dtype)).view(layer.rows, -1)
        with open(table.fd, "rb", buffering=0, closefd=False) as f:
            for r in range(0, layer.rows, rows_per_chunk):
                n = min(rows_per_chunk, layer.rows - r)
                f.seek(loc.begin + r * layer.row_elems * src_item)
                raw = bytearray(f.read(n * layer.row_elems * src_item))
                src = torch.frombuffer(raw, dtype=getattr(torch, src_dtype)).view(n, -1)
                out[r:r + n].copy_(src)
                progress.update((r + n) * layer.row_bytes)
        del out
    dst.release()
    table.check_unchanged()
    progress.finish()


def acquire_table(source: TableSource, *, shm_dir: str, deadline_s: float,
                  huge_pages: HugePages = "auto") -> NodeTable:
    """Hold this node's copy of `source`, loading it if no one on the node has it yet
    (`huge_pages`: see `PleConfig.huge_pages`; the loader decides, sharers map its copy)."""
    with TableFile.open(source) as table:
        return _acquire(table, source, shm_dir, deadline_s, huge_pages)


def _acquire(table: TableFile, source: TableSource, shm_dir: str, deadline_s: float,
             huge_pages: HugePages) -> NodeTable:
    loc = table.loc
    _check_shape(loc, source.layer)
    fp = table.fingerprint(source.layer)
    name, size = broker_name(fp), table_segment_size(source.layer)
    deadline = time.monotonic() + deadline_s
    refused_since: float | None = None
    while time.monotonic() < deadline:
        listener = _try_bind(name)
        if listener is not None:
            listener.listen(64)  # at once: a peer that connects while we load sees our uid
            return _load_and_serve(listener, name, table, source, fp, shm_dir, huge_pages)
        try:
            seg = _receive(name, fp, size, deadline)
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
        if (magic, ready, rows, row_bytes, got_fp) != (_MAGIC, 1, source.layer.rows,
                                                       source.layer.row_bytes, fp):
            seg.close()
            raise PleModelError(f"node table {fp[:12]} served by a peer does not match")
        if huge_pages == "require" and not seg.hugetlb:
            seg.close()
            raise PleEnvironmentError(
                f"node table {fp[:12]}: ple.huge_pages is 'require' but the node's copy, "
                f"loaded by another holder, is on 4 KiB pages")
        log_event("table_hold", role="sharer", fingerprint=fp[:12],
                  bytes=source.layer.table_bytes, hugetlb=seg.hugetlb)
        return NodeTable(seg, source.layer, fp, None, name)
    raise PleModelError(f"table {fp[:12]} not available within {deadline_s}s")


def _table_segment(size: int, shm_dir: str, huge_pages: HugePages,
                   fp: str) -> SharedSegment:
    """The loader's new segment: on the hugetlb pool where `huge_pages` asks and the pool
    holds it (a step's first gather is bound by memory latency, and 2 MiB pages take most of
    its page walks away: 3-18% on the H200 host, bench/cuda/results/late-run17/hugetlb), else 4 KiB
    shmem pages as before; "require" makes a short pool the one error."""
    if huge_pages != "off":
        try:
            return SharedSegment.create("table", size, shm_dir, sealable=True, huge=True)
        except PleShmError as exc:  # a short pool is refused before a page is taken
            if huge_pages == "require":
                raise
            log_event("table_huge_pages", fingerprint=fp[:12], used=False, reason=str(exc))
    return SharedSegment.create("table", size, shm_dir, sealable=True)


def _load_and_serve(listener: socket.socket, name: bytes, table: TableFile,
                    source: TableSource, fp: str, shm_dir: str,
                    huge_pages: HugePages) -> NodeTable:
    """Load the table into a new sealed segment, then serve it on `listener` (already ours)."""
    try:
        seg = _table_segment(PAGE + source.layer.table_bytes, shm_dir, huge_pages, fp)
    except BaseException:
        listener.close()
        raise
    try:
        if not seg.hugetlb:
            want_huge_pages(seg)
        _load(seg, table, source.layer, fp)
        _HDR.pack_into(seg.map, 0, _MAGIC, 1, 1, source.layer.rows, source.layer.row_bytes,
                       bytes.fromhex(fp))
        seg.seal()
    except BaseException:
        listener.close()
        seg.close()
        raise
    log_event("table_hold", role="loader", fingerprint=fp[:12], bytes=source.layer.table_bytes,
              hugetlb=seg.hugetlb)
    return NodeTable(seg, source.layer, fp, listener, name)
