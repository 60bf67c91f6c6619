"""Row gather on the offload actor: the exact bytes of each token's row, nothing computed.

Ids outside `[0, rows)` read row 0, as vLLM's Gemma 4 does before its own lookup. A slot is
one part of a row (a column range of the table, `PleGeometry.slots`): the ids are clipped
once per step (`fresh` on a table's first part), then each part copies its columns.

numpy only (the offload process imports no torch). Every copy is one `np.take` from a
contiguous source straight into the slot (no temporary, and without the GIL, so it splits
over threads): a whole row from the table itself, a part from the table viewed as a flat
run of *units*, the largest byte count that divides the row and every part's offset and
width (one layer's 512 B on E4B), at indices `id * units_per_row + unit`. Fancy indexing of
a column view (`table[idx, c0:c0 + w]`, how parts were gathered before) builds a temporary
and copies it: a step's parts 1.9-2.2x slower at T >= 64 on the H200 host
(bench/README.md, gather; 1.7-2.3x on a 2-core VM), and `np.take` on the column
view itself first copies the whole table to make it contiguous.

With `gather_threads > 1`, steps of at least `_PARALLEL_MIN_TOKENS` tokens whose copy is
a whole row or at least `_PARALLEL_MIN_PART_BYTES` are split by token over a thread pool;
a smaller part is faster on one thread than handed to the pool (H200 host,
docs/history.md, the late pull). Ordinary stores only: the flag that follows needs no
`sfence` on x86-64.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ray_ple.instrument import timing

_PARALLEL_MIN_TOKENS = 64
_PARALLEL_MIN_PART_BYTES = 4 << 20  # a part below this is faster on one thread (H200 host)
_MIN_UNIT = 16  # below this a part's take moves too little per index: fancy indexing


class RowGatherer:
    def __init__(self, table: np.ndarray, max_tokens: int, threads: int = 1) -> None:
        self.table = table  # (rows, row_bytes) uint8, read-only view of the node table
        self.rows, self.row_bytes = table.shape
        self._idx = np.zeros(max_tokens, dtype=np.intp)
        self._flat = np.zeros(0, dtype=np.intp)  # a part's unit indices, grown on first use
        self._units: dict[int, np.ndarray] = {}  # unit bytes -> the table as a flat run
        self._cols: dict[tuple[int, int, int], np.ndarray] = {}  # a part's units in a row
        self._one = 0
        self._threads = threads
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="ray-ple-gather")
                      if threads > 1 else None)

    def _prepare(self, ids: np.ndarray) -> None:
        t = ids.shape[0]
        if t == 1:
            v = int(ids[0])
            self._one = v if 0 <= v < self.rows else 0
            return
        idx = self._idx[:t]
        np.copyto(idx, ids, casting="unsafe")
        idx[(idx < 0) | (idx >= self.rows)] = 0

    def _unit_view(self, c0: int, w: int) -> tuple[int, np.ndarray] | None:
        """The table as a flat run of units fitting the part `[c0, c0 + w)`, or None."""
        unit = math.gcd(self.row_bytes, c0, w)
        if unit < _MIN_UNIT or not self.table.flags.c_contiguous:
            return None
        view = self._units.get(unit)
        if view is None:
            view = self._units[unit] = self.table.reshape(-1).view(np.dtype((np.void, unit)))
        return unit, view

    def _copy(self, a: int, b: int, out: np.ndarray, c0: int,
              fit: tuple[int, np.ndarray] | None) -> None:
        """Tokens `[a, b)` of the step into `out[a:b]` (a thread's share, or the whole);
        `fit`: the part's unit view, None for a whole row or a part fancy-indexed."""
        idx, w = self._idx[a:b], out.shape[1]
        if w == self.row_bytes:
            # the whole row: straight into `out` (mode="clip": ids are in range here, and the
            # default mode="raise" buffers the whole result, 3x slower)
            np.take(self.table, idx, axis=0, out=out[a:b], mode="clip")
            return
        if fit is None:
            out[a:b] = self.table[idx, c0:c0 + w]
            return
        unit, flat = fit
        k, per_row = w // unit, self.row_bytes // unit
        sub = self._flat[a * k:b * k].reshape(b - a, k)  # each thread its own range
        np.multiply(idx[:, None], per_row, out=sub)
        if k == 1:  # a first part of one layer: the latency-bound one, fewest calls
            sub += c0 // unit
        else:
            cols = self._cols.get((unit, c0, k))
            if cols is None:
                cols = self._cols[unit, c0, k] = np.arange(c0 // unit, c0 // unit + k)
            sub += cols
        np.take(flat, sub, out=out[a:b].view(flat.dtype), mode="clip")

    def __call__(self, ids: np.ndarray, out: np.ndarray, col_offset: int = 0,
                 fresh: bool = True) -> None:
        t_start = time.monotonic_ns() if timing.ENABLED else 0
        t = ids.shape[0]
        if fresh:
            self._prepare(ids)
        if t == 1:  # one decode token: one row (part) copy
            out[0] = self.table[self._one, col_offset:col_offset + out.shape[1]]
        elif t > 1:
            w = out.shape[1]
            fit = self._unit_view(col_offset, w) if w != self.row_bytes else None
            if fit is not None and self._flat.size < (need := t * (w // fit[0])):
                # grown here, before any thread takes its share of it
                self._flat = np.zeros(max(need, self._idx.size), dtype=np.intp)
            if (self._pool is not None and t >= _PARALLEL_MIN_TOKENS
                    and (w == self.row_bytes or out.nbytes >= _PARALLEL_MIN_PART_BYTES)):
                bounds = np.linspace(0, t, self._threads + 1).astype(int).tolist()
                list(self._pool.map(lambda ab: self._copy(ab[0], ab[1], out, col_offset, fit),
                                    zip(bounds[:-1], bounds[1:])))
            else:
                self._copy(0, t, out, col_offset, fit)
        if timing.ENABLED:
            timing.record("gather", t, t_start, time.monotonic_ns())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
