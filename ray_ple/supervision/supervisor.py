"""The supervisor: one per replica, outside every process it watches.

It builds the replica's pairs (one offload actor per engine worker, in that worker's bundle),
hands their handles to the engine out of band, and then watches, every `poll_interval_s` and
at once when a watched process exits (pidfds):

    liveness    the replica, its node's raylet, every engine worker and offload actor:
                dead, or stopped (SIGSTOP) -> verdict
    state       a pair marked FAILED by either side (its first reason wins)
    counters    each only grows; released <= published <= posted <= released + 1
    deadlines   startup (pairs + engine), a posted step released within step_s, its rows
                published within offload_wait_s; heartbeats of both sides
    metrics     transactions, hand-off latency, deadline misses, verdicts

A verdict is one structured line and a metric, then the whole replica is ended: every pair is
marked FAILED (so no side can take another step), every process of the replica is killed
(replica actor and its engine processes, workers, offload actors) and verified gone, and
Serve, seeing the replica actor dead, starts a fresh one. The supervisor is detached so that
it outlives what it kills; it exits when its replica is gone, whatever ended it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
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
from ray_ple.protocol.table_source import TableSource
from ray_ple.protocol.transaction import (
    Deadline,
    invariant_violation,
    publish_deadline,
    stale_heartbeat,
    step_deadline,
    went_back,
)
from ray_ple.supervision import metrics
from ray_ple.supervision.engine_leftovers import remove_unused, shm_files_of
from ray_ple.supervision.offload_group import OffloadGroup

KV_PREFIX = "ray_ple:verdict:"
CLOSE_WAIT_S = 60.0  # an orderly stop: Serve's graceful shutdown (20 s by default) and more
METRICS_FLUSH_S = 12.0  # > Ray's metrics report interval (10 s), so the verdict is exported
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
    layer: str | None = None
    seq: int | None = None
    detail: str = ""
    detected_at: float
    gone_at: float | None = None
    detect_to_gone_s: float | None = None
    pids: tuple[int, ...] = ()
    survivors: tuple[str, ...] = ()  # pid:name:state of any process that would not go


class _Problem(Exception):
    def __init__(self, reason: Reason, detail: str, rank: int | None = None,
                 layer: str | None = None, seq: int | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.rank, self.layer, self.seq = reason, detail, rank, layer, seq

    @classmethod
    def of(cls, f: Failure, handle: PairHandle, seq: int) -> _Problem:
        layer = None if f.layer is None else handle.layer_names[f.layer]
        return cls(f.reason, f.detail, rank=handle.rank, layer=layer, seq=seq)


def _proc_state(pid: int) -> str | None:
    """One-letter state from /proc (None when gone; 'Z' is gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def liveness(pid: int, what: str) -> Failure | None:
    """A watched process must be alive and running: gone (or a zombie) or stopped is fatal."""
    state = _proc_state(pid)
    if state is None:
        return Failure(Reason.PEER_DEAD, f"{what} (pid {pid}) died")
    if state in ("T", "t"):
        return Failure(Reason.PEER_STOPPED, f"{what} (pid {pid}) is stopped")
    return None


class _Watched:
    """One pair as the supervisor sees it: an fd of its segment (read with pread, never
    mapped, so that a segment taken away cannot fault the watcher) and the last values."""

    def __init__(self, handle: PairHandle, deadlines: PleDeadlines) -> None:
        self.handle, self.layout = handle, handle.layout()
        self.fd = open_segment(handle.segment)
        self.last = Counters(0, tuple(0 for _ in handle.slots), 0)
        self.unreleased = step_deadline(deadlines)
        self.unpublished = publish_deadline(deadlines)

    def read(self) -> ControlBlock:
        block = ControlBlock.snapshot(self.fd, self.layout)
        if block is None:
            raise _Problem(Reason.SEGMENT_LOST, "pair segment shrank under a live pair",
                           rank=self.handle.rank)
        return block

    def set_state(self, state: State, reason: int = 0) -> None:
        ControlBlock.write_state(self.fd, state, reason)


class Supervisor:
    """`ray.remote(Supervisor)`: created by the replica's server, detached, on its node."""

    def __init__(self, spec: SupervisorSpec, replica: Any, placement_group: Any) -> None:
        self.spec = SupervisorSpec.model_validate(spec)  # re-checked on arrival
        self._replica, self._pg = replica, placement_group
        self._pairs = OffloadGroup(self.spec.ple, self.spec.geometry, self.spec.sources,
                              tag=self.spec.tag)
        self._watched: list[_Watched] = []
        self._pids: dict[int, str] = {self.spec.replica_pid: "replica"}
        raylet = psutil.Process(self.spec.replica_pid).ppid()
        self._raylet = raylet if raylet > 1 else None
        self._verdict: Verdict | None = None
        self._closing = self._engine_started = False
        self._shm_files: set[str] = set()
        self._closing_pids: dict[int, str] = {}
        self._startup = Deadline(Reason.STARTUP_DEADLINE, self.spec.ple.deadlines.startup_s,
                                 "(pairs + engine start) not serving")
        self._lock = threading.Lock()
        self._poller = select.poll()
        self._watch_pid(self.spec.replica_pid)
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
                self._watched.append(_Watched(handle, self.spec.ple.deadlines))
                self._pids[handle.segment.pid] = f"offload[{handle.rank}]"
                self._watch_pid(handle.segment.pid)
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
                pids.append(block.worker_pid)
                self._pids[block.worker_pid] = f"worker[{w.handle.rank}]"
                self._watch_pid(block.worker_pid)
            self._engine_started = True
            return EngineAttached(worker_pids=tuple(pids))

    def verdict(self) -> Verdict | None:
        return self._verdict

    def pids(self) -> dict[int, str]:
        return dict(self._pids)

    def statuses(self) -> list[PairStatus]:
        """Each pair as its offload actor sees it (for operators and tests)."""
        return self._pairs.statuses()

    def close(self) -> None:
        """Orderly end of the replica: pairs CLOSED (no verdict), actors gone. The engine
        stops after this; once every process of the replica has exited (or CLOSE_WAIT_S has
        passed), the watch thread removes what they left in /dev/shm and ends this process."""
        with self._lock:  # no check runs while the pairs go
            self._closing = True
            self._closing_pids = self._replica_processes()
            self._shm_files = shm_files_of(self._closing_pids)
            for w in self._watched:
                if w.read().state in (State.READY, State.INIT):
                    w.set_state(State.CLOSED)
            self._pairs.kill()

    # watching ---------------------------------------------------------------------------
    def _watch_pid(self, pid: int) -> None:
        try:
            self._poller.register(os.pidfd_open(pid), select.POLLIN)
        except OSError:
            pass  # already gone: the next check says so

    def _watch(self) -> None:
        period_ms = int(self.spec.ple.supervisor.poll_interval_s * 1000)
        while True:
            try:
                with self._lock:
                    if self._closing:
                        break
                    self._check()
            except _Problem as p:
                self._terminate(p)
                return
            except Exception as exc:  # noqa: BLE001 - uncertainty is a verdict, never a retry
                self._terminate(_Problem(Reason.STATE, f"supervisor check failed: {exc!r}"))
                return
            self._poller.poll(period_ms)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline and any(_proc_state(p) for p in self._closing_pids):
            time.sleep(0.1)
        left = [f"{p}:{w}" for p, w in self._closing_pids.items() if _proc_state(p)]
        log_event("replica_closed", replica=self.spec.tag, still_running=left,
                  shm_removed=remove_unused(self._shm_files))
        self._exit_soon()

    def _check(self) -> None:
        now = time.monotonic_ns()
        blocks = [w.read() for w in self._watched]
        for w, b in zip(self._watched, blocks):  # a side that failed closed names the cause
            if b.state is State.FAILED:
                raise _Problem(Reason(b.reason), "a side of the pair failed closed",
                               rank=w.handle.rank, seq=b.posted)
        watched = dict(self._pids)
        if self._raylet is not None:
            watched[self._raylet] = "raylet"
        for pid, what in watched.items():
            if (f := liveness(pid, what)) is not None:
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
        c = b.counters()
        if went_back(w.last, c) or invariant_violation(c):
            # a stall inside one read can mix two steps: only a second read that still breaks
            # a rule is a verdict
            c = w.read().counters()
            if (f := went_back(w.last, c) or invariant_violation(c)) is not None:
                raise _Problem.of(f, handle, c.posted)
        if c.released > w.last.released:
            metrics.transactions(self.spec.tag, handle.rank, c.released - w.last.released)
            post_ns, publish_ns = b.stamps()
            if publish_ns >= post_ns > 0:
                metrics.handoff(self.spec.tag, handle.rank, (publish_ns - post_ns) / 1e9)
        w.last = c
        for f in (w.unreleased.check(c.posted > c.released, c.posted, now),
                  w.unpublished.check(min(c.published) < c.posted, c.posted, now),
                  stale_heartbeat(b, Side.WORKER, now, self.spec.ple.deadlines),
                  stale_heartbeat(b, Side.OFFLOAD, now, self.spec.ple.deadlines)):
            if f is not None:
                raise _Problem.of(f, handle, c.posted)

    # ending -----------------------------------------------------------------------------
    def _replica_processes(self) -> dict[int, str]:
        pids = dict(self._pids)
        try:
            for child in psutil.Process(self.spec.replica_pid).children(recursive=True):
                pids.setdefault(child.pid, child.name())
        except psutil.Error:
            pass
        return pids

    def _terminate(self, p: _Problem) -> None:
        import ray

        t0, detected_at = time.monotonic(), time.time()
        log_event("verdict", where="supervisor", replica=self.spec.tag, rank=p.rank,
                  layer=p.layer, seq=p.seq, reason=p.reason.name, detail=p.detail[:500])
        metrics.verdict(self.spec.tag, p.reason.name)
        if p.reason in _DEADLINES:
            metrics.deadline_miss(self.spec.tag, _DEADLINES[p.reason])
        for w in self._watched:
            try:
                if w.read().state is not State.FAILED:
                    w.set_state(State.FAILED, int(p.reason))
            except _Problem:
                pass  # the segment is gone: nobody can take a step in it
        procs = self._replica_processes()
        shm_files = shm_files_of(procs)
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for handle in (self._replica, *self._pairs.actors):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_proc_state(pid) for pid in procs):
            time.sleep(0.005)
        survivors = [f"{pid}:{procs[pid]}:{_proc_state(pid)}" for pid in procs
                     if _proc_state(pid)]
        verdict = Verdict(replica=self.spec.tag, reason=p.reason.name, rank=p.rank,
                          layer=p.layer, seq=p.seq, detail=p.detail[:500],
                          detected_at=detected_at, gone_at=time.time(),
                          detect_to_gone_s=round(time.monotonic() - t0, 4),
                          pids=sorted(procs), survivors=survivors)
        shm_removed = remove_unused(shm_files)  # once nothing of the replica can map them
        self._verdict = verdict
        log_event("replica_ended", replica=self.spec.tag, reason=p.reason.name,
                  detect_to_gone_s=verdict.detect_to_gone_s, pids=sorted(procs),
                  survivors=survivors, shm_removed=shm_removed)
        try:
            from ray.experimental import internal_kv

            internal_kv._internal_kv_put(KV_PREFIX + self.spec.tag, verdict.model_dump_json())
        except Exception:  # noqa: BLE001 - the log line above is the record of last resort
            pass
        self._exit_soon(METRICS_FLUSH_S)

    def _exit_soon(self, linger_s: float = 2.0) -> None:
        """Leave after answering what is in flight (and, after a verdict, after the metrics
        reporter has shipped the verdict); nothing of the replica is left to outlive."""
        threading.Timer(linger_s, os._exit, args=(0,)).start()


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
