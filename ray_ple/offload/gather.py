"""Row gather on the offload actor: the exact bytes of each token's row, nothing computed.

Ids outside `[0, rows)` read row 0, as vLLM's Gemma 4 does before its own lookup. A slot is
one part of a row (a column range of the table, `PleGeometry.slots`): the ids are clipped
once per step (`fresh` on a table's first part), then each part copies its columns.

numpy only (the offload process imports no torch): a whole row is `np.take` straight into
the slot; a column range is fancy indexing (`np.take` on a column view would first copy the
whole table to make it contiguous). With `gather_threads > 1`, whole-row steps of at least
`_PARALLEL_MIN_TOKENS` tokens are split by token over a thread pool (`np.take` copies
without the GIL). A part (fancy indexing) gains less from the pool: split over 8 threads, a
1.5 MB part took 640 us instead of 420 alone, a 3.1 MB part about the same either way, a
12.6 MB part ~1.1 ms against ~3.5 ms alone at the 3.1 MB rate (H200 host, bench/cuda/README.md,
late-run12), so only parts of `_PARALLEL_MIN_PART_BYTES` or more go to the pool. Ordinary
stores only: the flag that follows needs no `sfence` on x86-64.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ray_ple.testing import timing

_PARALLEL_MIN_TOKENS = 64
_PARALLEL_MIN_PART_BYTES = 4 << 20  # a part below this is faster on one thread (H200 host)


class RowGatherer:
    def __init__(self, table: np.ndarray, max_tokens: int, threads: int = 1) -> None:
        self.table = table  # (rows, row_bytes) uint8, read-only view of the node table
        self.rows = table.shape[0]
        self._idx = np.zeros(max_tokens, dtype=np.intp)
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

    def _copy(self, idx: np.ndarray, out: np.ndarray, c0: int) -> None:
        w = out.shape[1]
        if w == self.table.shape[1]:
            # the whole row: straight into `out` (mode="clip": ids are in range here, and the
            # default mode="raise" buffers the whole result, 3x slower)
            np.take(self.table, idx, axis=0, out=out, mode="clip")
        else:
            out[...] = self.table[idx, c0:c0 + w]

    def __call__(self, ids: np.ndarray, out: np.ndarray, col_offset: int = 0,
                 fresh: bool = True) -> None:
        t_start = time.monotonic_ns() if timing.ENABLED else 0
        t = ids.shape[0]
        if fresh:
            self._prepare(ids)
        if t == 1:  # one decode token: one row (part) copy
            out[0] = self.table[self._one, col_offset:col_offset + out.shape[1]]
        elif t > 1:
            idx = self._idx[:t]
            if (self._pool is not None and t >= _PARALLEL_MIN_TOKENS
                    and (out.shape[1] == self.table.shape[1]
                         or out.nbytes >= _PARALLEL_MIN_PART_BYTES)):
                bounds = np.linspace(0, t, self._threads + 1).astype(int)
                list(self._pool.map(lambda ab: self._copy(idx[ab[0]:ab[1]], out[ab[0]:ab[1]],
                                                          col_offset),
                                    zip(bounds[:-1], bounds[1:])))
            else:
                self._copy(idx, out, col_offset)
        if timing.ENABLED:
            timing.record("gather", t, t_start, time.monotonic_ns())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
