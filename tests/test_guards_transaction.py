"""Guards of the transaction: the counters each side reads before it moves, the order of
steps, flags and slots, deadlines and liveness; each with a test that fails without it
(docs/mutation.md).

Every row reaches one check through the real code path, with real parts: a pair segment in
shared memory and the side that breaks the rule in a forked child (`run_side`), the
project's offload actor and worker in spawned processes (`tests.rig`), a broker in a forked
child that serves a real sealed memfd (`tests.test_squatter.squatter`). Each was seen failing
with its check removed (`scripts/mutation_pass.py` applies that to a copy of the tree).
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np
import pytest

from ray_ple.config import PleDeadlines
from ray_ple.errors import PleEnvironmentError, PleHandleError
from ray_ple.protocol.fatal import Reason
from ray_ple.protocol.layout import MAX_SLOTS, ControlBlock, PairLayout, State
from ray_ple.protocol.shm import SharedSegment
from ray_ple.protocol.transaction import OffloadEnd, invariant_violation, went_back
from tests.test_squatter import ROOT_ONLY
from tests.test_transaction_rules import GEOMETRY, Pair, run_side


# The transaction's counters: the step the other side is in must be exactly the one before ---
def _offload_sees_a_post_while_released_is(released: int):  # noqa: ANN202 - a body
    def body(p: Pair) -> None:
        end = p.offload()  # the last step it served: 1, released
        p.block.released = released
        p.block.announced = p.block.posted = 2  # the next post, announced: all else is right
        end.next_step()

    body.__name__ = f"released_{released}"
    return body


@pytest.mark.parametrize("released", [0, 2], ids=["behind", "ahead"])
def test_offload_side_refuses_a_post_unless_its_last_step_was_released(released):
    """`next_posted`: step 2 posted while step 1 is not released (or `released` ran ahead of
    every post) is a second step in flight; the offload side fails closed, serving nothing."""
    pair = Pair(step=1)
    try:
        verdict = run_side(pair, _offload_sees_a_post_while_released_is(released))
        assert (verdict["reason"], verdict["where"]) == (Reason.INVARIANT.name, "offload")
        assert "posted while released" in verdict["detail"]
        b = pair.block
        assert (b.state, b.reason) == (State.FAILED, int(Reason.INVARIANT))
        assert b.published(0) == 1 and b.flags[0][0] == 0, "nothing of step 2 was published"
    finally:
        pair.close()


@pytest.mark.parametrize("released", [0, 2], ids=["behind", "ahead"])
def test_worker_refuses_to_post_unless_its_last_step_was_released(released):
    """`WorkerEnd.begin`: with every other counter at step 1 but `released` not, posting step
    2 would put two steps in flight; the worker fails closed before `posted` moves."""
    pair = Pair(step=1)

    def body(p: Pair) -> None:
        w = p.worker()
        p.block.released = released
        w.begin(np.array([3, 4], dtype=np.int32))

    try:
        verdict = run_side(pair, body)
        assert (verdict["reason"], verdict["where"]) == (Reason.INVARIANT.name, "worker")
        b = pair.block
        assert (b.state, b.reason) == (State.FAILED, int(Reason.INVARIANT))
        assert (b.posted, b.announced) == (1, 1), "step 2 was never posted nor announced"
    finally:
        pair.close()


def _one_counter_off(word: str):  # noqa: ANN202 - a body
    def body(p: Pair) -> None:
        w = p.worker()  # step 1: every counter at 1
        _set(p, word, 2)
        w.begin(np.array([3], dtype=np.int32))

    return body


@pytest.mark.parametrize("word", ["posted", "published", "announced"])
def test_worker_refuses_to_post_unless_every_counter_is_at_its_last_step(word):
    """`WorkerEnd.begin`: each counter on its own ahead of the worker's step (a second poster,
    a slot of a step never posted, an announcement not this worker's) stops the post."""
    pair = Pair(step=1)
    try:
        verdict = run_side(pair, _one_counter_off(word))
        assert (verdict["reason"], verdict["where"]) == (Reason.INVARIANT.name, "worker")
        assert pair.block.state is State.FAILED
    finally:
        pair.close()


def _announce_twice(p: Pair) -> None:
    w = p.worker()
    p.block.announced = 2  # another announcement than this worker's
    w.announce(1)


def _release_unbegun(p: Pair) -> None:
    p.worker().end_step(1)


def _release_other_step(p: Pair) -> None:
    w = p.worker()
    s = w.begin(np.array([3], dtype=np.int32))
    w.end_step(s - 1)


def _local_inside_a_step(p: Pair) -> None:
    w = p.worker()
    w.begin(np.array([3], dtype=np.int32))
    w.begin_local()


def _pull_rows_stamped_but_not_published(p: Pair) -> None:
    import torch

    t = p.cpu_transport()
    s = t.worker.begin(np.array([3], dtype=np.int32))
    p.block.set_stamp(0, s)  # the rows say step 2, `published` still says step 1
    p.block.flags[0][0] = 1
    t.pull(0, torch.empty((1, 32), dtype=torch.bfloat16))


def _offload_watches_a_failed_pair(p: Pair) -> None:
    end = p.offload()
    p.block.fail(Reason.CONSUME_WAIT)
    end.watch(time.monotonic_ns())


@pytest.mark.parametrize("body,reason,where", [
    (_announce_twice, Reason.INVARIANT, "worker"),
    (_release_unbegun, Reason.COUNTER_BACK, "worker"),
    (_release_other_step, Reason.COUNTER_BACK, "worker"),
    (_local_inside_a_step, Reason.ABANDONED, "worker"),
    (_offload_watches_a_failed_pair, Reason.PEER_FAILED, "offload"),
    (_pull_rows_stamped_but_not_published, Reason.INVARIANT, "consumer"),
], ids=lambda v: getattr(v, "__name__", str(v)).strip("_"))
def test_a_side_fails_closed_on_a_step_out_of_order(body, reason, where):
    """The worker's own bookkeeping: an announcement over another, a release of a step it
    did not begin (or of another step), a local forward inside a step; the offload side's
    watch of a pair that failed; a consumer that finds a slot's flag up and its stamp of the
    step, but `published` not (each word is checked, not one for the others)."""
    pair = Pair(step=1)
    try:
        verdict = run_side(pair, body)
        assert (verdict["reason"], verdict["where"]) == (reason.name, where)
        assert pair.block.state is State.FAILED
    finally:
        pair.close()


def test_a_flag_reset_within_the_wait_is_waited_for_not_fatal():
    """`OffloadEnd.publish`: the previous step's flag still up is waited out (bounded by
    `offload_wait_s`), not fatal at once: the consumer may be resetting it right now."""
    pair = Pair(step=0)
    b = pair.block
    end = OffloadEnd(b, 0, PleDeadlines(offload_wait_s=10.0), GEOMETRY.slot_names)
    b.flags[0][0] = 1
    b.token_count, b.ids[0] = 1, 5
    b.announced = b.posted = 1
    pid = os.fork()
    if pid == 0:  # the offload side: publish step 1 once the flag comes down
        code = 3
        try:
            end.publish(end.next_step(), lambda i, ids, out: out.fill(7))
            code = 0
        finally:
            os._exit(code)
    try:
        time.sleep(0.05)
        b.flags[0][0] = 0  # the consumer's release comes late, within the bound
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the offload side failed closed"
        assert (b.published(0), int(b.flags[0][0]), b.state) == (1, 1, State.READY)
        assert (b.slots[0][0] == 7).all()
    finally:
        pair.close()


def _set(p: Pair, word: str, value: int) -> None:
    if word == "published":
        p.block.set_published(0, value)
    else:
        setattr(p.block, word, value)


@pytest.mark.parametrize("word", ["posted", "released", "published"])
def test_the_supervisor_sees_each_counter_go_back(word):
    """`went_back`: every counter only grows; any one of them read lower than before, the
    others unchanged, is COUNTER_BACK."""
    pair = Pair(step=2)
    try:
        before = pair.block.counters()
        assert went_back(before, before) is None
        _set(pair, word, 1)
        assert went_back(before, pair.block.counters()).reason is Reason.COUNTER_BACK
    finally:
        pair.close()


@pytest.mark.parametrize("published", [1, 3], ids=["below_released", "above_posted"])
def test_the_supervisor_sees_a_slot_outside_its_step(published):
    """`invariant_violation`: a slot's `published` outside [released, posted] (rows of a
    step never posted, or a slot left behind) is INVARIANT, naming the slot."""
    pair = Pair(step=2)
    try:
        assert invariant_violation(pair.block.counters()) is None
        pair.block.set_published(0, published)
        f = invariant_violation(pair.block.counters())
        assert (f.reason, f.slot) == (Reason.INVARIANT, 0)
    finally:
        pair.close()


def test_a_pair_holds_one_to_max_slots():
    """`PairLayout.compute`: the words page has room for `MAX_SLOTS` slots' words; a layout
    of none, or of more, is refused before any segment is sized from it."""
    assert len(PairLayout.compute(8, (64,) * MAX_SLOTS).flag_offsets) == MAX_SLOTS
    for n in (0, MAX_SLOTS + 1):
        with pytest.raises(PleHandleError, match=f"{n} slots; a pair holds 1..{MAX_SLOTS}"):
            PairLayout.compute(8, (64,) * n)


def test_a_snapshot_of_a_segment_cut_short_is_none():
    """`ControlBlock.snapshot`: a segment shorter than its layout (its slots cut off, the
    words page still whole) is a lost segment, not a block with readable counters."""
    pair = Pair()
    try:
        fd, layout = pair.segment.fd, pair.layout
        assert ControlBlock.snapshot(fd, layout) is not None
        os.ftruncate(fd, layout.words_bytes)
        assert ControlBlock.snapshot(fd, layout) is None
    finally:
        pair.close()


def test_failed_is_never_set_without_a_reason():
    """`ControlBlock.set_state`: FAILED goes with its reason (`fail`), so that every watcher
    reads why; the plain setter refuses it and leaves the block as it was."""
    pair = Pair()
    try:
        with pytest.raises(ValueError, match="use fail"):
            pair.block.set_state(State.FAILED)
        assert (pair.block.state, pair.block.reason) == (State.READY, 0)
    finally:
        pair.close()


def test_a_late_ready_store_never_hides_a_failure():
    """`ControlBlock.ready`: the reason word decides, not the state word alone; a READY (or
    CLOSED) stored after a failure (a late attach, an orderly close racing a verdict) leaves
    the pair FAILED, and no step is taken on it."""
    pair = Pair()
    try:
        b = pair.block
        b.fail(Reason.HEARTBEAT)
        b.set_state(State.READY)
        assert not b.ready() and b.state is State.FAILED
        verdict = run_side(pair, lambda p: p.worker().begin(np.array([1], dtype=np.int32)))
        assert verdict["reason"] == Reason.PEER_FAILED.name and b.posted == 0
    finally:
        pair.close()


def test_neither_side_starts_on_a_weakly_ordered_cpu(monkeypatch):
    """`check_memory_model`: the sides rely on x86-64's store order; on another CPU (here the
    one `platform` reports, as on a Grace host) neither end of a pair is made."""
    pair = Pair()
    try:
        pair.worker(), pair.offload()  # this host: x86-64
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        for end in (pair.worker, pair.offload):
            with pytest.raises(PleEnvironmentError, match="this CPU is aarch64"):
                end()
    finally:
        pair.close()


# Deadlines: missed only past their limit, to the nanosecond --------------------------------
def test_a_heartbeat_is_stale_only_past_its_limit():
    """`stale_heartbeat`: a heartbeat exactly `heartbeat_s` old is still alive, one ns more
    is dead: the limit is the longest silence a live side may have, not one it may not."""
    from ray_ple.protocol.layout import Side
    from ray_ple.protocol.transaction import stale_heartbeat
    from tests.test_transaction_rules import FAST

    pair = Pair()
    try:
        limit = int(FAST.heartbeat_s * 1e9)
        t0 = pair.block.heartbeat(Side.WORKER)
        assert stale_heartbeat(pair.block, Side.WORKER, t0 + limit, FAST) is None
        late = stale_heartbeat(pair.block, Side.WORKER, t0 + limit + 1, FAST)
        assert late is not None and late.reason is Reason.HEARTBEAT
    finally:
        pair.close()


def test_a_step_deadline_is_missed_only_past_its_limit():
    """`Deadline.check`: a condition that has held exactly the limit is not a miss yet; one
    ns past it is, and a new step restarts the clock."""
    from ray_ple.protocol.transaction import Deadline

    d = Deadline(Reason.STEP_DEADLINE, 0.25, "released")
    assert d.check(True, 1, 1_000) is None
    assert d.check(True, 1, 1_000 + 250_000_000) is None
    missed = d.check(True, 1, 1_000 + 250_000_001)
    assert missed is not None and missed.reason is Reason.STEP_DEADLINE
    assert d.check(True, 2, 1_000 + 250_000_001) is None  # a new step: a new clock


def test_a_long_steps_deadline_grows_with_its_tokens():
    """`step_deadline`: `step_s` plus `step_token_s` per token of the step, so that a healthy
    8,192-token prefill on a slow CPU engine (minutes) is not ended, and a decode step keeps
    the short bound."""
    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.transaction import step_deadline

    d = step_deadline(PleDeadlines(step_s=60, step_token_s=0.02))
    assert d.check(True, 1, 0, tokens=8192) is None
    assert d.check(True, 1, int(60e9 + 8192 * 0.02e9), tokens=8192) is None
    assert d.check(True, 1, int(60e9 + 8192 * 0.02e9) + 1, tokens=8192) is not None
    decode = step_deadline(PleDeadlines(step_s=60, step_token_s=0.02))
    assert decode.check(True, 7, 0, tokens=1) is None
    assert decode.check(True, 7, int(60.03e9), tokens=1) is not None


def test_an_idle_offload_side_with_its_last_step_released_waits_without_a_deadline():
    """`OffloadEnd.watch`: the step deadline runs only while the last step is unreleased;
    between steps (released == last) the offload side may wait any time for the next post,
    and only a real rule (here the worker's heartbeat going stale) ends it."""
    from ray_ple.protocol.layout import Side

    pair = Pair(step=1)

    def body(p: Pair) -> None:
        end = p.offload()
        t0 = time.monotonic_ns()
        for k in range(4):  # 1.5 s idle, the step deadline is 0.2 s
            now = t0 + k * 500_000_000
            p.block.beat(Side.WORKER, now)
            end.watch(now)
        end.watch(t0 + 10 * 1_000_000_000)  # the worker silent for 8.5 s

    try:
        verdict = run_side(pair, body)
        assert (verdict["reason"], verdict["where"]) == (Reason.HEARTBEAT.name, "offload")
    finally:
        pair.close()


@ROOT_ONLY
def test_a_wait_ends_at_its_timeout_under_a_flood_from_another_uid():
    """`DoorbellListener.wait`: before the worker's ringer is bound, another uid's datagrams
    reach the listener; each is taken and the wait goes on for the rest of its timeout only,
    so a flood that keeps the queue full never holds the offload side past its deadline."""
    import signal
    import struct

    from ray_ple.protocol.doorbell import DoorbellListener
    from tests.test_doorbell import start_flooder

    token = os.urandom(16).hex()
    listener = DoorbellListener(token)
    pid, report_r, started_r = start_flooder(token)
    try:
        assert os.read(started_r, 1) == b"s", "the flooder is flooding"
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            assert listener.wait(0.1) is False
            took.append(time.monotonic() - t0)
    finally:
        os.kill(pid, signal.SIGTERM)
        sent, _ = struct.unpack("qq", os.read(report_r, 16))
        os.waitpid(pid, 0)
        os.close(report_r)
        os.close(started_r)
        listener.close()
    assert sent > 0 and max(took) < 1.0, took


def test_an_attached_worker_keeps_beating_while_idle():
    """`WorkerPair._beat`: once attached, the worker's heartbeat moves every `heartbeat_s`
    whether or not a step runs, so an idle replica is never taken for a dead one."""
    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.handles import make_pair_handle
    from ray_ple.protocol.layout import Side
    from ray_ple.worker.pair import WorkerPair
    from tests.test_transaction_rules import MAX_TOKENS, ROW_ELEMS

    layout = PairLayout.compute(MAX_TOKENS, (ROW_ELEMS * 2,))
    seg = SharedSegment.create("pair", layout.size)
    try:
        block = ControlBlock(seg, layout)
        block.write_header(seg.token, "0" * 64)
        block.beat(Side.OFFLOAD, time.monotonic_ns())
        handle = make_pair_handle(rank=0, segment=seg.ref(), node_id="local", actor_name="t",
                                  fingerprint="0" * 64, geometry=GEOMETRY, layout=layout)
        slow = PleDeadlines(step_s=5, offload_wait_s=5, heartbeat_s=5, startup_s=5)
        pair = WorkerPair.attach(handle, GEOMETRY, rank=0, transport="cpu", deadlines=slow,
                                 heartbeat_s=0.02)
        try:
            first = block.heartbeat(Side.WORKER)
            time.sleep(0.3)
            assert block.heartbeat(Side.WORKER) > first, "no beat while idle"
        finally:
            pair.close()
    finally:
        seg.close()


def test_an_attached_worker_fails_closed_when_the_offload_side_stops_beating():
    """`WorkerPair._beat`: the worker's own beater checks the offload side's heartbeat; one
    older than `heartbeat_s` ends the worker's side (HEARTBEAT), even with no step to run."""
    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.handles import make_pair_handle
    from ray_ple.worker.pair import WorkerPair

    pair = Pair()
    pair.block.set_state(State.INIT)
    handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                              actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                              layout=pair.layout)

    def body(p: Pair) -> None:
        quick = PleDeadlines(step_s=5, offload_wait_s=5, heartbeat_s=0.2, startup_s=5)
        WorkerPair.attach(handle, GEOMETRY, rank=0, transport="cpu", deadlines=quick,
                          heartbeat_s=0.02)
        time.sleep(10)  # the offload side never beats again: the beater ends this process

    try:
        verdict = run_side(pair, body)
        assert (verdict["reason"], verdict["where"]) == (Reason.HEARTBEAT.name, "worker")
    finally:
        pair.close()
