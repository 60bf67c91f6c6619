"""The offload actor's row gather: the exact bytes of each token's row (or part of it), with
and without its thread pool, ids outside the table reading row 0 as vLLM's Gemma 4 does."""

from __future__ import annotations

import tracemalloc

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


@pytest.mark.parametrize("layer_bytes", [24, 16, 4])  # unit takes (16: _MIN_UNIT); 4: fancy
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
    units = [u for u in (layer_bytes, 3 * layer_bytes) if u >= gather_module._MIN_UNIT]
    assert sorted(gather._units) == (units if contiguous else [])
    gather.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("whole", [True, False])
def test_a_take_copies_straight_into_the_slot(whole: bool, threads: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole row, and a part whose unit is `_MIN_UNIT`, go straight into `out`: no
    temporary of the step's rows (fancy indexing builds one; so does take's mode="raise").
    Each thread's index arithmetic may take a ufunc buffer (64 KiB): the bound allows it."""
    monkeypatch.setattr(gather_module, "_PARALLEL_MIN_PART_BYTES", 0)
    unit, t = gather_module._MIN_UNIT, 512
    row_bytes = 512 * unit
    c0, w = (0, row_bytes) if whole else (unit, 255 * unit)  # gcd(row_bytes, c0, w) == unit
    rng = np.random.default_rng(w)
    table = rng.integers(0, 256, (ROWS, row_bytes), dtype=np.uint8)
    ids = rng.integers(-5, ROWS + 5, t).astype(np.int32)
    gather = RowGatherer(table, max_tokens=t, threads=threads)
    out = np.zeros((t, w), np.uint8)
    started = not tracemalloc.is_tracing()
    try:
        gather(ids, out, col_offset=c0)  # the first call grows the part's index buffer
        out[:] = 0
        if started:
            tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        gather(ids, out, col_offset=c0, fresh=False)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
        gather.close()
    want = table[np.where((ids < 0) | (ids >= ROWS), 0, ids)]
    assert np.array_equal(out, want[:, c0:c0 + w])
    assert peak < out.nbytes // 4, (peak, out.nbytes)  # a temporary: a thread's third at least
