"""The worker's side of its pair: attach once per process, then bracket every forward.

Holds the per-process registry keyed by slot name that the pull op resolves on every call,
so that no address is ever an op argument or a constant a compile cache could keep.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ray_ple.config import PleDeadlines
from ray_ple.errors import PleConfigError, PleHandleError
from ray_ple.instrument import faults, timing
from ray_ple.log import log_event
from ray_ple.protocol.doorbell import Doorbell
from ray_ple.protocol.fatal import Failure, Reason
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.protocol.handles import (
    EngineHandles,
    PairHandle,
    validate_pair_handle,
    validate_segment_header,
)
from ray_ple.protocol.layout import ControlBlock, Side, State
from ray_ple.protocol.shm import SharedSegment
from ray_ple.protocol.transaction import Phase, WorkerEnd, stale_heartbeat
from ray_ple.worker.transport import STREAM_POSTING, make_transport


class WorkerPair:
    """One worker's attachment to its offload actor's segment."""

    def __init__(self, handle: PairHandle, segment: SharedSegment, block: ControlBlock,
                 transport_name: str, deadlines: PleDeadlines, heartbeat_s: float,
                 post: str = "host") -> None:
        self.handle, self.segment, self.block = handle, segment, block
        self.worker = WorkerEnd(block, handle.rank, deadlines, handle.slot_names)
        if post not in ("host", "stream") or (post == "stream"
                                               and transport_name not in STREAM_POSTING):
            raise PleConfigError(f"ple.post {post!r} with transport {transport_name!r}: 'host', "
                                 f"or 'stream' with a transport of {STREAM_POSTING}")
        self.transport = make_transport(transport_name, self.worker, handle.slots[0].dtype)
        self._stream_post = post == "stream"
        self._bell = Doorbell(handle.segment.token)
        self._post_cut = faults.post_cut(block)
        self._stop = threading.Event()
        self._heartbeat_s = heartbeat_s
        self._beater = threading.Thread(target=self._beat, name="ray-ple-heartbeat", daemon=True)

    @classmethod
    def attach(cls, handle: PairHandle, expected: PleGeometry, *, rank: int, transport: str,
               deadlines: PleDeadlines, heartbeat_s: float, post: str = "host") -> WorkerPair:
        """Validate every field, map, check the segment header, then declare READY."""
        layout = validate_pair_handle(handle, expected, rank=rank)
        segment = SharedSegment.attach(handle.segment)
        try:
            block = ControlBlock(segment, layout)
            validate_segment_header(block.read_header(), handle)
            if block.state is not State.INIT:
                raise PleHandleError(f"pair of rank {rank} is {block.state.name}, not INIT")
            pair = cls(handle, segment, block, transport, deadlines, heartbeat_s, post)
        except BaseException:
            segment.close()
            raise
        block.beat(Side.WORKER, time.monotonic_ns())
        block.worker_pid = os.getpid()
        block.set_state(State.READY)
        pair._beater.start()
        log_event("pair_attached", rank=rank, slots=list(handle.slot_names),
                  transport=transport, post=post, max_tokens=layout.max_tokens,
                  segment_bytes=layout.size)
        return pair

    def _beat(self) -> None:
        """Beat, and fail closed here if the offload side stopped beating."""
        while not self._stop.wait(self._heartbeat_s):
            now = time.monotonic_ns()
            self.block.beat(Side.WORKER, now)
            if (f := stale_heartbeat(self.block, Side.OFFLOAD, now, self.worker.deadlines)):
                self.worker.fail(f)

    @property
    def stream_posts(self) -> bool:
        """Does this pair post from the consumer's stream (`stream_step`)?"""
        return self._stream_post

    @contextmanager
    def step(self, host_ids: np.ndarray) -> Iterator[int]:
        """One transaction around one real forward, posted from the host's copy of the ids;
        any exception inside is fatal."""
        w = self.worker
        s = w.begin(host_ids, self._post_cut)
        if timing.ENABLED:
            timing.record("post", time.monotonic_ns())
        with self._transaction(s):
            yield s

    @contextmanager
    def stream_step(self, ids) -> Iterator[int]:  # noqa: ANN001 - torch.Tensor
        """One transaction whose post the consumer's stream writes, from `ids` (the
        forward's own input tensor, on the device): the host announces and enqueues, and
        never waits for the GPU nor reads the ids. Bad ids raise before anything is stored."""
        self.transport.check_stream_ids(ids)
        w = self.worker
        s = w.announce(int(ids.shape[0]))
        try:
            self.transport.stream_post(ids)
        except BaseException as exc:  # noqa: BLE001 - announced, never posted: fail closed
            w.abandon(f"stream post of step {s} raised {type(exc).__name__}: {exc}")
        if timing.ENABLED:
            timing.record("post", time.monotonic_ns())
        with self._transaction(s):
            yield s

    @contextmanager
    def _transaction(self, s: int) -> Iterator[None]:
        """After the post (or the announcement): ring if asleep, run the forward, release."""
        w = self.worker
        try:
            if w.must_ring():  # only a sleeping offload side needs the syscall
                self._bell.ring()
            if faults.ACTIVE and faults.hit("worker.raise_after_post", w.rank):
                raise RuntimeError("injected fault: exception after post")
            yield
        except BaseException as exc:  # noqa: BLE001 - abandoned forward: fail closed
            w.abandon(f"forward of step {s} raised {type(exc).__name__}: {exc}")
        if faults.ACTIVE and (f := faults.hit("worker.stall_before_release", w.rank)):
            time.sleep(f.arg or 1e9)
        self.transport.release(s)
        w.end_step(s)
        if faults.ACTIVE:
            faults.after_release(self.block, w.rank, s)

    @contextmanager
    def local_forward(self) -> Iterator[None]:
        """A forward that must not reach the offload actor (dummy, profile, capture)."""
        self.worker.begin_local()
        try:
            with self.transport.local_forward():
                yield
        finally:
            self.worker.end_local()

    def pull(self, slot: int, out) -> None:  # noqa: ANN001 - torch.Tensor
        self._consume(slot, out, self.transport.pull, self.transport.satisfy_locally)

    def pull_async(self, slot: int, out) -> None:  # noqa: ANN001 - torch.Tensor
        self._consume(slot, out, self.transport.pull_async,
                      self.transport.satisfy_locally_async)

    def pull_wait(self, slot: int, out) -> None:  # noqa: ANN001 - torch.Tensor
        self._consume(slot, out, self.transport.pull_wait, self.transport.satisfy_wait_locally)

    def _consume(self, slot: int, out, in_step, in_local) -> None:  # noqa: ANN001
        """By the worker's phase: the step's rows, local rows, or no transaction (fatal)."""
        phase = self.worker.phase
        if phase is Phase.STEP:
            in_step(slot, out)
        elif phase is Phase.LOCAL:
            in_local(slot, out)
        else:
            self.worker.fail(Failure(Reason.NO_TRANSACTION, "model pulled PLE rows outside any "
                                     "forward ray-ple bracketed", slot), Side.CONSUMER)

    def close(self) -> None:
        self._stop.set()
        self.transport.close()
        self._bell.close()


# Per-process registry ---------------------------------------------------------------------
_PAIR: WorkerPair | None = None
_SLOTS: dict[str, int] = {}
_LOCK = threading.Lock()


def current() -> WorkerPair | None:
    return _PAIR


def pair_of_slot(slot: str) -> tuple[WorkerPair, int]:
    """This process's live pair and the index of the slot named `slot` (the ops' only lookup)."""
    pair = _PAIR
    index = _SLOTS.get(slot)
    if pair is None or index is None:
        raise PleHandleError(f"no ray-ple pair in this process serves slot {slot!r}")
    return pair, index


def pull(slot: str, out) -> None:  # noqa: ANN001 - torch.Tensor
    pair, index = pair_of_slot(slot)
    pair.pull(index, out)


def attach_process(expected: PleGeometry, *, rank: int, transport: str,
                   deadlines: PleDeadlines, heartbeat_s: float, post: str = "host") -> WorkerPair:
    """Attach this process's pair once (idempotent), and register its slots by name."""
    global _PAIR
    with _LOCK:
        if _PAIR is not None:
            if _PAIR.worker.rank != rank or _PAIR.handle.slot_names != expected.slot_names:
                raise PleHandleError("this process is already attached to another pair")
            return _PAIR
        handles = {h.rank: h for h in EngineHandles.from_env(os.environ).pairs}
        if rank not in handles:
            raise PleHandleError(f"no pair handle for worker rank {rank} (have {sorted(handles)})")
        pair = WorkerPair.attach(handles[rank], expected, rank=rank, transport=transport,
                                 deadlines=deadlines, heartbeat_s=heartbeat_s, post=post)
        _SLOTS.clear()
        _SLOTS.update({name: i for i, name in enumerate(pair.handle.slot_names)})
        _PAIR = pair
        return pair
