"""The offload actor's row gather: the exact bytes of each token's row (or part of it), with
and without its thread pool, ids outside the table reading row 0 as vLLM's Gemma 4 does."""

from __future__ import annotations

import numpy as np
import pytest

from ray_ple.offload import gather as gather_module
from ray_ple.offload.gather import RowGatherer

ROWS, ROW_BYTES, PARTS = 1000, 96, 3


@pytest.mark.parametrize("part_pool", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("t", [1, 5, 64, 300])
def test_rows_and_parts_are_the_tables_bytes(threads: int, t: int, part_pool: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if part_pool:  # parts this small go to the pool only with the threshold at 0
        monkeypatch.setattr(gather_module, "_PARALLEL_MIN_PART_BYTES", 0)
    rng = np.random.default_rng(t)
    table = rng.integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    ids = rng.integers(-5, ROWS + 5, t)
    want = table[np.where((ids < 0) | (ids >= ROWS), 0, ids)]
    gather = RowGatherer(table, max_tokens=512, threads=threads)
    try:
        whole = np.zeros((t, ROW_BYTES), np.uint8)
        gather(ids, whole)
        assert np.array_equal(whole, want)
        w = ROW_BYTES // PARTS
        for k in range(PARTS):
            part = np.zeros((t, w), np.uint8)
            gather(ids, part, col_offset=k * w, fresh=k == 0)
            assert np.array_equal(part, want[:, k * w:(k + 1) * w]), k
    finally:
        gather.close()
