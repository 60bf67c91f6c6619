"""The transaction: one per forward, per worker. Every rule of a step, once.

Why it is built this way: `docs/design-notes.md#the-transaction`.

Timeline of step s (W = worker, O = offload actor, C = consumer: the GPU stream on CUDA, the
engine thread on CPU; every counter lives in the pair's control block)::

    W  begin(ids):   phase IDLE?  state READY?  posted == published[*] == released == s-1?
                     0 <= T <= max?  write T and ids, announced = s, then  posted = s
    W  (doorbell):   ring only if the offload side said it sleeps (`sleeping`, read after
                     a store-load fence that follows the store of `announced`)
    O  next_step():  posted == last + 1 (anything else is fatal), released == last
    O  publish():    per slot, in order: wait flag == 0 (bounded; never overwrite), gather
                     the rows into the slot, stamp[slot] = s, published[slot] = s, flag = 1
    C  pull(slot):   wait flag == 1, `consumable` (published == stamp == s, rows == T), copy
    C  release(s):   flag = 0 for every slot, then released = s   (the only reset)
    W  end_step(s):  phase back to IDLE

The stream post (CUDA): the worker only announces (`announce(T)`: phase, state, T, then
`announced = s`, fence, ring if asleep) and enqueues a kernel before the forward; in stream
order that kernel checks what `begin` checks (READY, posted == published[*] == released,
announced > released: the host may be a step ahead), writes T and the ids from the
model's own input tensor, fences and stores `posted = released + 1`, or stores its reason
and traps. The host never waits for the GPU, so vLLM's async scheduling can stay on: the
ids of step s+1 may exist only on the GPU when the host enqueues it. The offload side
never sleeps while `announced` is ahead of the last step it served: it spins for the
stream's `posted` (bounded by `step_s`).

A slot is one part of a table's row (consecutive model layers, `PleGeometry.slots`): the
offload side raises each part's flag as soon as its rows are written, and the consumer waits
for a part only where its first layer needs it (late waits). Still one post and one release
per step; `published` of the step means every part is up.

Before the offload side blocks on its doorbell it stores `sleeping = 1`, fences, and reads
`announced` once more; the worker stores `announced`, fences, and reads `sleeping`. With a
full fence on both sides (Dekker's pattern; TSO alone lets each load pass its own earlier
store) one of them sees the other's store, so a step is never left unrung while its reader
sleeps. `announced` (not `posted`) is the word of the handshake because a stream post is
stored by the GPU, which cannot fence against the host nor ring.

Dummy, profiling and capture forwards never post: the worker runs them in phase LOCAL, the
transport satisfies them locally and no counter moves. Invariants, checked by both sides and
the supervisor with the functions below:

    released <= published[slot] <= posted <= released + 1,  each counter grows by one;
    posted <= announced (checked by the offload side as it takes a step).

The one safety rule: forwards are serialized per worker and any doubt (a counter that jumps
or goes back, a deadline missed, a peer gone, a forward abandoned between begin and release)
ends the replica. The rules return a `Failure`; the sides end their process with it
(`fail_closed`), the supervisor ends the replica. Nothing is ever retried, reset or continued.

Memory order: the sides publish with plain stores and rely on x86-64's store order (TSO) for
the words and the rows written with ordinary stores (`check_memory_model`); the gather uses
ordinary stores only (numpy, torch), so no `sfence` is needed before a flag. The one
store-then-load pair (`announced`/`sleeping`) is fenced with `store_load_fence`.
"""

from __future__ import annotations

import ctypes
import enum
import platform
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from ray_ple.config import PleDeadlines
from ray_ple.errors import PleConfigError, PleEnvironmentError, PleTokenCountError
from ray_ple.protocol.fatal import Failure, Reason, fail_closed
from ray_ple.protocol.layout import ControlBlock, Counters, Side, State

# A test-only seam (ray_ple.instrument.faults): called where a word is about to be stored, it
# returns True when it stored a faulty word itself. None in production: no code runs.
Cut = Callable[[int, int], bool]


def check_memory_model() -> None:
    """The sides publish with plain stores, relying on x86-64's store order (TSO).

    On a weakly ordered CPU (aarch64, e.g. Grace) a reader could see `posted` or a flag before
    the data it guards; until an explicit fence exists there, refuse to start.
    """
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise PleEnvironmentError(f"ray-ple's transaction needs x86-64 store ordering; this CPU "
                                  f"is {machine}")


_LIBC = ctypes.CDLL(None, use_errno=False)
_FENCE_WORD = ctypes.c_int(0)
_SPIN_TRYLOCK = _LIBC.pthread_spin_trylock
_SPIN_TRYLOCK.argtypes = (ctypes.c_void_p,)
_FENCE_ADDR = ctypes.addressof(_FENCE_WORD)
_IDS_DTYPE = np.dtype(np.int32)  # the input slot's id type (layout.py)


def store_load_fence() -> None:
    """A full fence: earlier stores visible before later loads (x86-64 only reorders those).

    Python has no fence; glibc's `pthread_spin_trylock` on x86-64 is one atomic exchange
    (an implicitly locked `xchg`), which orders every earlier store before every later
    load. The word is private and its value unused: only the instruction matters.
    """
    _SPIN_TRYLOCK(_FENCE_ADDR)


# The rules -----------------------------------------------------------------------------------
def invariant_violation(c: Counters) -> Failure | None:
    """released <= published[slot] <= posted <= released + 1."""
    for i, p in enumerate(c.published):
        if not c.released <= p <= c.posted:
            return Failure(Reason.INVARIANT, f"published[{i}]={p} outside [released="
                           f"{c.released}, posted={c.posted}]", i)
    if not c.released <= c.posted <= c.released + 1:
        return Failure(Reason.INVARIANT, f"posted={c.posted} released={c.released}: more than "
                       "one step in flight")
    return None


def went_back(before: Counters, after: Counters) -> Failure | None:
    """Every counter only grows."""
    if (after.posted < before.posted or after.released < before.released
            or any(a < b for a, b in zip(after.published, before.published))):
        return Failure(Reason.COUNTER_BACK, f"counters went back: {tuple(before)} -> "
                       f"{tuple(after)}")
    return None


def next_posted(last: int, posted: int, released: int) -> Failure | None:
    """What the offload side may see: `posted` one past the last step it served, released."""
    if posted < last:
        return Failure(Reason.COUNTER_BACK, f"posted went back to {posted} from {last}")
    if posted > last + 1:
        return Failure(Reason.COUNTER_SKIP, f"posted jumped to {posted} from {last}")
    if released != last:
        return Failure(Reason.INVARIANT, f"step {posted} posted while released={released}")
    return None


def peer_state(block: ControlBlock) -> Failure | None:
    """The pair must be READY to take or serve a step; FAILED carries the peer's reason."""
    if block.ready():
        return None
    state = block.state
    if state is State.FAILED:
        return Failure(Reason.PEER_FAILED, f"pair failed with reason {Reason(block.reason).name}")
    if state is not State.READY:
        return Failure(Reason.STATE, f"pair state {state.name}")
    return None


def stale_heartbeat(block: ControlBlock, side: Side, now_ns: int,
                    deadlines: PleDeadlines) -> Failure | None:
    """A side whose heartbeat is older than `heartbeat_s` is dead (checked while READY)."""
    age = now_ns - block.heartbeat(side)
    if block.state is State.READY and age > deadlines.heartbeat_s * 1e9:
        return Failure(Reason.HEARTBEAT, f"{side.value} heartbeat {age / 1e9:.2f}s old")
    return None


def consumable(block: ControlBlock, slot: int, step: int, rows: int) -> Failure | None:
    """The consumer's check once a flag is up: rows of this step, as many as were posted."""
    if block.published(slot) != step:
        return Failure(Reason.INVARIANT, f"flag up but published={block.published(slot)} for "
                       f"step {step}", slot)
    if (f := stale_stamp(block, slot, step)) is not None:
        return f
    return token_rows(block.token_count, slot, step, rows)


def stale_stamp(block: ControlBlock, slot: int, step: int) -> Failure | None:
    """The slot's rows must be the step's: its stamp is written after them, before the flag."""
    stamp = block.stamp(slot)
    if stamp != step:
        return Failure(Reason.INVARIANT, f"slot holds rows of step {stamp}, step {step} in "
                       "flight", slot)
    return None


def token_rows(posted_rows: int, slot: int, step: int, rows: int) -> Failure | None:
    """A forward pulls exactly the T rows its step posted."""
    if rows != posted_rows:
        return Failure(Reason.GEOMETRY, f"forward pulls {rows} rows, step {step} posted "
                       f"{posted_rows}", slot)
    return None


def announced_behind(posted: int, announced: int) -> Failure | None:
    """Every post was announced first (read `posted` before `announced`: stored after it)."""
    if announced < posted:
        return Failure(Reason.INVARIANT, f"posted={posted} ahead of announced={announced}")
    return None


class Deadline:
    """How long a condition has held, keyed on the step: a new step restarts the clock.

    Used for "a posted step is released within step_s" and "its rows are published within
    offload_wait_s", by the offload side and by the supervisor alike.
    """

    def __init__(self, reason: Reason, limit_s: float, what: str,
                 per_token_s: float = 0.0) -> None:
        self.reason, self.limit_ns, self.what = reason, int(limit_s * 1e9), what
        self.per_token_ns = int(per_token_s * 1e9)
        self._key: int | None = None
        self._since = 0

    def check(self, holds: bool, step: int, now_ns: int, tokens: int = 0) -> Failure | None:
        """`tokens`: the step's token count, where the limit grows with it."""
        if not holds:
            self._key = None
            return None
        if self._key != step:
            self._key, self._since = step, now_ns
        limit = self.limit_ns + max(0, tokens) * self.per_token_ns
        if now_ns - self._since > limit:
            return Failure(self.reason, f"step {step} {self.what} within {limit / 1e9:g}s")
        return None


def step_deadline(deadlines: PleDeadlines) -> Deadline:
    """A posted step must be released in time (also catches a GPU stuck in a wait): `step_s`
    plus `step_token_s` per token of the step, so that a long prefill on a slow CPU engine is
    never taken for a stuck step, while a decode step keeps the short bound."""
    return Deadline(Reason.STEP_DEADLINE, deadlines.step_s, "not released",
                    per_token_s=deadlines.step_token_s)


def publish_deadline(deadlines: PleDeadlines) -> Deadline:
    """A posted step's rows must be published in time: the supervisor's backstop, later than
    the offload side's own `offload_wait_s` (plus a heartbeat), so that a side that can name
    the cause (OFFLOAD_WAIT) does so first."""
    return Deadline(Reason.PUBLISH_DEADLINE, deadlines.offload_wait_s + deadlines.heartbeat_s,
                    "not published")


def wait_until(ready: Callable[[], bool], deadline_s: float, *, spin_s: float = 50e-6,
               abort: Callable[[], bool] | None = None) -> bool:
    """The one wait: bounded spin, then sleep with backoff, until `ready()`. False on
    deadline or abort (checked once more first, so a late arrival is never lost)."""
    if ready():
        return True
    start = time.perf_counter()
    end_spin, deadline = start + spin_s, start + deadline_s
    nap = 20e-6
    while True:
        if ready():
            return True
        now = time.perf_counter()
        if now >= deadline or (abort is not None and abort()):
            return ready()
        if now >= end_spin:
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)


# The two ends --------------------------------------------------------------------------------
class Phase(enum.Enum):
    """Where the worker is between forwards; the one record, read by the transports."""

    IDLE = "idle"  # no forward: a pull here is a forward without a transaction
    STEP = "step"  # a posted (or announced) step is in flight
    LOCAL = "local"  # dummy / profile / capture forward, satisfied locally


class WorkerEnd:
    """The worker's half: begin a step before the forward, end it after its release."""

    def __init__(self, block: ControlBlock, rank: int, deadlines: PleDeadlines,
                 slot_names: tuple[str, ...]) -> None:
        check_memory_model()
        self.block, self.rank, self.deadlines = block, rank, deadlines
        self.slot_names = slot_names
        self.step = block.posted
        self.rows = 0  # T of the step in flight, as this side posted or announced it
        self.phase = Phase.IDLE

    def fail(self, f: Failure, side: Side = Side.WORKER) -> NoReturn:
        fail_closed(side, f.reason, block=self.block, rank=self.rank, seq=self.step,
                    slot=None if f.slot is None else self.slot_names[f.slot],
                    detail=f.detail)

    def begin(self, ids: np.ndarray, cut: Cut | None = None) -> int:
        """Post step s with these token ids. Raises `PleConfigError` (ids not a 1-D int32
        array) or `PleTokenCountError` before anything is stored.

        The slot stores int32 ids and the offload side reads any id outside the table as
        row 0 (as vLLM does), so the one way to a valid wrong row is a wider id that wraps on
        the store (2**32 + 3 stores 3): the dtype is required, not converted. An O(1) check;
        a range check would cost O(T) of the worker's core on every step, and int32 ids need
        none (gather.py clips them)."""
        if ids.dtype != _IDS_DTYPE or ids.ndim != 1:
            raise PleConfigError(f"a step posts a 1-D int32 array of token ids (the slot's "
                                 f"type), got shape {ids.shape} of {ids.dtype}")
        b = self.block
        self._ready_for_step("begin")
        c = b.counters()
        s = self.step
        if (c.posted != s or c.released != s or c.published.count(s) != len(c.published)
                or b.announced != s):
            self.fail(Failure(Reason.INVARIANT, f"expected all counters at {s}, got "
                              f"{tuple(c)}, announced {b.announced}"))
        t = self._token_count(int(ids.shape[0]))
        b.token_count = t
        if t == 1:
            b.ids[0] = ids[0]
        else:
            b.ids[:t] = ids
        s += 1
        b.set_post_time(time.monotonic_ns())
        if cut is None or not cut(self.rank, s):
            b.announced = s
            b.posted = s  # x86-64 TSO: the stores above are visible before this one
        self.step, self.rows, self.phase = s, t, Phase.STEP
        return s

    def announce(self, t: int) -> int:
        """Step s of `t` tokens, to be posted by the consumer's stream (the stream post).

        The counters are the stream's to check, in stream order: with async scheduling the
        previous step may still be running when this one is announced. Raises
        `PleTokenCountError` before anything is stored.
        """
        b = self.block
        self._ready_for_step("announce")
        s = self.step
        if b.announced != s:
            self.fail(Failure(Reason.INVARIANT, f"announced={b.announced}, this worker "
                              f"announced {s}"))
        t = self._token_count(t)
        s += 1
        b.set_post_time(time.monotonic_ns())  # the hand-off metric counts from the announcement
        b.announced = s
        self.step, self.rows, self.phase = s, t, Phase.STEP
        return s

    def _ready_for_step(self, what: str) -> None:
        """No step in flight on this side, and the pair READY."""
        if self.phase is not Phase.IDLE:
            self.fail(Failure(Reason.ABANDONED, f"{what} in phase {self.phase.value} (step "
                              f"{self.step} started and never released)"))
        if (f := peer_state(self.block)) is not None:
            self.fail(f)

    def _token_count(self, t: int) -> int:
        max_tokens = self.block.layout.max_tokens
        if not 0 <= t <= max_tokens:
            raise PleTokenCountError(
                f"step of {t} tokens exceeds the {max_tokens}-token slots of rank "
                f"{self.rank} (raise max_num_batched_tokens and ple.max_tokens together)")
        return t

    def must_ring(self) -> bool:
        """After `begin` or `announce`: does the offload side sleep on its doorbell?"""
        store_load_fence()  # `announced` visible before `sleeping` is read (Dekker, above)
        return self.block.sleeping

    def end_step(self, step: int) -> None:
        """Called once the consumer's release of `step` has been issued."""
        if self.phase is not Phase.STEP or step != self.step:
            self.fail(Failure(Reason.COUNTER_BACK, f"release of step {step} in phase "
                              f"{self.phase.value}, step {self.step}"))
        self.phase = Phase.IDLE

    def begin_local(self) -> None:
        """A forward that must not reach the offload actor (dummy, profile, capture)."""
        if self.phase is not Phase.IDLE:
            self.abandon(f"local forward in phase {self.phase.value}")
        self.phase = Phase.LOCAL

    def end_local(self) -> None:
        self.phase = Phase.IDLE

    def abandon(self, why: str) -> NoReturn:
        """A prepared forward that will not complete: fatal, never continued."""
        self.fail(Failure(Reason.ABANDONED, why))


class OffloadEnd:
    """The offload actor's half: see each step exactly once, publish its rows slot by slot."""

    def __init__(self, block: ControlBlock, rank: int, deadlines: PleDeadlines,
                 slot_names: tuple[str, ...]) -> None:
        check_memory_model()
        self.block, self.rank, self.deadlines = block, rank, deadlines
        self.slot_names = slot_names
        self.last = block.posted
        self._unreleased = step_deadline(deadlines)

    def fail(self, f: Failure) -> NoReturn:
        fail_closed(Side.OFFLOAD, f.reason, block=self.block, rank=self.rank, seq=self.last,
                    slot=None if f.slot is None else self.slot_names[f.slot],
                    detail=f.detail)

    def watch(self, now_ns: int) -> None:
        """Between steps: the worker alive, the pair not failed, the last step released."""
        b = self.block
        if b.state is State.FAILED:
            self.fail(Failure(Reason.PEER_FAILED, f"worker side failed with reason "
                              f"{Reason(b.reason).name}"))
        if (f := stale_heartbeat(b, Side.WORKER, now_ns, self.deadlines)) is not None:
            self.fail(f)
        if (f := self._unreleased.check(b.released < self.last, self.last, now_ns,
                                        b.token_count)) is not None:
            self.fail(f)

    def await_post(self) -> None:
        """A step is announced but not yet posted (the GPU stream posts it): spin for it,
        never sleep; beyond `step_s` the stream is stuck and the replica ends."""
        b, last = self.block, self.last
        due = [0]

        def stop() -> bool:  # beat and watch every ms while spinning (a dead worker's step
            now = time.monotonic_ns()  # ends on HEARTBEAT, a failed pair on PEER_FAILED)
            if now >= due[0]:
                b.beat(Side.OFFLOAD, now)
                self.watch(now)
                due[0] = now + 1_000_000
            return False

        limit = self.deadlines.step_s
        if not wait_until(lambda: b.posted != last, limit, spin_s=limit, abort=stop):
            self.fail(Failure(Reason.STEP_DEADLINE, f"step {b.announced} announced, not "
                              f"posted within {limit:g}s"))

    def next_step(self) -> int | None:
        """The step to serve now, None if nothing new; fatal on any other counter value."""
        b = self.block
        posted = b.posted
        if posted == self.last:
            return None
        if (f := next_posted(self.last, posted, b.released)) is not None:
            self.fail(f)
        if (f := announced_behind(posted, b.announced)) is not None:
            self.fail(f)
        return posted

    def publish(self, step: int, gather: Callable[[int, np.ndarray, np.ndarray], None],
                cut: Cut | None = None) -> None:
        """Gather and publish every slot of `step`; `gather(slot, ids, out_rows)`."""
        b = self.block
        t = b.token_count
        if not 0 <= t <= b.layout.max_tokens:
            self.fail(Failure(Reason.TOKEN_COUNT, f"step {step} has {t} tokens"))
        ids = b.ids[:t]

        def alive() -> bool:  # beat while waiting: a long wait is OFFLOAD_WAIT, not HEARTBEAT
            b.beat(Side.OFFLOAD, time.monotonic_ns())
            return False

        for i, flag in enumerate(b.flags):
            if int(flag[0]) != 0 and not wait_until(
                    lambda f=flag: int(f[0]) == 0, self.deadlines.offload_wait_s, abort=alive):
                self.fail(Failure(Reason.OFFLOAD_WAIT, f"flag of step {step - 1} never reset",
                                  i))
            gather(i, ids, b.slots[i][:t])
            if cut is None or not cut(i, step):
                b.set_stamp(i, step)
                b.set_published(i, step)
                flag[0] = 1  # x86-64 TSO: rows, stamp, `published` visible before the flag
        b.set_publish_time(time.monotonic_ns())
        self.last = step

    def sleep(self, wait: Callable[[], object]) -> None:
        """Block in `wait` (the doorbell) unless a step was announced: `sleeping` is up
        meanwhile."""
        b = self.block
        b.sleeping = True
        store_load_fence()  # `sleeping` visible before `announced` is read (Dekker, above)
        try:
            if b.announced == self.last:
                wait()
        finally:
            b.sleeping = False
