"""Row gather on the offload actor: the exact bytes of each token's row, nothing computed.

Ids outside `[0, rows)` read row 0, as vLLM's Gemma 4 does before its own lookup. Small steps
use numpy (a few microseconds at T = 1); large steps may use torch's multi-threaded
`index_select` on CPU when `gather_threads > 1` (torch then runs with CUDA hidden).
"""

from __future__ import annotations

import time

import numpy as np

from ray_ple.testing import timing

_TORCH_MIN_TOKENS = 64


class RowGatherer:
    def __init__(self, table: np.ndarray, max_tokens: int, threads: int = 1) -> None:
        self.table = table  # (rows, row_bytes) uint8, read-only view of the node table
        self.rows = table.shape[0]
        self._idx = np.zeros(max_tokens, dtype=np.intp)
        self._threads = threads
        self._torch_table = None
        if threads > 1:
            import torch

            torch.set_num_threads(threads)
            self._torch_table = torch.from_numpy(table)
            self._torch_idx = torch.from_numpy(self._idx)

    def __call__(self, ids: np.ndarray, out: np.ndarray) -> None:
        t_start = time.monotonic_ns() if timing.ENABLED else 0
        t = ids.shape[0]
        if t == 1:  # one decode token: a scalar check and one row copy (~4 us less)
            v = int(ids[0])
            out[0] = self.table[v if 0 <= v < self.rows else 0]
        else:
            idx = self._idx[:t]
            np.copyto(idx, ids, casting="unsafe")
            idx[(idx < 0) | (idx >= self.rows)] = 0
            if self._torch_table is not None and t >= _TORCH_MIN_TOKENS:
                import torch

                torch.index_select(self._torch_table, 0, self._torch_idx[:t],
                                   out=torch.from_numpy(out))
            else:
                # ids are in range here; mode="clip" lets numpy write `out` directly (the
                # default mode="raise" buffers the whole result: 3x slower, a fresh temporary
                # per step)
                np.take(self.table, idx, axis=0, out=out, mode="clip")
        if timing.ENABLED:
            timing.record("gather", t, t_start, time.monotonic_ns())
