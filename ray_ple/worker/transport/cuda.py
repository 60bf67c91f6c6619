"""CUDA transport: the consumer (`C` in `protocol/transaction.py`) on the model stream.

Setup (once per process, in the worker): the pair segment is page-locked and device-mapped
(`cuMemHostRegister(PORTABLE | DEVICEMAP)`, kept for the life of the process), the device is
checked for mapped host memory and stream memory operations, and the two kernels are loaded.

Per forward, all in stream order on the current torch stream, all capturable::

    pull(slot, out)   cuStreamWaitValue32(flag[slot] == 1)
                       stamp[slot] == released + 1, else reason + FAILED + trap
                       copy T x row_bytes slot -> out   (SM kernel with ld.cv for small
                                                         steps, cuMemcpyHtoDAsync above)
    release(step)      ple_release: flag[*] = 0, system fence, released += 1

With the stream post (`ple.post: stream`), the step itself is posted in stream order too:
`stream_post(ids)` forks the side stream off the model stream before the forward and
enqueues `ple_post` there (counter checks, the ids from the model's own input tensor, then
`posted`), so the host never waits nor reads the ids, and the forward never waits for the
post: only a pull needs the step, and it waits for the step's rows.

The late pull splits the same into two ops, so that a slot (one part of a table's row: a
group of consecutive model layers) arrives while the earlier layers run::

    pull_async(slot, out)   fork: the side stream waits for the model stream here (after
                             the previous step's release, so a flag it sees up is this
                             step's), then, on the side stream: wait flag, stamp check,
                             copy (on the copy engine: an SM copy beside the layers would
                             hold SMs that their GEMMs need), record done[slot]
    pull_wait(slot, out)    the model stream waits for done[slot] (just before the part is
                             consumed); every async pull of a step must be waited before its
                             release, which stays on the model stream and the only reset

Both are graph-capturable (a fork and a join of the capturing stream). Under vLLM's piecewise
graphs a fork cannot be captured in one piece and joined in another: there a part is
pulled in stream order in its piece (`ray_ple.worker.ops`).

The step stamp check runs on the GPU because the host cannot see the copy happen: a graph
replay or an async copy has no host moment between "flag up" and "rows consumed". It fails
closed with a trap (the context is lost, so the step's tokens never leave the GPU) after
writing the reason word and FAILED into the control block, where the offload side and the
supervisor read it. Its reference is `released + 1`, a word the stream itself advances, so
nothing step-specific is baked into a graph; a slot's stamp word is written with its rows,
before the flag.

`released` is advanced by the stream itself, so a GPU stuck in a wait leaves it behind and
the offload actor's step deadline ends the replica.

Local forwards (dummy, profile, capture) never touch the offload actor. Eager ones get zero
rows and move no word (a flag set and reset by a forward nobody posted could race the next
real step's publish). A capture records the real wait and copy into the graph, and the
geometry it captured (rows and bytes per slot) is kept as a `CaptureRecord`. A replay is
declared to no one (vLLM's runner replays its own graphs): a step that no pull consumed is
released only if a graph was captured for its token count.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from ray_ple.base import Frozen
from ray_ple.errors import PleConfigError, PleEnvironmentError
from ray_ple.log import log_event
from ray_ple.protocol.fatal import Reason
from ray_ple.protocol.layout import (
    ANNOUNCED_OFF,
    POSTED_OFF,
    RELEASED_OFF,
    SLOT_STRIDE,
    STATE_OFF,
    Side,
    State,
)
from ray_ple.protocol.transaction import Phase, token_rows
from ray_ple.worker.transport.base import Transport
from ray_ple.worker.transport.cuda_host import (
    Registration,
    check,
    device_caps,
    driver,
    ensure_context,
    register_host,
)
from ray_ple.worker.transport.cuda_kernels import (
    POST_THREADS,
    POST_WORDS_BEFORE_SLOTS,
    Kernels,
    PostWords,
    StampCheck,
)

if TYPE_CHECKING:
    from ray_ple.protocol.transaction import WorkerEnd

# How rows are copied (read at each enqueue, so baked into a graph at its capture); a bench
# that compares settings assigns these attributes before it captures.
COPY_MODE: Literal["auto", "dma", "sm"] = "auto"  # auto: by size (bench/cuda/bench_pull.py)
SM_COPY_MAX_BYTES = 8 << 20  # auto: SM copy up to this size (bench/cuda/bench_pull.py)
# auto, late pulls: the copy engine above this size; an SM copy beside the layers holds SMs
# on PCIe reads where their GEMMs would run (bench/cuda/bench_model.py)
LATE_SM_COPY_MAX_BYTES = 0
LATE_COPY_BLOCKS = 0  # most blocks of a late SM copy, 0: up to 8 per SM (bench/cuda/bench_model.py)
STAMP_REASON = Reason.INVARIANT  # the reason a stamp mismatch writes


class SlotCopy(Frozen):
    """One pull as a graph captured it."""

    slot: int
    rows: int
    nbytes: int
    mode: Literal["dma", "sm"]
    late: bool = False  # copied on the side stream, joined before its consumer


class CaptureRecord(Frozen):
    """What one captured forward will do on every replay."""

    rows: int
    copies: tuple[SlotCopy, ...]


_KERNELS: dict[int, Kernels] = {}
_KLOCK = threading.Lock()


def kernels_for(device: int) -> Kernels:
    """This process's kernels for `device` (compiled and loaded once)."""
    with _KLOCK:
        if device not in _KERNELS:
            _KERNELS[device] = Kernels.load(device)
        return _KERNELS[device]


class CudaTransport(Transport):
    name = "cuda"

    def __init__(self, worker: WorkerEnd, dtype: str) -> None:
        super().__init__(worker, dtype)
        if not torch.cuda.is_available():
            raise PleEnvironmentError("transport 'cuda' needs a CUDA device; torch sees none "
                                      "(use transport 'cpu')")
        self.device = torch.cuda.current_device()
        torch.cuda.init()
        ensure_context(self.device)
        self.caps = device_caps(self.device)
        self.caps.require()
        self._local = threading.local()
        self._local.ready = True
        self.kernels = kernels_for(self.device)
        layout, seg = self.block.layout, self.block.segment
        keep = np.frombuffer(seg.map, dtype=np.uint8)  # a buffer export pins the mapping
        host = int(keep.ctypes.data)
        self.registration: Registration = register_host(
            host, seg.size, keep, what=f"ray-ple pair segment of rank {worker.rank}")
        base = self.registration.device_ptr
        self._base_dev = base
        self._flag_dev = [base + off for off in layout.flag_offsets]
        self._slot_host = [host + off for off in layout.slot_offsets]
        self._slot_dev = [base + off for off in layout.slot_offsets]
        self._row_bytes = layout.row_bytes
        self._flag0, self._nflags = layout.flag_offsets[0], len(layout.flag_offsets)
        self._stamp = [StampCheck(base, off, RELEASED_OFF, STATE_OFF, int(State.FAILED),
                                  int(STAMP_REASON)) for off in layout.stamp_offsets]
        self._post_words = PostWords(
            state_off=STATE_OFF, ready=int(State.READY), failed=int(State.FAILED),
            reason=int(Reason.STREAM_POST), posted_off=POSTED_OFF, released_off=RELEASED_OFF,
            announced_off=ANNOUNCED_OFF, published0_off=layout.published_offsets[0],
            slot_stride=SLOT_STRIDE, n_slots=self._nflags, count_off=layout.count_offset,
            ids_off=layout.ids_offset)
        self._post_params: dict[tuple[int, int], object] = {}  # (ids, T) -> launch params
        if POST_WORDS_BEFORE_SLOTS + self._nflags > POST_THREADS:
            raise PleConfigError(f"{self._nflags} slots: the stream post reads at most "
                                 f"{POST_THREADS - POST_WORDS_BEFORE_SLOTS}")
        self._probe()
        # the late pull: one side stream (high priority: a copy waits for no GEMM block),
        # one fork event, one completion event per slot; all for the life of the process
        self._side = torch.cuda.Stream(self.device, priority=-1)
        d = driver()
        flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._fork = check(d.cuEventCreate(flags), "cuEventCreate(fork)")
        self._post_fork = check(d.cuEventCreate(flags), "cuEventCreate(post fork)")
        self._done = [check(d.cuEventCreate(flags), "cuEventCreate(done)")
                      for _ in range(self._nflags)]
        # per-step bookkeeping (host side, checked before every release)
        self._pulled: list[int] = [-1] * self._nflags
        self._waited: list[int] = [-1] * self._nflags
        self._capture_pending: set[int] = set()
        self._capture: list[SlotCopy] | None = None
        self.captures: dict[int, list[CaptureRecord]] = {}  # token count -> graphs captured
        log_event("cuda_transport_ready", rank=worker.rank, device=self.device,
                  gpu=self.caps.name, driver=self.caps.driver_version,
                  segment_bytes=seg.size, register_s=round(self.registration.seconds, 4),
                  device_ptr_equals_host=base == host, copy=COPY_MODE,
                  sm_max_bytes=SM_COPY_MAX_BYTES, late_sm_max_bytes=LATE_SM_COPY_MAX_BYTES)

    # setup ------------------------------------------------------------------------------
    def _probe(self) -> None:
        """Run wait/write memops and both kernels once on private pinned memory."""
        d = driver()
        page = mmap.mmap(-1, mmap.PAGESIZE)
        scratch = np.frombuffer(page, dtype=np.int32)
        sdev = register_host(int(scratch.ctypes.data), mmap.PAGESIZE, scratch,
                             what="ray-ple probe page").device_ptr
        dev_buf = torch.empty(16, dtype=torch.int32, device=f"cuda:{self.device}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        try:
            check(d.cuStreamWriteValue32(stream, sdev, 7, 0), "cuStreamWriteValue32")
            check(d.cuStreamWaitValue32(stream, sdev, 7,
                                        d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ),
                  "cuStreamWaitValue32")
            scratch[2] = 41
            scratch[4] = 43  # a stamp (u64 at byte 16) that matches released (42) + 1
            self.kernels.launch_release(sdev, 1, 0, 4, 8, stream)
            self.kernels.launch_check(StampCheck(sdev, 16, 8, 32, int(State.FAILED), 1),
                                      stream)
            self.kernels.launch_copy(sdev, dev_buf.data_ptr(), 32, stream)
            check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(probe)")
        except PleEnvironmentError as exc:
            raise PleEnvironmentError(
                f"GPU {self.device} ({self.caps.name}) refused a stream memory operation or "
                f"kernel on mapped host memory: {exc}") from exc
        got = scratch.tolist()
        if got[0] != 0 or got[2] != 42 or got[8] != 0 or dev_buf[2].item() != 42:
            raise PleEnvironmentError(f"mapped host memory probe read back {got}: writes of "
                                      "the GPU are not visible to the host on this system")

    def _stream(self) -> int:
        if not getattr(self._local, "ready", False):
            ensure_context(self.device)
            self._local.ready = True
        return torch.cuda.current_stream(self.device).cuda_stream

    def _mode(self, nbytes: int, dst: int, late: bool = False) -> Literal["dma", "sm"]:
        aligned = nbytes % 16 == 0 and dst % 16 == 0
        if COPY_MODE == "sm" and aligned:
            return "sm"
        sm_max = LATE_SM_COPY_MAX_BYTES if late else SM_COPY_MAX_BYTES
        if COPY_MODE == "auto" and aligned and nbytes <= sm_max:
            return "sm"
        return "dma"

    def _enqueue(self, slot: int, out: torch.Tensor, nbytes: int, stream: int,
                 max_blocks: int = 0, late: bool = False) -> Literal["dma", "sm"]:
        d = driver()
        check(d.cuStreamWaitValue32(stream, self._flag_dev[slot], 1,
                                    d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ),
              "cuStreamWaitValue32(flag == 1)")
        dst = out.data_ptr()
        mode = self._mode(nbytes, dst, late)
        if mode == "sm" and nbytes:
            self.kernels.launch_copy(self._slot_dev[slot], dst, nbytes, stream,
                                     self._stamp[slot], max_blocks)
        else:
            self.kernels.launch_check(self._stamp[slot], stream)
            if nbytes:
                check(d.cuMemcpyHtoDAsync(dst, self._slot_host[slot], nbytes, stream),
                      "cuMemcpyHtoDAsync(slot)")
        return mode

    def _enqueue_late(self, slot: int, out: torch.Tensor, nbytes: int,
                      model: int) -> Literal["dma", "sm"]:
        """Fork the side stream off `model` here, pull there, record done[slot]."""
        d = driver()
        side = self._side.cuda_stream
        check(d.cuEventRecord(self._fork, model), "cuEventRecord(fork)")
        check(d.cuStreamWaitEvent(side, self._fork, 0), "cuStreamWaitEvent(side, fork)")
        mode = self._enqueue(slot, out, nbytes, side, LATE_COPY_BLOCKS, late=True)
        check(d.cuEventRecord(self._done[slot], side), "cuEventRecord(done)")
        return mode

    def _join(self, slot: int, model: int) -> None:
        """`model` waits for done[slot] (of the fork in this step, or in this capture)."""
        d = driver()
        check(d.cuStreamWaitEvent(model, self._done[slot], 0), "cuStreamWaitEvent(done)")

    def _geometry(self, slot: int, out: torch.Tensor) -> int:
        """Bytes to copy for `out`; fatal if `out` is not a dense CUDA view of whole rows."""
        rows = out.shape[0] if out.dim() else -1
        nbytes = out.numel() * out.element_size()
        if (out.device.type != "cuda" or not out.is_contiguous()
                or not 0 <= rows <= self.block.layout.max_tokens
                or nbytes != rows * self._row_bytes[slot]):
            self._fail(Reason.GEOMETRY, slot,
                       f"pull into {tuple(out.shape)} {out.dtype} on {out.device} (contiguous="
                       f"{out.is_contiguous()}): not whole rows of {self._row_bytes[slot]} B "
                       f"within {self.block.layout.max_tokens} tokens")
        return nbytes

    # the transaction ----------------------------------------------------------------------
    def check_stream_ids(self, ids: torch.Tensor) -> None:
        """The ids a stream post reads: the model's int32 input tensor on this device, and
        no graph being captured (a capture is a local forward and never posts)."""
        if (ids.dtype is not torch.int32 or not ids.is_cuda or ids.get_device() != self.device
                or ids.dim() != 1 or not ids.is_contiguous()):
            raise PleConfigError(f"a stream post reads a contiguous 1-D int32 tensor on cuda:"
                                 f"{self.device}, got {tuple(ids.shape)} {ids.dtype} on "
                                 f"{ids.device}")
        if torch.cuda.is_current_stream_capturing():
            raise PleConfigError("a step cannot be posted inside a CUDA graph capture")

    def stream_post(self, ids: torch.Tensor) -> None:
        """Enqueue `ple_post` of the announced step on the side stream, forked from the
        model stream here (after the previous release and the ids): the forward runs on
        while the step is checked and posted; the pulls that need it wait for its rows,
        which the offload side writes only after `posted`, so no release of this step (nor
        the next step's ids) can overtake the post."""
        w = self.worker
        if ids.shape[0] != w.rows:  # a direct call out of step with `announce`
            self._fail(Reason.GEOMETRY, 0, f"stream post of {ids.shape[0]} ids, step {w.step} "
                       f"announced {w.rows}")
        d, side = driver(), self._side.cuda_stream
        check(d.cuEventRecord(self._post_fork, self._stream()), "cuEventRecord(post fork)")
        check(d.cuStreamWaitEvent(side, self._post_fork, 0), "cuStreamWaitEvent(post fork)")
        ids.record_stream(self._side)  # a temporary (not vLLM's buffer): kept until read
        self.kernels.launch_post(self._base_dev, ids.data_ptr(), w.rows, self._post_words,
                                 side, self._post_params)

    def pull(self, slot: int, out: torch.Tensor) -> None:
        nbytes = self._check_pull(slot, out)
        self._enqueue(slot, out, nbytes, self._stream())
        self._pulled[slot] = self._waited[slot] = self.worker.step

    def _check_pull(self, slot: int, out: torch.Tensor) -> int:
        """The host checks of every pull of the step in flight; the bytes to copy."""
        w = self.worker
        if torch.cuda.is_current_stream_capturing():
            self._fail(Reason.STATE, slot, f"step {w.step} is being captured into a graph; "
                       "captures must run as local forwards")
        nbytes = self._geometry(slot, out)
        if (f := token_rows(w.rows, slot, w.step, out.shape[0])) is not None:
            w.fail(f, Side.CONSUMER)
        if self._pulled[slot] == w.step:
            self._fail(Reason.INVARIANT, slot, f"rows of step {w.step} pulled twice")
        return nbytes

    def pull_async(self, slot: int, out: torch.Tensor) -> None:
        """Start `slot`'s pull on the side stream; `pull_wait` joins it before its use."""
        nbytes = self._check_pull(slot, out)
        self._enqueue_late(slot, out, nbytes, self._stream())
        self._pulled[slot] = self.worker.step

    def pull_wait(self, slot: int, out: torch.Tensor) -> None:
        """The model stream waits for `slot`'s async pull of the step in flight."""
        step = self.worker.step
        if self._pulled[slot] != step or self._waited[slot] == step:
            self._fail(Reason.INVARIANT, slot, f"wait for rows of step {step} that were "
                       "not pulled asynchronously, or waited twice")
        self._join(slot, self._stream())
        self._waited[slot] = step

    def started(self, slot: int) -> bool:
        """Has `slot`'s async pull of this forward been started and not yet joined?"""
        w = self.worker
        if w.phase is Phase.STEP:
            return self._pulled[slot] == w.step and self._waited[slot] != w.step
        return slot in self._capture_pending

    def satisfy_locally_async(self, slot: int, out: torch.Tensor) -> None:
        """`pull_async` in a local forward: zero rows eagerly; a capture records the fork."""
        if not torch.cuda.is_current_stream_capturing():
            out.zero_()
            return
        self._check_local_capture(slot)
        nbytes = self._geometry(slot, out)
        mode = self._enqueue_late(slot, out, nbytes, self._stream())
        self._capture.append(SlotCopy(slot=slot, rows=out.shape[0], nbytes=nbytes, mode=mode,
                                       late=True))
        self._capture_pending.add(slot)

    def satisfy_wait_locally(self, slot: int, out: torch.Tensor) -> None:
        """`pull_wait` in a local forward: nothing eagerly; a capture records the join of the
        fork it captured."""
        if not torch.cuda.is_current_stream_capturing():
            return
        if self._capture is None or slot not in self._capture_pending:
            self._fail(Reason.INVARIANT, slot, "captured wait for a slot whose async pull "
                       "this capture did not start, or waited twice")
        self._join(slot, self._stream())
        self._capture_pending.discard(slot)

    def _check_local_capture(self, slot: int) -> None:
        if self.worker.phase is not Phase.LOCAL or self._capture is None:
            self._fail(Reason.STATE, slot, "capture outside a local forward")
        if any(c.slot == slot for c in self._capture):
            self._fail(Reason.INVARIANT, slot, "one captured forward pulls a slot twice")

    def satisfy_locally(self, slot: int, out: torch.Tensor) -> None:
        if not torch.cuda.is_current_stream_capturing():
            out.zero_()
            return
        self._check_local_capture(slot)
        nbytes = self._geometry(slot, out)
        mode = self._enqueue(slot, out, nbytes, self._stream())
        self._capture.append(SlotCopy(slot=slot, rows=out.shape[0], nbytes=nbytes, mode=mode))

    def _launch_release(self, stream: int) -> None:
        self.kernels.launch_release(self._base_dev, self._nflags, self._flag0, SLOT_STRIDE,
                                    RELEASED_OFF, stream)

    @contextmanager
    def local_forward(self) -> Iterator[None]:
        if self._capture is not None:
            raise PleConfigError("local forwards do not nest")
        self._capture, self._capture_pending = [], set()
        try:
            yield
        finally:
            copies, self._capture = self._capture, None
            if self._capture_pending:
                self._fail(Reason.GEOMETRY, min(self._capture_pending),
                           f"captured async pulls of slots {sorted(self._capture_pending)} "
                           "were never waited")
            if copies:
                self._store_capture(copies)

    def _store_capture(self, copies: list[SlotCopy]) -> None:
        rows = {c.rows for c in copies}
        slots = sorted(c.slot for c in copies)
        if len(rows) != 1 or slots != list(range(self._nflags)):
            self._fail(Reason.GEOMETRY, slots[0],
                       f"captured forward copies rows {sorted(rows)} for slots {slots}; "
                       f"every one of the {self._nflags} slots must be consumed once, at the "
                       "same token count")
        rec = CaptureRecord(rows=rows.pop(), copies=tuple(copies))
        self.captures.setdefault(rec.rows, []).append(rec)
        log_event("cuda_graph_captured", rank=self.worker.rank, rows=rec.rows,
                  bytes=sum(c.nbytes for c in copies), modes=sorted({c.mode for c in copies}),
                  late=sum(c.late for c in copies))

    def release(self, step: int) -> None:
        self._check_consumed(step)
        self._launch_release(self._stream())

    def _check_consumed(self, step: int) -> None:
        """Every slot's rows of `step` went to exactly one consumer of the right size."""
        pulled = [i for i, p in enumerate(self._pulled) if p == step]
        if not pulled:
            # a graph replayed (vLLM's runner declares no replay): a capture of this token
            # count must exist, and it copies exactly these rows for every slot
            t = self.worker.rows
            if not self.captures.get(t):
                self._fail(Reason.GEOMETRY, 0,
                           f"step {step} ({t} tokens) was consumed by no pull and no graph "
                           f"captured for {t} tokens (captured: {sorted(self.captures)})")
            return
        unwaited = [i for i in pulled if self._waited[i] != step]
        if unwaited:
            self._fail(Reason.GEOMETRY, unwaited[0], f"step {step}: async pulls of slots "
                       f"{unwaited} were never waited before the release")
        if pulled != list(range(self._nflags)):
            self._fail(Reason.GEOMETRY, 0, f"step {step}: slots pulled {pulled}; each of "
                       f"{self._nflags} must be consumed once")

    def close(self) -> None:
        """Registrations stay for the process (graphs hold the addresses)."""
        log_event("cuda_transport_closed", rank=self.worker.rank,
                  registered_bytes=self.registration.size)
