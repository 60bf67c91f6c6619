"""The offload actor's serving loop between steps: an orderly close ends it, and a step the
GPU stream announced but never posted ends the pair at its deadline.

Real parts: the project's offload actor and worker in spawned processes (`tests.rig`) over a
real pair segment; the test stands where the supervisor (CLOSED) or a stuck GPU stream
(`announced` ahead of `posted`) would.
"""

from __future__ import annotations

import time

import pytest

from ray_ple.protocol.fatal import EXIT_CODE, Reason
from ray_ple.protocol.handles import PairHandle
from ray_ple.protocol.layout import ControlBlock, Side, State
from ray_ple.protocol.shm import SharedSegment
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, start_offload, start_worker, write_checkpoint


def _peek(handle: dict) -> ControlBlock:
    h = PairHandle.model_validate(handle)
    return ControlBlock(SharedSegment.attach(h.segment), h.layout())


@pytest.fixture
def paused_pair(tmp_path):
    """An offload process serving a worker process paused after two steps: (block, offload
    process, worker process)."""
    table = write_checkpoint(tmp_path / "ckpt", rows=64, layers=2, ple_dim=8)
    spec = spec_for(tmp_path / "ckpt", max_tokens=8, deadlines={"step_s": 0.5},
                    supervisor={"heartbeat_interval_s": 0.05})
    off, handle, off_conn = start_offload(spec)
    wproc, wconn = start_worker(handle, spec.geometry, [[1, 2]] * 3, table, tmp_path,
                                pause_at=2)
    try:
        while not wconn.poll(0.2):  # (a worker that died never answers)
            assert wproc.is_alive() and off.is_alive(), "the pair did not start"
        assert wconn.recv() == ("paused", 2)
        block = _peek(handle)
        assert block.counters() == (2, (2,), 2) and block.state is State.READY
        yield block, off, wproc
    finally:
        wproc.kill()
        wproc.join(10)
        if off.is_alive():
            off_conn.send("stop")
        off.join(10)
        if off.is_alive():
            off.kill()
            off.join(5)
    assert ple_shm_entries() == []


def test_an_orderly_close_ends_the_offload_sides_serving_loop(paused_pair):
    """CLOSED (the supervisor's orderly end) stops the serving thread: it beats no more and
    leaves the state CLOSED, no verdict."""
    block, off, _ = paused_pair
    block.set_state(State.CLOSED)
    time.sleep(0.3)  # six polls: the loop has seen CLOSED
    beat = block.heartbeat(Side.OFFLOAD)
    time.sleep(0.5)
    assert block.heartbeat(Side.OFFLOAD) == beat, "the serving loop still runs after CLOSED"
    assert block.state is State.CLOSED and block.reason == 0
    assert off.is_alive()


def test_a_step_announced_but_never_posted_ends_the_pair_at_the_step_deadline(paused_pair):
    """The stream post: the host announces step s, the GPU stream writes its ids and `posted`.
    A stream that never runs leaves `announced` ahead of `posted`; the offload side spins for
    the post and ends the pair at `step_s` (STEP_DEADLINE), never waiting on forever."""
    block, off, _ = paused_pair
    block.announced = block.announced + 1  # what `WorkerEnd.announce` stores; no post follows
    off.join(10)
    assert off.exitcode == EXIT_CODE, "the offload side did not end the pair"
    assert block.state is State.FAILED and block.reason == Reason.STEP_DEADLINE
