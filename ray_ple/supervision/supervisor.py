"""The supervisor: one per replica, outside every process it watches.

It builds the replica's pairs (one offload actor per engine worker, in that worker's bundle),
hands their handles to the engine out of band, and then watches, every `poll_interval_s` and
at once when a watched process exits (pidfds):

    liveness    the replica, its node's raylet, every engine worker and offload actor:
                dead, or stopped (SIGSTOP) -> verdict
    state       a pair marked FAILED by either side (its first reason wins)
    counters    each only grows; released <= published <= posted <= released + 1, judged
                only on a snapshot whose counters are one instant's (`ControlBlock.snapshot`)
    deadlines   startup (pairs + engine), a posted step released within step_s, its rows
                published within offload_wait_s; heartbeats of both sides
    metrics     transactions, hand-off latency by token count, where a step in flight is
                (which part's rows, or the forward), deadline misses, verdicts: read from
                the same snapshots (`ray_ple.supervision.metrics`)

A verdict is one structured line and a metric, then the whole replica is ended: every pair is
marked FAILED (so no side can take another step), every process of the replica is killed
(replica actor and its engine processes, workers, offload actors) and verified gone, and
Serve, seeing the replica actor dead, starts a fresh one. The supervisor is detached so that
it outlives what it kills; it exits when its replica is gone, whatever ended it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from ray_ple.base import Frozen
from ray_ple.config import PleConfig, PleDeadlines
from ray_ple.errors import PleError
from ray_ple.log import log_event
from ray_ple.offload.actor import PairStatus
from ray_ple.protocol.fatal import Failure, Reason
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.protocol.handles import EngineAttached, EngineHandles, PairHandle
from ray_ple.protocol.layout import ControlBlock, Counters, Side, State
from ray_ple.protocol.shm import open_segment
from ray_ple.protocol.transaction import (
    Deadline,
    invariant_violation,
    publish_deadline,
    stale_heartbeat,
    step_deadline,
    went_back,
)
from ray_ple.supervision import metrics
from ray_ple.supervision.engine_leftovers import files_of, files_of_tree, remove_unused
from ray_ple.supervision.offload_group import OffloadGroup
from ray_ple.supervision.processes import ProcessSet
from ray_ple.table_source import TableSource

KV_PREFIX = "ray_ple:verdict:"
CLOSE_WAIT_S = 60.0  # an orderly stop: Serve's graceful shutdown (20 s by default) and more
METRICS_FLUSH_S = 12.0  # > Ray's metrics report interval (10 s), so the verdict is exported
CLOSE_LINGER_S = 2.0  # after an orderly close: answer what is in flight
NAME_S = 0.005  # a side that checks the same counters names a broken step's cause first
_DEADLINES = {Reason.STEP_DEADLINE: "step", Reason.PUBLISH_DEADLINE: "publish",
              Reason.OFFLOAD_WAIT: "offload_wait", Reason.CONSUME_WAIT: "consume",
              Reason.HEARTBEAT: "heartbeat", Reason.STARTUP_DEADLINE: "startup"}


class SupervisorSpec(Frozen):
    tag: str
    ple: PleConfig
    geometry: PleGeometry
    sources: tuple[TableSource, ...]
    world_size: int
    replica_pid: int


class Verdict(Frozen):
    """What ended a replica, and how fast (also stored in the GCS KV under KV_PREFIX+tag)."""

    replica: str
    reason: str
    rank: int | None = None
    slot: str | None = None
    seq: int | None = None
    detail: str = ""
    detected_at: float
    gone_at: float | None = None
    detect_to_gone_s: float | None = None
    pids: tuple[int, ...] = ()
    survivors: tuple[str, ...] = ()  # pid:name:state of any process that would not go


class _Problem(Exception):
    def __init__(self, reason: Reason, detail: str, rank: int | None = None,
                 slot: str | None = None, seq: int | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.rank, self.slot, self.seq = reason, detail, rank, slot, seq

    @classmethod
    def of(cls, f: Failure, handle: PairHandle, seq: int) -> _Problem:
        slot = None if f.slot is None else handle.slot_names[f.slot]
        return cls(f.reason, f.detail, rank=handle.rank, slot=slot, seq=seq)


class _Watched:
    """One pair as the supervisor sees it: an fd of its segment (read with pread, never
    mapped, so that a segment taken away cannot fault the watcher) and the last values."""

    def __init__(self, handle: PairHandle, deadlines: PleDeadlines) -> None:
        self.handle, self.layout = handle, handle.layout()
        self.fd = open_segment(handle.segment)
        self.last = Counters(0, tuple(0 for _ in handle.slots), 0)
        self.unreleased = step_deadline(deadlines)
        self.unpublished = publish_deadline(deadlines)
        self.unstable = 0  # snapshots whose counters never held still (no verdict on those)
        self.tokens = 0  # the token count of the latest post, read just before the snapshot

    def read(self) -> ControlBlock:
        """A snapshot; its `stable` says whether the counters are one instant's."""
        # The latest post's token count, read before the hand-off times: a post landing between the
        # two reads leaves post_ns past publish_ns (no hand-off sample), unless its rows are
        # published by the second too (then one sample takes the previous step's count).
        count = os.pread(self.fd, 4, self.layout.count_offset)
        self.tokens = struct.unpack("<I", count)[0] if len(count) == 4 else 0
        block = ControlBlock.snapshot(self.fd, self.layout)
        if block is None:
            raise _Problem(Reason.SEGMENT_LOST, "pair segment shrank under a live pair",
                           rank=self.handle.rank)
        return block

    def close(self) -> None:
        """Let go of the segment; a later read fails (EBADF), never reads a reused fd."""
        fd, self.fd = self.fd, -1
        os.close(fd)

    def set_state(self, state: State) -> None:
        ControlBlock.write_state(self.fd, state)

    def fail(self, reason: Reason) -> None:
        ControlBlock.write_failure(self.fd, reason)


def exit_after(linger_s: float) -> None:
    """End this process `linger_s` from now (the supervisor's way out)."""
    threading.Timer(linger_s, os._exit, args=(0,)).start()


class Supervisor:
    """`ray.remote(Supervisor)`: created by the replica's server, detached, on its node.

    `exit_soon(linger_s)` is how it leaves once its replica is gone: this process ends
    (`exit_after`); a test that hosts a supervisor passes one that leaves the test alone."""

    def __init__(self, spec: SupervisorSpec, replica: Any, placement_group: Any,
                 exit_soon: Callable[[float], None] = exit_after) -> None:
        self.spec = SupervisorSpec.model_validate(spec)  # re-checked on arrival
        self._replica, self._pg = replica, placement_group
        self._exit_soon = exit_soon
        self._pairs = OffloadGroup(self.spec.ple, self.spec.geometry, self.spec.sources,
                              tag=self.spec.tag)
        self._watched: list[_Watched] = []
        self._procs = ProcessSet()  # the replica's processes, each held by a pidfd
        self._procs.add(self.spec.replica_pid, "replica")
        raylet = psutil.Process(self.spec.replica_pid).ppid()
        self._raylet = ProcessSet()  # watched, never killed
        if raylet > 1:
            self._raylet.add(raylet, "raylet")
        self._verdict: Verdict | None = None
        self._closing = self._engine_started = False
        self._leftovers: set[str] = set()
        self._startup = Deadline(Reason.STARTUP_DEADLINE, self.spec.ple.deadlines.startup_s,
                                 "(pairs + engine start) not serving")
        self._lock = threading.Lock()
        metrics.start_replica(self.spec.tag, _DEADLINES.values(), (r.name for r in Reason))
        self._thread = threading.Thread(target=self._watch, name="ray-ple-supervisor",
                                        daemon=True)
        self._thread.start()

    # called by the replica's server -----------------------------------------------------
    def start_pairs(self) -> EngineHandles:
        """Build and validate the pairs; return what the engine's workers need."""
        bundles = list(range(self.spec.world_size))
        handles = self._pairs.start(self.spec.world_size, self._pg, bundles)
        with self._lock:
            for handle in handles:
                # the pidfd first, then the segment through that pid's fd table: the inode
                # the handle names vouches that the pidfd holds our offload actor
                pid, what = handle.segment.pid, f"offload[{handle.rank}]"
                if not self._procs.add(pid, what):
                    raise PleError(f"{what} (pid {pid}) exited before it was watched")
                try:
                    self._watched.append(_Watched(handle, self.spec.ple.deadlines))
                except Exception:
                    self._procs.discard(pid)
                    raise
        for handle in handles:
            metrics.start_pair(self.spec.tag, handle.rank, handle.slot_names)
        return EngineHandles(pairs=tuple(handles))

    def engine_started(self) -> EngineAttached:
        """Every worker must have attached; from now on its process is watched too."""
        with self._lock:
            pids = []
            for w in self._watched:
                block = w.read()
                if block.state is not State.READY:
                    raise PleError(f"engine started but worker rank {w.handle.rank} never "
                                   f"attached (pair is {block.state.name})")
                pid = block.worker_pid  # read from shared memory: vouched for once held
                if not self._procs.adopt(pid, f"worker[{w.handle.rank}]",
                                         self.spec.replica_pid):
                    raise PleError(f"worker rank {w.handle.rank} reports pid {pid}, which is "
                                   "not a live process of this replica")
                pids.append(pid)
            self._engine_started = True
            # vLLM's queues and sockets exist now (the engine core's too: listed, not
            # watched); a verdict kills first, when the maps are read no more
            self._leftovers = (files_of(self._procs.named())
                               | files_of_tree(self.spec.replica_pid))
            return EngineAttached(worker_pids=tuple(pids))

    def verdict(self) -> Verdict | None:
        return self._verdict

    def pids(self) -> dict[int, str]:
        return self._procs.named()

    def statuses(self) -> list[PairStatus]:
        """Each pair as its offload actor sees it (for operators and tests)."""
        return self._pairs.statuses()

    def close(self) -> None:
        """Orderly end of the replica: pairs CLOSED (no verdict), actors gone. The engine
        stops after this; once every process of the replica has exited (or CLOSE_WAIT_S has
        passed), the watch thread removes what they left in /dev/shm and ends this process."""
        with self._lock:  # no check runs while the pairs go
            self._closing = True
            self._procs.adopt_descendants(self.spec.replica_pid)
            self._leftovers = files_of(self._procs.named())
            for w in self._watched:
                if w.read().state in (State.READY, State.INIT):
                    w.set_state(State.CLOSED)
            self._pairs.kill()

    # watching ---------------------------------------------------------------------------
    def _watch(self) -> None:
        period_ms = int(self.spec.ple.supervisor.poll_interval_s * 1000)
        while True:
            try:
                with self._lock:
                    if self._closing:
                        break
                    self._check()
                self._procs.poller.poll(period_ms)  # wakes at once when a process exits
            except _Problem as p:
                self._terminate(p)
                return
            except BaseException as exc:  # noqa: BLE001 - uncertainty is a verdict, never a retry
                self._terminate(_Problem(Reason.STATE, f"supervisor check failed: {exc!r}"))
                return
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline and self._procs.running():
            time.sleep(0.1)
        log_event("replica_closed", replica=self.spec.tag, still_running=self._procs.running(),
                  shm_removed=remove_unused(self._leftovers))
        self._leave(CLOSE_LINGER_S)

    def _check(self) -> None:
        now = time.monotonic_ns()
        blocks = [w.read() for w in self._watched]
        for w, b in zip(self._watched, blocks):  # a side that failed closed names the cause
            if b.state is State.FAILED:
                raise _Problem(Reason(b.reason), "a side of the pair failed closed",
                               rank=w.handle.rank, seq=b.posted)
        if (f := self._procs.liveness() or self._raylet.liveness()) is not None:
            raise _Problem(f.reason, f.detail)
        if (f := self._startup.check(not self._engine_started, 0, now)) is not None:
            raise _Problem(f.reason, f.detail)
        for w, b in zip(self._watched, blocks):
            self._check_pair(w, b, now)

    def _check_pair(self, w: _Watched, b: ControlBlock, now: int) -> None:
        handle = w.handle
        if b.state is State.CLOSED and not self._closing:
            raise _Problem(Reason.STATE, "pair closed while the replica serves",
                           rank=handle.rank)
        if not b.stable:  # counters that moved throughout the read: no instant's, so no
            w.unstable += 1  # verdict on them; the next poll reads again (a stuck pair reads
            return  # stable, and its deadlines run)
        c = b.counters()
        if (f := went_back(w.last, c) or invariant_violation(c)) is not None:
            # One instant's counters (a stable snapshot) that break a rule: a verdict, never
            # read again for a second opinion. The offload side checks the same counters when
            # it wakes for the step and holds the pair meanwhile; NAME_S lets a side that
            # failed closed name the cause (a skipped post is its COUNTER_SKIP).
            time.sleep(NAME_S)
            if (again := w.read()).state is State.FAILED:
                raise _Problem(Reason(again.reason), "a side of the pair failed closed",
                               rank=handle.rank, seq=again.posted)
            raise _Problem.of(f, handle, c.posted)
        if c.released > w.last.released:
            metrics.transactions(self.spec.tag, handle.rank, c.released - w.last.released)
            post_ns, publish_ns = b.handoff_times()
            if publish_ns >= post_ns > 0:
                metrics.handoff(self.spec.tag, handle.rank, w.tokens,
                                (publish_ns - post_ns) / 1e9)
        if c.posted > c.released:  # a step in flight: where is it (a sample per poll)?
            pending = next((i for i, p in enumerate(c.published) if p < c.posted), None)
            if pending is None:  # past every part's gate
                metrics.phase_sample(self.spec.tag, handle.rank, metrics.FORWARD_SLOT,
                                     metrics.PHASE_FORWARD)
            else:
                metrics.phase_sample(self.spec.tag, handle.rank,
                                     handle.slot_names[pending], metrics.PHASE_ROWS)
        w.last = c
        for f in (w.unreleased.check(c.posted > c.released, c.posted, now, w.tokens),
                  w.unpublished.check(min(c.published) < c.posted, c.posted, now),
                  stale_heartbeat(b, Side.WORKER, now, self.spec.ple.deadlines),
                  stale_heartbeat(b, Side.OFFLOAD, now, self.spec.ple.deadlines)):
            if f is not None:
                raise _Problem.of(f, handle, c.posted)

    # ending -----------------------------------------------------------------------------
    def _terminate(self, p: _Problem) -> None:
        """End the replica: first, and whatever fails on the way, no step can be taken and
        every process is killed; then the record (log line, metrics, verdict, KV)."""
        t0, detected_at = time.monotonic(), time.time()
        failures: list[str] = []
        try:
            for w in self._watched:
                try:
                    w.fail(p.reason)
                except Exception as exc:  # noqa: BLE001 - a segment gone: nobody steps in it
                    failures.append(f"mark rank {w.handle.rank}: {exc!r}")
            try:
                self._procs.adopt_descendants(self.spec.replica_pid)
            except Exception as exc:  # noqa: BLE001 - the held processes are still killed
                failures.append(f"list: {exc!r}")
            failures += self._procs.kill_all()
            try:
                failures += self._ray_kill()
            except Exception as exc:  # noqa: BLE001 - the processes are killed already
                failures.append(f"ray.kill: {exc!r}")
            self._verdict = Verdict(replica=self.spec.tag, reason=p.reason.name, rank=p.rank,
                                    slot=p.slot, seq=p.seq, detail=p.detail[:500],
                                    detected_at=detected_at)
            self._record(p, t0, failures)
        except Exception as exc:  # noqa: BLE001 - every process is killed; the rest is a record
            log_event("verdict_record_failed", level=logging.ERROR, replica=self.spec.tag,
                      reason=p.reason.name, error=repr(exc), failures=failures)
        finally:
            self._leave(METRICS_FLUSH_S)

    def _ray_kill(self) -> list[str]:
        import ray

        errors: list[str] = []
        if not ray.is_initialized():  # never start a Ray here (the process kills stand)
            return errors
        for handle in (self._replica, *self._pairs.actors):
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already dead, or Ray is gone
                errors.append(f"ray.kill: {exc!r}")
        return errors

    def _record(self, p: _Problem, t0: float, failures: list[str]) -> None:
        log_event("verdict", where=Side.SUPERVISOR.value, replica=self.spec.tag, rank=p.rank,
                  slot=p.slot, seq=p.seq, reason=p.reason.name, detail=p.detail[:500])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._procs.running():
            time.sleep(0.005)
        procs = self._procs.named()
        survivors = self._procs.running()
        verdict = self._verdict.model_copy(update=dict(
            gone_at=time.time(), detect_to_gone_s=round(time.monotonic() - t0, 4),
            pids=tuple(sorted(procs)), survivors=tuple(survivors)))
        self._verdict = verdict
        # what the replica mapped when its engine started, and what it still maps: unused now
        shm_removed = remove_unused(self._leftovers | files_of(procs))
        log_event("replica_ended", replica=self.spec.tag, reason=p.reason.name,
                  detect_to_gone_s=verdict.detect_to_gone_s, pids=sorted(procs),
                  survivors=survivors, shm_removed=shm_removed, failures=failures)
        metrics.verdict(self.spec.tag, p.reason.name)
        if p.reason in _DEADLINES:
            metrics.deadline_miss(self.spec.tag, _DEADLINES[p.reason])
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(KV_PREFIX + self.spec.tag, verdict.model_dump_json())

    def _leave(self, linger_s: float) -> None:
        """Let go of every fd, then leave after answering what is in flight (and, after a
        verdict, after the metrics reporter has shipped it): nothing is left to outlive."""
        try:
            with self._lock:  # no call in flight reads a pair or a pidfd while they close
                for w in self._watched:
                    w.close()
                self._procs.close()
                self._raylet.close()
        finally:
            self._exit_soon(linger_s)


def read_verdicts() -> dict[str, Verdict]:
    """Every verdict recorded in this cluster (for operators and tests)."""
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(KV_PREFIX)
    out = {}
    for key in keys:
        raw = internal_kv._internal_kv_get(key)
        if raw:
            v = Verdict.model_validate(json.loads(raw))
            out[v.replica] = v
    return out
