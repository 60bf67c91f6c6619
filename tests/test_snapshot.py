"""The supervisor's snapshot is one instant's counters, or says it is none.

A real pair segment stepped by the protocol's own sides (`WorkerEnd`, `OffloadEnd`, the
consumer's release). The reads of `ControlBlock.snapshot` go through `os.pread`; a stalled
pread (two whole steps happen inside it) stands for a watcher descheduled between two reads.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import numpy as np
import pytest

from ray_ple.config import PleConfig, PleDeadlines
from ray_ple.protocol.fatal import Reason
from ray_ple.protocol.geometry import PleGeometry, TableGeometry
from ray_ple.protocol.handles import make_pair_handle
from ray_ple.protocol.layout import (
    POSTED_OFF,
    RELEASED_OFF,
    ControlBlock,
    Counters,
    PairLayout,
    Side,
    State,
)
from ray_ple.protocol.shm import SharedSegment
from ray_ple.protocol.transaction import OffloadEnd, WorkerEnd, invariant_violation
from ray_ple.supervision.supervisor import Supervisor, SupervisorSpec, _Watched
from ray_ple.table_source import TableSource

PARTS = 2
GEOMETRY = PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=4, tables=(
    TableGeometry(name="model.embed_tokens_per_layer", rows=8, row_elems=16,
                  dtype="bfloat16"),), row_layers=PARTS, parts=(1,) * PARTS)
DEADLINES = PleDeadlines()


class Pair:
    """A READY pair, counters at 0, stepped whole by both sides and the consumer."""

    def __init__(self) -> None:
        self.layout = PairLayout.compute(GEOMETRY.max_tokens,
                                         tuple(s.row_bytes for s in GEOMETRY.slots()))
        self.segment = SharedSegment.create("pair", self.layout.size)
        self.block = b = ControlBlock(self.segment, self.layout)
        b.write_header(self.segment.token, "0" * 64)
        self.beat()
        b.set_state(State.READY)
        names = GEOMETRY.slot_names
        self.worker = WorkerEnd(b, 0, DEADLINES, names)
        self.offload = OffloadEnd(b, 0, DEADLINES, names)

    def beat(self) -> None:
        now = time.monotonic_ns()
        self.block.beat(Side.WORKER, now)
        self.block.beat(Side.OFFLOAD, now)

    def step(self) -> int:
        s = self.worker.begin(np.array([1], np.int32))  # posted
        assert self.offload.next_step() == s
        self.offload.publish(s, lambda _i, _ids, _rows: None)  # published, flag up
        for flag in self.block.flags:  # the consumer: flags down, then released
            flag[0] = 0
        self.block.released = s
        self.worker.end_step(s)
        return s

    def close(self) -> None:
        self.segment.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _stall(monkeypatch, pair: Pair, times: int) -> list[int]:
    """`os.pread` that, `times` times, lets two whole steps happen between a read of
    `released` and the next read of `posted` (a watcher descheduled in between)."""
    real, stalls, after_released = os.pread, [], [False]

    def pread(fd: int, n: int, off: int) -> bytes:
        if n == 8 and off == POSTED_OFF and after_released[0] and len(stalls) < times:
            pair.step()
            stalls.append(pair.step())
        data = real(fd, n, off)
        if n == 8:
            after_released[0] = off == RELEASED_OFF or after_released[0] and off != POSTED_OFF
        return data

    monkeypatch.setattr(os, "pread", pread)
    return stalls


def test_a_stall_across_two_steps_reads_one_instant(monkeypatch, pair):
    """One pass of the counters would read `posted = released + 2` (INVARIANT); the snapshot
    reads again until two passes agree: the counters after both steps, stable."""
    pair.step()
    stalls = _stall(monkeypatch, pair, times=1)
    block = ControlBlock.snapshot(pair.segment.fd, pair.layout)
    monkeypatch.undo()
    assert stalls == [3], "the read was stalled across steps 2 and 3"
    assert invariant_violation(block.counters()) is None
    assert block.counters() == Counters(3, (3,) * PARTS, 3)
    assert block.stable


def test_counters_that_never_hold_still_are_no_verdict(monkeypatch, pair):
    """Every pass stalled across two steps: no two agree, the snapshot says so, and the
    supervisor's check gives no verdict on it (it counts it and reads again next poll)."""
    handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                              actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                              layout=pair.layout)
    watched = _Watched(handle, DEADLINES)
    try:
        stalls = _stall(monkeypatch, pair, times=50)
        block = watched.read()
        monkeypatch.undo()
        assert 1 < len(stalls) < 50, "a bounded number of passes"
        assert not block.stable
        assert invariant_violation(block.counters()) is not None, "torn, as it was read"
        sup = Supervisor.__new__(Supervisor)  # only the check, no watch thread
        sup._closing = False
        sup._check_pair(watched, block, time.monotonic_ns())
        assert watched.unstable == 1
    finally:
        watched.close()


def test_a_stable_jump_is_a_verdict_at_the_next_poll(pair):
    """A real supervisor watching a pair that stepped: `posted` jumps to `released + 2`,
    and the verdict (INVARIANT) comes within one poll."""
    for _ in range(3):
        pair.step()
    replica = subprocess.Popen(["sleep", "60"])  # the replica stand-in the verdict kills
    left = threading.Event()
    poll_s = 0.02
    ple = PleConfig.model_validate({"supervisor": {"poll_interval_s": poll_s}})
    layer = GEOMETRY.tables[0]
    spec = SupervisorSpec(tag="snapshot", ple=ple, geometry=GEOMETRY, world_size=1,
                          replica_pid=replica.pid, sources=(TableSource(
                              checkpoint_dir="/nonexistent", tensor_names=("t",), table=layer),))
    handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                              actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                              layout=pair.layout)
    sup = Supervisor(spec, None, None, exit_soon=lambda _linger_s: left.set())
    try:
        with sup._lock:
            sup._watched.append(_Watched(handle, ple.deadlines))
        time.sleep(5 * poll_s)
        assert sup.verdict() is None, "a healthy pair: no verdict"
        pair.beat()
        t0 = time.time()
        pair.block.posted = pair.block.released + 2
        while sup.verdict() is None and time.time() < t0 + 10:
            time.sleep(0.001)
        v = sup.verdict()
        assert v is not None and v.reason == Reason.INVARIANT.name and v.seq == 5, v
        assert v.detected_at - t0 < poll_s + 0.1, "found at the next poll"
        replica.wait(10)
    finally:
        replica.kill()
        assert left.wait(30), "the supervisor left"
        sup._thread.join(10)
        assert not sup._thread.is_alive()


def test_healthy_steps_under_load_are_never_a_verdict():
    """The stress in short: a pair stepping flat out, both cores loaded, the supervisor's
    counter check sampled hundreds of thousands of times: no verdict."""
    from bench.cpu.stress_snapshot import stress

    out = stress(10.0, samplers=1, single_pass=0)
    assert out["steps"] > 10_000, out
    assert out["seqlock"]["samples"] > 20_000, out
    assert out["seqlock"]["verdicts"] == 0, out
