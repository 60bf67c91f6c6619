"""The checkpoint file that holds a PLE table: where the tensor is, what identifies it, and
its rows, all read through one open fd.

The rows are read from the checkpoint's safetensors (never through a GPU) and cast exactly as
the engine would where the checkpoint's dtype is not the engine's.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ray_ple.errors import PleModelError
from ray_ple.log import Progress
from ray_ple.offload.table_segment import TableSegment
from ray_ple.protocol.geometry import ITEMSIZE, TableGeometry, safetensors_dtype
from ray_ple.protocol.shm import PAGE
from ray_ple.table_source import TableSource

_CHUNK = 64 << 20


class TensorLocation(BaseModel):
    """Where the table's bytes are in the checkpoint."""

    model_config = ConfigDict(frozen=True)
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


# safetensors' own limit on the header (its JSON), and its dtypes' sizes in bytes
MAX_HEADER_BYTES = 100 << 20
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def read_header(fd: int, path: str) -> tuple[dict, int]:
    """The safetensors header of an open file, read through its fd (never the path again),
    checked whole before any entry is used: one `PleModelError` naming the file for a
    truncated or oversized length, a header that is not a JSON object, an entry without a
    known dtype, a shape of counts and two offsets, offsets that disagree with shape x dtype,
    overlap another tensor or run past the end of the file. Returns (header, data start)."""
    size = os.fstat(fd).st_size

    def bad(why: str) -> PleModelError:
        return PleModelError(f"{path} is not a valid safetensors file: {why}")

    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise bad(f"header length {n} exceeds the file ({size} bytes) or safetensors' "
                  f"limit ({MAX_HEADER_BYTES} bytes)")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    data = size - 8 - n
    spans = []
    for name, e in header.items():
        if name == "__metadata__":
            if not isinstance(e, dict):
                raise bad("__metadata__ is not an object")
            continue
        if not (isinstance(e, dict) and e.get("dtype") in DTYPE_BYTES
                and isinstance(e.get("shape"), list)
                and all(type(d) is int and d >= 0 for d in e["shape"])
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(type(o) is int for o in e["data_offsets"])):
            raise bad(f"entry {name!r} is not {{dtype, shape, data_offsets}} of a known "
                      f"dtype, counts and two offsets: {str(e)[:200]}")
        begin, end = e["data_offsets"]
        want = DTYPE_BYTES[e["dtype"]] * _product(e["shape"])
        if not 0 <= begin <= end or end - begin != want:
            raise bad(f"entry {name!r} spans bytes [{begin}, {end}) but its shape "
                      f"{e['shape']} of {e['dtype']} is {want} bytes")
        if end > data:
            raise bad(f"entry {name!r} ends at byte {end} of a {data}-byte data section "
                      "(the file is truncated)")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"entries {a!r} and {b!r} overlap")
    return header, 8 + n


def _product(dims: list[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


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
            weight_map = _weight_map(index)
            files = [ckpt / weight_map[n] for n in source.tensor_names
                     if n in weight_map] or files
        if not files:
            raise PleModelError(f"no .safetensors files in {ckpt}")
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise PleModelError(f"cannot open {path}: {exc.strerror}") from None
            try:
                stat = os.fstat(fd)  # before the header: a rewrite after it shows in the end
                header, data_start = read_header(fd, str(path))
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

    def fingerprint(self, shape: TableGeometry) -> str:
        return fingerprint(self.loc, shape, self.stat)

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


def _weight_map(index: Path) -> dict[str, str]:
    """`weight_map` of a sharded checkpoint's index (tensor -> file name in the folder)."""
    try:
        doc = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PleModelError(f"{index} is not a readable JSON index: {exc}") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(
            isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
            for v in wmap.values()):
        raise PleModelError(f"{index}: weight_map must map tensor names to file names of "
                            "this folder")
    return wmap


def check_checkpoint(checkpoint_dir: str) -> None:
    """Every safetensors file of a checkpoint, its header checked as `read_header` checks it,
    and its index's files present: one `PleModelError` before anything starts (the offload
    side reads the table's header again, through the fd it reads the rows with)."""
    ckpt = Path(checkpoint_dir)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        missing = sorted({f for f in _weight_map(index).values() if not (ckpt / f).is_file()})
        if missing:
            raise PleModelError(f"{index} names files that are not in {ckpt}: {missing[:5]}")
    for path in sorted(ckpt.glob("*.safetensors")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise PleModelError(f"cannot open {path}: {exc.strerror}") from None
        try:
            read_header(fd, str(path))
        finally:
            os.close(fd)


def locate_tensor(source: TableSource) -> TensorLocation:
    """Where the PLE tensor is in the checkpoint's safetensors files."""
    with TableFile.open(source) as f:
        return f.loc


def check_shape(loc: TensorLocation, shape: TableGeometry) -> None:
    if loc.shape != (shape.rows, shape.row_elems):
        raise PleModelError(f"{loc.name} has shape {list(loc.shape)}, the model config says "
                            f"[{shape.rows}, {shape.row_elems}]")


def fingerprint(loc: TensorLocation, shape: TableGeometry,
                st: os.stat_result | None = None) -> str:
    """Identity of one table copy: the tensor's file (`st`: the fstat of the fd its rows are
    read through; the path's stat for a file at rest) and entry, plus the engine dtype."""
    st = os.stat(loc.file) if st is None else st
    key = json.dumps([loc.model_dump(), st.st_size, st.st_mtime_ns, st.st_ino,
                      shape.model_dump()], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def load_rows(seg: TableSegment, table: TableFile, shape: TableGeometry, fp: str) -> None:
    """Read the rows into `seg` through the file's one fd, then refuse them if the file
    changed since it was opened (`TableFile.check_unchanged`)."""
    loc = table.loc
    src_dtype = safetensors_dtype(loc.dtype)
    nbytes = shape.table_bytes
    progress = Progress("table_load", nbytes, tensor=loc.name, fingerprint=fp[:12])
    dst = memoryview(seg.map)[PAGE:PAGE + nbytes]
    if src_dtype == shape.dtype:
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

        src_item, rows_per_chunk = ITEMSIZE[src_dtype], max(1, _CHUNK // shape.row_bytes)
        out = torch.frombuffer(dst, dtype=getattr(torch, shape.dtype)).view(shape.rows, -1)
        with open(table.fd, "rb", buffering=0, closefd=False) as f:
            for r in range(0, shape.rows, rows_per_chunk):
                n = min(rows_per_chunk, shape.rows - r)
                f.seek(loc.begin + r * shape.row_elems * src_item)
                raw = bytearray(f.read(n * shape.row_elems * src_item))
                src = torch.frombuffer(raw, dtype=getattr(torch, src_dtype)).view(n, -1)
                out[r:r + n].copy_(src)
                progress.update((r + n) * shape.row_bytes)
        del out
    dst.release()
    table.check_unchanged()
    progress.finish()
