"""The offload actor: a CPU-only Ray actor serving one engine worker's transactions.

It holds a read-only view of the node's table, creates its pair segment, hands the handle to
the supervisor, and runs one serving thread: wait for the doorbell (or spin while a step
is announced and not yet posted), serve each posted step exactly once (`OffloadEnd`), and
fail closed on anything the rules forbid, on a worker whose heartbeat stopped, or on a
published step that is not released in time.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time

from ray_ple.base import Frozen
from ray_ple.config import PleConfig
from ray_ple.instrument import faults, timing
from ray_ple.log import log_event
from ray_ple.offload.cuda_guard import cuda_evidence, hide_cuda
from ray_ple.offload.gather import RowGatherer
from ray_ple.offload.table_store import NodeTable, acquire_table
from ray_ple.protocol.doorbell import DoorbellListener
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.protocol.handles import PairHandle, make_pair_handle
from ray_ple.protocol.layout import ControlBlock, PairLayout, Side, State
from ray_ple.protocol.shm import SharedSegment, sweep_orphans
from ray_ple.protocol.transaction import OffloadEnd, wait_until
from ray_ple.table_source import TableSource


class OffloadSpec(Frozen):
    """What one offload actor serves; built by the supervisor, validated on arrival."""

    rank: int
    actor_name: str
    geometry: PleGeometry
    sources: tuple[TableSource, ...]
    config: PleConfig


class PairStatus(Frozen):
    """A snapshot of one pair as its offload actor sees it (for health and the supervisor)."""

    rank: int
    pid: int
    node_id: str
    state: str
    reason: int
    posted: int
    published: tuple[int, ...]
    released: int
    worker_heartbeat_age_s: float | None
    cuda_evidence: list[str]
    torch_imported: bool
    table_fingerprints: list[str]
    table_inodes: list[int]


def node_id() -> str:
    """The Ray node this process runs on ("local" outside Ray, e.g. the GPU test rig)."""
    try:
        import ray
    except ImportError:
        return "local"
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


class OffloadActor:
    """Plain class; `ray.remote(OffloadActor)` makes it the actor (`supervision.offload_group`)."""

    def __init__(self, spec: OffloadSpec) -> None:
        hide_cuda()
        self.spec = OffloadSpec.model_validate(spec)  # re-checked on arrival
        self.tables: list[NodeTable] = []
        self.segment: SharedSegment | None = None
        self.block: ControlBlock | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # setup ------------------------------------------------------------------------------
    def setup(self) -> PairHandle:
        """Hold the node tables, create the pair segment, start serving; return the handle."""
        spec, cfg = self.spec, self.spec.config
        if faults.ACTIVE and faults.hit("offload.die_during_setup", spec.rank):
            os._exit(1)
        sweep_orphans(cfg.shm_dir)
        for src in spec.sources:  # one by one: `close` drops those held if a later one fails
            self.tables.append(acquire_table(src, shm_dir=cfg.shm_dir,
                                             deadline_s=cfg.deadlines.startup_s,
                                             huge_pages=cfg.huge_pages))
        fp = (self.tables[0].fingerprint if len(self.tables) == 1 else hashlib.sha256(
            "".join(t.fingerprint for t in self.tables).encode()).hexdigest())
        self._slots = spec.geometry.slots()
        layout = PairLayout.compute(spec.geometry.max_tokens,
                                    tuple(s.row_bytes for s in self._slots))
        self.segment = SharedSegment.create("pair", layout.size, cfg.shm_dir)
        self.block = ControlBlock(self.segment, layout)
        self.block.write_header(self.segment.token, fp)
        self.block.set_state(State.INIT)
        self._bell = DoorbellListener(self.segment.token)
        self._end = OffloadEnd(self.block, spec.rank, cfg.deadlines, spec.geometry.slot_names)
        self._gather = [RowGatherer(t.rows, layout.max_tokens, cfg.gather_threads)
                        for t in self.tables]
        self._thread = threading.Thread(target=self._serve, name="ray-ple-offload", daemon=True)
        self._thread.start()
        handle = make_pair_handle(
            rank=spec.rank, segment=self.segment.ref(),
            node_id=node_id(), actor_name=spec.actor_name,
            fingerprint=fp, geometry=spec.geometry, layout=layout)
        log_event("offload_ready", rank=spec.rank, tables=list(spec.geometry.table_names),
                  slots=len(self._slots), segment_bytes=layout.size)
        if faults.ACTIVE and faults.hit("offload.corrupt_handle", spec.rank):
            handle = handle.model_copy(update={"segment": handle.segment.model_copy(
                update={"token": "0" * 32})})
        return handle

    # serving ----------------------------------------------------------------------------
    def _gather_slot(self, slot: int, ids, out) -> None:  # noqa: ANN001 - numpy views
        """Slot `slot`: its part's columns of its table; ids are clipped on a first part."""
        s = self._slots[slot]
        self._gather[s.table_index](ids, out, s.col_offset, s.part == 0)

    def _serve(self) -> None:
        """Serve each posted step once; between steps, watch the worker (transaction rules)."""
        b, end, cfg = self.block, self._end, self.spec.config
        assert b is not None
        poll = cfg.supervisor.heartbeat_interval_s
        spin_s = cfg.offload_spin_us * 1e-6
        cut = faults.publish_cut(b, end.rank)
        placed = False
        while not self._stop.is_set():
            now = time.monotonic_ns()
            b.beat(Side.OFFLOAD, now)
            state = b.state
            if state is State.CLOSED:
                return
            if state is State.READY and not placed:
                placed = True
                self._keep_off_worker_cores()
            end.watch(now)
            step = end.next_step()
            if step is not None:
                gather = self._gather_slot
                if faults.ACTIVE:
                    gather = faults.before_gather(end.rank, b, b.ids[:b.token_count], gather)
                end.publish(step, gather, cut)
                # no second turn before the doorbell: nothing can be posted before this
                # step's release, and the sleep reads `announced` after its fence. The
                # watch above runs again at the wake-up (a ring, or a heartbeat's poll later)
            if b.announced != end.last:  # the GPU stream posts it: spin, never sleep
                end.await_post()
                continue
            if spin_s and wait_until(lambda last=end.last: b.posted != last, spin_s,
                                     spin_s=spin_s):
                continue  # a post arrived while spinning: serve it on the next turn
            end.sleep(lambda: self._bell.wait(poll) and timing.ENABLED
                      and timing.record("wake", time.monotonic_ns()))

    def _keep_off_worker_cores(self) -> None:
        """Serve from cores the worker is not bound to, where the host has any.

        vLLM-CPU binds its worker's threads to cores. A doorbell wakes this thread on the
        ringing core by preference, where it preempts the very forward it feeds (docs/history.md,
        vLLM-CPU offline engines). Only this serving thread moves; with no free core (e.g. TP over
        every core) nothing changes.
        """
        try:
            worker = os.sched_getaffinity(self.block.worker_pid)
            mine = os.sched_getaffinity(0)
        except OSError:  # no such worker: its heartbeat and the supervisor will say
            return
        free = mine - worker
        if free and free != mine:
            os.sched_setaffinity(0, free)
            log_event("offload_cores", rank=self.spec.rank, cores=sorted(free),
                      worker_cores=sorted(worker))

    # queries ----------------------------------------------------------------------------
    def status(self) -> PairStatus:
        b = self.block
        posted, published, released = b.counters() if b else (0, (), 0)
        hb = b.heartbeat(Side.WORKER) if b else 0
        return PairStatus(
            rank=self.spec.rank, pid=os.getpid(), node_id=node_id(),
            state=b.state.name if b else "NONE", reason=b.reason if b else 0, posted=posted,
            published=published, released=released,
            worker_heartbeat_age_s=(time.monotonic_ns() - hb) / 1e9 if hb else None,
            cuda_evidence=cuda_evidence(), torch_imported="torch" in sys.modules,
            table_fingerprints=[t.fingerprint for t in self.tables],
            table_inodes=[t.segment.inode for t in self.tables],
        )

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Orderly end (replica shutdown): CLOSED, stop serving, drop every hold."""
        self._stop.set()
        if self.block is not None and self.block.state is not State.FAILED:
            self.block.set_state(State.CLOSED)
        if self._thread is not None:
            self._thread.join(timeout=2)
        for g in getattr(self, "_gather", ()):
            g.close()
        for t in self.tables:
            t.close()
        if self.segment is not None:
            self.segment.close()
