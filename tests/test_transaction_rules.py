"""The transaction as a table: one row per `Reason`, each reached through the real rule.

No Ray, no vLLM: a real pair segment in shared memory, and the side that breaks a rule runs in
a forked child, so that its `fail_closed` really ends a process. Each row asserts the exact
reason (the child's verdict line, or the supervisor's `Failure`), the state word the block
was left in, and that nothing was published beyond what the row set up.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from ray_ple.config import PleDeadlines
from ray_ple.protocol.fatal import EXIT_CODE, Reason
from ray_ple.protocol.geometry import PleGeometry, TableGeometry
from ray_ple.protocol.handles import make_pair_handle
from ray_ple.protocol.layout import ControlBlock, PairLayout, Side, State
from ray_ple.protocol.shm import SharedSegment
from ray_ple.protocol.transaction import (
    OffloadEnd,
    WorkerEnd,
    invariant_violation,
    publish_deadline,
    went_back,
)
from ray_ple.supervision.processes import ProcessSet
from ray_ple.supervision.supervisor import Supervisor, _Problem, _Watched

ROW_ELEMS, MAX_TOKENS = 32, 16
GEOMETRY = PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=MAX_TOKENS, tables=(
    TableGeometry(name="model.embed_tokens_per_layer", rows=64, row_elems=ROW_ELEMS,
                  dtype="bfloat16"),))
FAST = PleDeadlines(step_s=0.2, offload_wait_s=0.2, heartbeat_s=0.2, startup_s=0.2)


class Pair:
    """A live pair segment, READY, both heartbeats fresh, counters at `step`."""

    def __init__(self, step: int = 0) -> None:
        self.layout = PairLayout.compute(MAX_TOKENS, (ROW_ELEMS * 2,))
        self.segment = SharedSegment.create("pair", self.layout.size)
        self.block = ControlBlock(self.segment, self.layout)
        self.block.write_header(self.segment.token, "0" * 64)
        b = self.block
        b.posted = b.released = b.announced = step
        b.set_published(0, step)
        now = time.monotonic_ns()
        b.beat(Side.WORKER, now)
        b.beat(Side.OFFLOAD, now)
        b.set_state(State.READY)

    def worker(self) -> WorkerEnd:
        return WorkerEnd(self.block, 0, FAST, GEOMETRY.slot_names)

    def offload(self) -> OffloadEnd:
        return OffloadEnd(self.block, 0, FAST, GEOMETRY.slot_names)

    def cpu_transport(self):  # noqa: ANN201 - CpuTransport
        from ray_ple.worker.transport.cpu import CpuTransport

        return CpuTransport(self.worker(), "bfloat16")

    def close(self) -> None:
        self.segment.close()


def run_side(pair: Pair, body: Callable[[Pair], None]) -> dict:
    """Run `body` in a forked child; it must end through `fail_closed`. Its verdict line."""
    with tempfile.TemporaryFile(mode="w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: stderr to the file, then break the rule
            try:
                os.dup2(err.fileno(), 2)
                stream = os.fdopen(os.dup(2), "w")
                for h in logging.getLogger("ray_ple").handlers:  # pytest holds the old stderr
                    h.stream = stream
                body(pair)
            except BaseException as exc:  # noqa: BLE001 - reported through the exit code
                os.write(2, f"child raised {exc!r}\n".encode())
            finally:
                os._exit(3)  # the rule did not end the process
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        lines = [json.loads(line) for line in err if line.startswith("{")]
    assert os.waitstatus_to_exitcode(status) == EXIT_CODE, lines
    verdicts = [v for v in lines if v.get("ray_ple") == "verdict"]
    assert len(verdicts) == 1, lines
    return verdicts[0]


# One body per row: each breaks exactly one rule, through the real code path ----------------
def skip_post(p: Pair) -> None:
    end = p.offload()
    p.block.posted = 2
    end.next_step()


def counter_back(p: Pair) -> None:
    end = p.offload()  # last = 3
    p.block.posted = 2
    end.next_step()


def stale_rows(p: Pair) -> None:
    t = p.cpu_transport()
    w = t.worker
    w.begin(np.array([1, 2], dtype=np.int32))
    p.block.flags[0][0] = 1  # the flag is up, but `published` still names the last step
    t.pull(0, _rows(2))


def flag_never_reset(p: Pair) -> None:
    end = p.offload()
    p.block.flags[0][0] = 1  # the previous step's flag is still up
    p.block.token_count = 1
    p.block.announced = p.block.posted = 1
    end.publish(end.next_step(), _no_gather)


def never_published(p: Pair) -> None:
    t = p.cpu_transport()
    t.worker.begin(np.array([1], dtype=np.int32))
    t.pull(0, _rows(1))


def never_released(p: Pair) -> None:
    end = p.offload()
    p.block.announced = p.block.posted = 1
    end.publish(end.next_step(), _no_gather)
    for _ in range(100):
        p.block.beat(Side.WORKER, time.monotonic_ns())
        end.watch(time.monotonic_ns())
        time.sleep(0.01)


def unannounced_post(p: Pair) -> None:
    end = p.offload()
    p.block.posted = 1  # a post nobody announced (a graph replayed outside any step)
    end.next_step()


def announced_never_posted(p: Pair) -> None:
    end = p.offload()
    w = p.worker()
    w.announce(1)  # the stream is to post step 1, and never does; the worker lives on
    assert end.next_step() is None

    def beat() -> None:
        while True:
            p.block.beat(Side.WORKER, time.monotonic_ns())
            time.sleep(0.01)

    threading.Thread(target=beat, daemon=True).start()
    end.await_post()


def begin_twice(p: Pair) -> None:
    w = p.worker()
    w.begin(np.array([1], dtype=np.int32))
    w.begin(np.array([1], dtype=np.int32))


def worker_silent(p: Pair) -> None:
    end = p.offload()
    time.sleep(0.3)
    end.watch(time.monotonic_ns())


def too_many_tokens(p: Pair) -> None:
    end = p.offload()
    p.block.token_count = MAX_TOKENS + 1
    p.block.announced = p.block.posted = 1
    end.publish(end.next_step(), _no_gather)


def peer_failed(p: Pair) -> None:
    p.block.fail(Reason.OFFLOAD_WAIT)  # the offload side failed first: its reason stays
    p.worker().begin(np.array([1], dtype=np.int32))


def pull_outside_a_step(p: Pair) -> None:
    from ray_ple.worker.pair import WorkerPair

    handle = make_pair_handle(rank=0, segment=p.segment.ref(), node_id="local", actor_name="t",
                              fingerprint="0" * 64, geometry=GEOMETRY, layout=p.layout)
    pair = WorkerPair(handle, p.segment, p.block, "cpu", FAST, 1.0)
    pair.pull(0, _rows(1))


def not_ready(p: Pair) -> None:
    p.block.set_state(State.INIT)
    p.worker().begin(np.array([1], dtype=np.int32))


def wrong_row_count(p: Pair) -> None:
    t = p.cpu_transport()
    t.worker.begin(np.array([1, 2, 3], dtype=np.int32))
    p.block.set_stamp(0, 1)
    p.block.set_published(0, 1)
    p.block.flags[0][0] = 1
    t.pull(0, _rows(2))


def stale_stamp(p: Pair) -> None:
    t = p.cpu_transport()
    t.worker.begin(np.array([1, 2], dtype=np.int32))
    p.block.set_stamp(0, 0)  # `published` and the flag say step 1, the rows are step 0's
    p.block.set_published(0, 1)
    p.block.flags[0][0] = 1
    t.pull(0, _rows(2))


def _rows(t: int):  # noqa: ANN202 - torch.Tensor
    import torch

    return torch.empty((t, ROW_ELEMS), dtype=torch.bfloat16)


def _no_gather(slot: int, ids: np.ndarray, out: np.ndarray) -> None:
    out[:] = 7


# reason, side that ends, body, counters' step before, reason in the state word after,
# `published` after (the rows that publish a step themselves say so; no rule publishes)
SIDE_ROWS = [
    (Reason.COUNTER_SKIP, "offload", skip_post, 0, Reason.COUNTER_SKIP, 0),
    (Reason.COUNTER_BACK, "offload", counter_back, 3, Reason.COUNTER_BACK, 3),
    (Reason.INVARIANT, "consumer", stale_rows, 0, Reason.INVARIANT, 0),
    (Reason.OFFLOAD_WAIT, "offload", flag_never_reset, 0, Reason.OFFLOAD_WAIT, 0),
    (Reason.CONSUME_WAIT, "consumer", never_published, 0, Reason.CONSUME_WAIT, 0),
    (Reason.STEP_DEADLINE, "offload", never_released, 0, Reason.STEP_DEADLINE, 1),
    (Reason.INVARIANT, "offload", unannounced_post, 0, Reason.INVARIANT, 0),
    (Reason.STEP_DEADLINE, "offload", announced_never_posted, 0, Reason.STEP_DEADLINE, 0),
    (Reason.ABANDONED, "worker", begin_twice, 0, Reason.ABANDONED, 0),
    (Reason.HEARTBEAT, "offload", worker_silent, 0, Reason.HEARTBEAT, 0),
    (Reason.TOKEN_COUNT, "offload", too_many_tokens, 0, Reason.TOKEN_COUNT, 0),
    (Reason.PEER_FAILED, "worker", peer_failed, 0, Reason.OFFLOAD_WAIT, 0),
    (Reason.NO_TRANSACTION, "consumer", pull_outside_a_step, 0, Reason.NO_TRANSACTION, 0),
    (Reason.STATE, "worker", not_ready, 0, Reason.STATE, 0),
    (Reason.GEOMETRY, "consumer", wrong_row_count, 0, Reason.GEOMETRY, 1),
    (Reason.INVARIANT, "consumer", stale_stamp, 0, Reason.INVARIANT, 1),
]
_IDS = [r[0].name if [q[0] for q in SIDE_ROWS].count(r[0]) == 1
        else f"{r[0].name}-{r[2].__name__}" for r in SIDE_ROWS]


@pytest.mark.parametrize("reason,side,body,step,state_reason,published", SIDE_ROWS, ids=_IDS)
def test_a_side_fails_closed(reason, side, body, step, state_reason, published):
    pair = Pair(step)
    try:
        verdict = run_side(pair, body)
        assert (verdict["reason"], verdict["where"]) == (reason.name, side)
        b = pair.block
        assert (b.state, b.reason) == (State.FAILED, int(state_reason))
        assert b.published(0) == published, "the broken rule published nothing"
    finally:
        pair.close()


# The supervisor's rules: the same functions, asked directly ---------------------------------
def test_supervisor_rules():
    pair = Pair()
    try:
        b, now = pair.block, time.monotonic_ns()
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        watched = _Watched(handle, FAST)
        c0 = watched.read().counters()
        # counters that go back, or break the invariant (checked on a snapshot, never mapped)
        b.posted = 2
        assert invariant_violation(watched.read().counters()).reason is Reason.INVARIANT
        b.posted = 0
        assert went_back(c0._replace(posted=1), watched.read().counters()).reason \
            is Reason.COUNTER_BACK
        # a posted step whose rows are not published in time, keyed on that step
        b.posted = 1
        late = publish_deadline(FAST)
        assert late.check(True, 1, now) is None
        limit = int((FAST.offload_wait_s + FAST.heartbeat_s) * 1e9)  # after the side's own
        assert late.check(True, 1, now + limit - 1) is None
        assert late.check(True, 1, now + limit + 1).reason is Reason.PUBLISH_DEADLINE
        assert late.check(True, 2, now + limit + 1) is None, "a new step restarts the clock"
        assert b.published(0) == 0 and b.state is State.READY, "the rules only read"
        # the segment taken away under a live pair
        os.ftruncate(pair.segment.fd, 0)
        with pytest.raises(Exception) as exc:
            watched.read()
        assert exc.value.reason is Reason.SEGMENT_LOST
    finally:
        pair.close()


@pytest.mark.parametrize("side_failed", [Reason.COUNTER_SKIP, None], ids=["side", "no_side"])
def test_the_supervisor_confirms_a_violation_and_a_side_names_its_cause(side_failed):
    """A poll that saw a skipped post before the offload side woke: the confirmation read
    finds the side's FAILED and takes its reason; with no side failed, the supervisor's own."""
    pair = Pair()
    try:
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        watched = _Watched(handle, FAST)
        pair.block.posted = 2  # one step skipped, nothing released
        seen = watched.read()
        if side_failed is not None:
            pair.block.fail(side_failed)  # the offload side wakes up and fails closed
        sup = Supervisor.__new__(Supervisor)  # only the check, no watch thread
        sup._closing = False
        with pytest.raises(_Problem) as exc:
            sup._check_pair(watched, seen, time.monotonic_ns())
        assert exc.value.reason is (side_failed or Reason.INVARIANT)
    finally:
        pair.close()


def test_supervisor_liveness_and_startup():
    from ray_ple.protocol.transaction import Deadline

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs = ProcessSet()
    try:
        assert procs.add(child.pid, "worker[0]") and procs.liveness() is None
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert procs.liveness().reason is Reason.PEER_STOPPED
        child.send_signal(signal.SIGCONT)
        assert procs.kill_all() == [], "killed through its pidfd"
        child.wait()
        assert procs.liveness().reason is Reason.PEER_DEAD
        assert procs.kill_all() == [], "killing the dead is no error"
    finally:
        child.kill()
    startup = Deadline(Reason.STARTUP_DEADLINE, FAST.startup_s, "not serving")
    now = time.monotonic_ns()
    assert startup.check(True, 0, now) is None
    assert startup.check(True, 0, now + int(0.3e9)).reason is Reason.STARTUP_DEADLINE
    assert startup.check(False, 0, now + int(0.3e9)) is None, "started: no deadline"


def test_every_reason_has_a_row():
    reached = {r[0] for r in SIDE_ROWS} | {
        Reason.INVARIANT, Reason.COUNTER_BACK, Reason.PUBLISH_DEADLINE, Reason.SEGMENT_LOST,
        Reason.PEER_STOPPED, Reason.PEER_DEAD, Reason.STARTUP_DEADLINE,
        Reason.STREAM_POST}  # the stream post's kernel: tests/gpu (a GPU writes it)
    assert set(Reason) - {Reason.NONE} == reached
