"""The transaction between two real processes over real shared memory (no vLLM, no Ray)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ray_ple.protocol.doorbell import Doorbell, DoorbellListener
from ray_ple.protocol.fatal import EXIT_CODE, Reason
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.protocol.handles import PairHandle
from ray_ple.protocol.layout import ControlBlock, State
from ray_ple.protocol.shm import SharedSegment
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, start_offload, start_worker, write_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    table = write_checkpoint(tmp_path / "ckpt", rows=500, layers=4, ple_dim=8)
    return tmp_path / "ckpt", table


def _peek(handle: dict) -> ControlBlock:
    h = PairHandle.model_validate(handle)
    return ControlBlock(SharedSegment.attach(h.segment), h.layout())


def test_thousands_of_steps_rows_verified(ckpt, tmp_path):
    path, table = ckpt
    spec = spec_for(path, max_tokens=64)
    rng = np.random.default_rng(1)
    # ids beyond the PLE vocabulary and negative ids read row 0, as vLLM maps them
    steps = [rng.integers(-3, 560, size=int(rng.integers(0, 65))).tolist() for _ in range(2000)]
    off, handle, off_conn = start_offload(spec)
    wproc, wconn = start_worker(handle, spec.geometry, steps, table, tmp_path)
    status, bad = wconn.recv()
    assert (status, bad) == ("done", 0)
    block = _peek(handle)
    assert block.counters() == (2000, (2000,), 2000)
    assert block.state is State.READY
    wconn.send("stop")
    off_conn.send("stop")
    wproc.join(10)
    off.join(10)
    assert ple_shm_entries() == []


def test_counter_skip_is_fatal_for_the_offload_side(ckpt, tmp_path):
    path, table = ckpt
    spec = spec_for(path, max_tokens=16)
    off, handle, _ = start_offload(spec)
    wproc, wconn = start_worker(handle, spec.geometry, [[1, 2]] * 10, table, tmp_path, pause_at=5)
    assert wconn.recv() == ("paused", 5)
    block = _peek(handle)
    block.posted = block.posted + 2  # a post that skips a step
    off.join(10)
    assert off.exitcode == EXIT_CODE
    assert block.state is State.FAILED and block.reason == Reason.COUNTER_SKIP
    wconn.send("go")  # the worker now sees FAILED (or the counters) and fails closed too
    wproc.join(15)
    assert wproc.exitcode == EXIT_CODE


def test_worker_heartbeat_loss_ends_the_pair(ckpt, tmp_path):
    path, table = ckpt
    spec = spec_for(path, max_tokens=16, deadlines={"heartbeat_s": 0.5})
    off, handle, _ = start_offload(spec)
    wproc, wconn = start_worker(handle, spec.geometry, [[3]] * 4, table, tmp_path, pause_at=2)
    assert wconn.recv() == ("paused", 2)
    block = _peek(handle)  # the test holds the memory: it outlives both sides
    wproc.kill()  # SIGKILL mid-run: its heartbeat stops
    wproc.join(5)
    off.join(10)
    assert off.exitcode == EXIT_CODE
    assert block.state is State.FAILED and block.reason == Reason.HEARTBEAT


def _parts_worker(handle: dict, geometry: dict, steps: list[list[int]], table_path: str,
                  conn) -> None:  # noqa: ANN001
    """Pull every slot of every step, each part checked against its columns of the table."""
    import torch

    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.geometry import PleGeometry
    from ray_ple.worker.pair import WorkerPair

    expect = np.load(table_path)
    geo = PleGeometry.model_validate(geometry)
    pair = WorkerPair.attach(PairHandle.model_validate(handle), geo, rank=0, transport="cpu",
                             deadlines=PleDeadlines(step_s=10.0), heartbeat_s=0.05)
    bad = 0
    for ids in steps:
        arr = np.asarray(ids, dtype=np.int32)
        mapped = np.where((arr >= 0) & (arr < geo.tables[0].rows), arr, 0)
        with pair.step(arr):
            for i, slot in enumerate(geo.slots()):
                out = torch.empty((len(ids), slot.row_elems), dtype=torch.bfloat16)
                pair.pull(i, out)
                got = out.view(torch.uint8).numpy().reshape(len(ids), slot.row_bytes)
                want = expect[mapped, slot.col_offset:slot.col_offset + slot.row_bytes]
                bad += int((got != want).any(axis=1).sum())
    conn.send(("done", bad, pair.block.counters()))
    conn.recv()


def test_parts_are_published_and_pulled_each_with_its_columns(ckpt, tmp_path):
    from ray_ple.protocol.geometry import geometry_from_config, read_hf_config
    from tests.rig import CTX

    path, table = ckpt
    spec = spec_for(path, max_tokens=64)
    geo = geometry_from_config(read_hf_config(path), max_tokens=64, parts=3)
    spec = spec.model_copy(update={"geometry": geo})
    assert [(s.name, s.first_layer, s.num_layers) for s in geo.slots()] == [
        ("model.embed_tokens_per_layer#0", 0, 1), ("model.embed_tokens_per_layer#1", 1, 1),
        ("model.embed_tokens_per_layer#2", 2, 2)]
    rng = np.random.default_rng(2)
    steps = [rng.integers(-3, 560, size=int(rng.integers(0, 65))).tolist() for _ in range(300)]
    off, handle, off_conn = start_offload(spec)
    np.save(tmp_path / "expect.npy", table)
    parent, child = CTX.Pipe()
    wproc = CTX.Process(target=_parts_worker, args=(handle, geo.model_dump(), steps,
                                                    str(tmp_path / "expect.npy"), child),
                        daemon=True)
    wproc.start()
    status, bad, counters = parent.recv()
    assert (status, bad) == ("done", 0)
    assert counters == (300, (300, 300, 300), 300)
    parent.send("stop")
    off_conn.send("stop")
    wproc.join(10)
    off.join(10)
    assert ple_shm_entries() == []


def _announcing_worker(handle: dict, geometry: dict, ids: list[int], table_path: str,
                       conn) -> None:  # noqa: ANN001
    """A worker whose step is posted late by "the stream": here a store sequence of this
    process in `ple_post`'s order (checks, ids, T, then `posted`), as a GPU writes it."""
    import time

    import torch

    from ray_ple.config import PleDeadlines
    from ray_ple.worker.pair import WorkerPair

    expect = np.load(table_path)
    geo = PleGeometry.model_validate(geometry)
    pair = WorkerPair.attach(PairHandle.model_validate(handle), geo, rank=0, transport="cpu",
                             deadlines=PleDeadlines(step_s=10.0), heartbeat_s=0.05)
    w, b = pair.worker, pair.block
    time.sleep(0.3)  # the offload side (no spin) is asleep on its doorbell by now
    asleep = b.sleeping
    s = w.announce(len(ids))
    if w.must_ring():
        pair._bell.ring()  # the pair's own ringer: the listener takes no other
    time.sleep(0.2)  # the GPU is late: the woken side must spin for the post, not sleep
    waiting = (b.sleeping, b.posted)
    c = b.counters()
    assert b.ready() and c.posted == c.released == s - 1 and b.announced == s
    b.token_count = len(ids)
    b.ids[:len(ids)] = np.asarray(ids, dtype=np.int32)
    b.posted = c.released + 1
    out = torch.empty((len(ids), geo.tables[0].row_elems), dtype=torch.bfloat16)
    pair.pull(0, out)
    pair.transport.release(s)
    w.end_step(s)
    got = out.view(torch.uint8).numpy().reshape(len(ids), geo.tables[0].row_bytes)
    conn.send((asleep, waiting, int((got != expect[ids]).any(axis=1).sum()), b.counters()))
    conn.recv()


def test_an_announced_step_wakes_the_offload_side_which_spins_for_the_stream_post(ckpt,
                                                                                  tmp_path):
    """The stream post's half on the host: the announcement is the doorbell's word, so a
    sleeping offload side is woken by it and waits, spinning, for a `posted` stored later
    by someone that cannot ring (a GPU); then serves the step as any other."""
    from tests.rig import CTX

    path, table = ckpt
    spec = spec_for(path, max_tokens=16)
    off, handle, off_conn = start_offload(spec)
    np.save(tmp_path / "expect.npy", table)
    parent, child = CTX.Pipe()
    wproc = CTX.Process(target=_announcing_worker, args=(
        handle, spec.geometry.model_dump(), [5, 17, 499], str(tmp_path / "expect.npy"), child),
        daemon=True)
    wproc.start()
    asleep, waiting, bad, counters = parent.recv()
    assert asleep, "the offload side should have been asleep before the announcement"
    assert waiting == (False, 0), "woken and spinning (not asleep), the step not yet posted"
    assert bad == 0
    assert counters == (1, (1,), 1)
    assert off.is_alive() and _peek(handle).state is State.READY
    parent.send("stop")
    off_conn.send("stop")
    wproc.join(10)
    off.join(10)
    assert ple_shm_entries() == []


def test_a_spinning_offload_side_serves_back_to_back_steps_then_sleeps(ckpt, tmp_path):
    """`offload_spin_us`: after a step the offload side spins (`sleeping` stays down, so a
    step posted meanwhile needs no ring) and serves back-to-back steps; once no post came
    for the spin's length it sleeps on its doorbell, and a later post is still served."""
    path, table = ckpt
    spin_s = 1.0  # the most `offload_spin_us` allows
    spec = spec_for(path, max_tokens=16, offload_spin_us=spin_s * 1e6)
    off, handle, off_conn = start_offload(spec)
    block = _peek(handle)
    steps = [[i % 500, (7 * i) % 500] for i in range(300)] + [[4, 5]]
    t0 = time.monotonic()
    wproc, wconn = start_worker(handle, spec.geometry, steps, table, tmp_path, pause_at=300)
    assert wconn.recv() == ("paused", 300)
    assert time.monotonic() - t0 < 60, "a spin that missed posts would take ~1 s a step"
    _, published_ns = block.handoff_times()  # the last step's publish, on this process's clock
    if time.monotonic_ns() - published_ns < spin_s * 0.5e9:  # (unless this test was late)
        assert block.sleeping is False, "spinning after the last step, not asleep"
    while not block.sleeping and time.monotonic_ns() - published_ns < 15e9:
        time.sleep(0.005)
    asleep_after_s = (time.monotonic_ns() - published_ns) / 1e9
    assert block.sleeping is True and asleep_after_s >= spin_s * 0.9, asleep_after_s
    wconn.send("go")  # one more step: the worker rings, the sleeping side wakes and serves it
    assert wconn.recv() == ("done", 0)
    assert block.counters() == (301, (301,), 301)
    wconn.send("stop")
    off_conn.send("stop")
    wproc.join(10)
    off.join(10)
    assert ple_shm_entries() == []


def test_doorbell_wait_returns_at_a_ring_or_at_its_timeout_never_later():
    """The kernel's receive timeout bounds each wait (the offload side beats between
    waits), whatever timeout came before; a ring wakes it; a ring left queued only wakes a
    later wait early (the offload side then finds nothing new and sleeps again)."""
    token = os.urandom(16).hex()
    listener, bell = DoorbellListener(token), Doorbell(token)
    try:
        for timeout in (0.3, 0.05, 0.3):
            t0 = time.monotonic()
            assert listener.wait(timeout) is False
            took = time.monotonic() - t0
            assert timeout * 0.9 <= took < timeout + 2, (timeout, took)
        bell.ring()
        t0 = time.monotonic()
        assert listener.wait(30) is True and time.monotonic() - t0 < 5
        bell.ring()
        bell.ring()
        assert listener.wait(0.3) is True  # the first of the two
        assert listener.wait(0.3) is True  # the one left queued: an early, spurious wake
        assert listener.wait(0.1) is False
    finally:
        bell.close()
        listener.close()
