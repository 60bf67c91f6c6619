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


@pytest.mark.parametrize("layer_bytes", [24, 4])  # a unit take; below _MIN_UNIT, fancy indexing
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("t", [2, 64, 300])
def test_uneven_parts_of_layers_are_the_tables_bytes(layer_bytes: int, contiguous: bool,
                                                     threads: int, t: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 1, 2 and 3 layers (units of one and of three layers), a table whose rows are
    not contiguous (a view of a wider array), ids out of range, one thread and a pool that
    takes every part (each thread its own range of the index buffer): the same bytes."""
    monkeypatch.setattr(gather_module, "_PARALLEL_MIN_PART_BYTES", 0)
    rng = np.random.default_rng(layer_bytes + t)
    row_bytes = 6 * layer_bytes
    wide = rng.integers(0, 256, (ROWS, row_bytes + (0 if contiguous else 8)), dtype=np.uint8)
    table = wide[:, :row_bytes]
    ids = rng.integers(-5, ROWS + 5, t).astype(np.int32)
    want = table[np.where((ids < 0) | (ids >= ROWS), 0, ids)]
    gather = RowGatherer(table, max_tokens=512, threads=threads)
    first = 0
    for k, layers in enumerate((1, 2, 3)):
        c0, w = first * layer_bytes, layers * layer_bytes
        part = np.zeros((t, w), np.uint8)
        gather(ids, part, col_offset=c0, fresh=k == 0)
        assert np.array_equal(part, want[:, c0:c0 + w]), k
        first += layers
    assert bool(gather._units) == (contiguous and layer_bytes >= gather_module._MIN_UNIT)
    gather.close()
