"""Checks that guard a token, each with a test that fails without it (docs/mutation.md).

Every row reaches one check through the real code path, with real parts: a pair segment in
shared memory and the side that breaks the rule in a forked child (`run_side`), the
project's offload actor and worker in spawned processes (`tests.rig`), a broker in a forked
child that serves a real sealed memfd (`tests.test_squatter.squatter`). Each was seen failing
with its check removed (`scripts/mutation_pass.py` applies that to a copy of the tree).
"""

from __future__ import annotations

import fcntl
import os
import platform
import time

import numpy as np
import pytest

from ray_ple.config import PleDeadlines
from ray_ple.errors import PleEnvironmentError, PleHandleError, PleModelError, PleShmError
from ray_ple.offload.table_store import _HDR, _MAGIC, acquire_table
from ray_ple.protocol.fatal import Reason
from ray_ple.protocol.handles import PairHandle
from ray_ple.protocol.layout import MAX_SLOTS, ControlBlock, PairLayout, State
from ray_ple.protocol.shm import PAGE, SEALS, SharedSegment
from ray_ple.protocol.table_source import TableSource
from ray_ple.protocol.transaction import OffloadEnd, invariant_violation, went_back
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, start_offload, start_worker, write_checkpoint
from tests.test_squatter import NOBODY, _held_memfds, _mapped_memfds, _names, _serve, squatter
from tests.test_transaction_rules import GEOMETRY, Pair, run_side

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="needs root to own a file as uid 65534")


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
    end = OffloadEnd(b, 0, PleDeadlines(offload_wait_s=10.0), GEOMETRY.layer_names)
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
        assert (f.reason, f.layer) == (Reason.INVARIANT, 0)
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


def test_an_engine_started_without_its_handles_says_so():
    """`EngineHandles.from_env`: no `RAY_PLE_PAIRS` is one error that says how the engine
    was started, not a parse error of an empty payload."""
    from ray_ple.protocol.handles import PAIRS_ENV, EngineHandles

    for environ in ({}, {PAIRS_ENV: ""}):
        with pytest.raises(PleHandleError, match=f"{PAIRS_ENV} is not set"):
            EngineHandles.from_env(environ)


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


# A pair takes one worker: attach only from INIT ---------------------------------------------
def test_a_second_worker_cannot_attach_to_a_pair_in_use(tmp_path):
    """A pair a live worker made READY refuses another worker's attach (a restarted or
    duplicated process): two posters on one segment would break every counter rule."""
    from ray_ple.worker.pair import WorkerPair

    table = write_checkpoint(tmp_path / "ckpt", rows=64, layers=2, ple_dim=8)
    spec = spec_for(tmp_path / "ckpt", max_tokens=8)
    off, handle, off_conn = start_offload(spec)
    wproc, wconn = start_worker(handle, spec.geometry, [[1, 2]], table, tmp_path, pause_at=0)
    try:
        while not wconn.poll(0.2):  # (a worker that died never answers)
            assert wproc.is_alive() and off.is_alive(), "the first worker did not attach"
        assert wconn.recv() == ("paused", 0), "the first worker attached"
        with pytest.raises(PleHandleError, match="is READY, not INIT"):
            second = WorkerPair.attach(PairHandle.model_validate(handle), spec.geometry, rank=0,
                                       transport="cpu", deadlines=PleDeadlines(step_s=10.0),
                                       heartbeat_s=0.05)
            second.close()
        wconn.send("go")  # the first worker still owns the pair and serves its step
        assert wconn.recv() == ("done", 0)
    finally:
        wconn.send("stop")
        off_conn.send("stop")
        wproc.join(10)
        off.join(10)
        for proc in (wproc, off):
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert ple_shm_entries() == []


# The node table: what a broker of our own user serves is still checked ----------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory) -> TableSource:
    path = tmp_path_factory.mktemp("guards") / "ckpt"
    write_checkpoint(path, rows=512, layers=4, ple_dim=8)
    return spec_for(path, max_tokens=8).sources[0]


def _table_fd(source: TableSource, fp: str, size: int, header: dict[str, object],
              owner: int | None = None) -> int:
    """A sealed memfd of the node table's size, header from `header` (the right one where a
    field is not given; `mode` its file mode, 0600 if not), owned by `owner` (this user
    where None)."""
    mode = header.pop("mode", 0o600)
    fields = {"magic": _MAGIC, "version": 1, "ready": 1, "rows": source.layer.rows,
              "row_bytes": source.layer.row_bytes, "fingerprint": bytes.fromhex(fp)} | header
    fd = os.memfd_create("ray-ple-table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, mode)
    os.posix_fallocate(fd, 0, size)
    page = bytearray(PAGE)
    _HDR.pack_into(page, 0, *fields.values())
    os.pwrite(fd, bytes(page), 0)
    if owner is not None:
        os.fchown(fd, owner, owner)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _refused(source: TableSource, header: dict[str, object], owner: int | None,
             error: type[Exception], match: str) -> None:
    """A broker of this user serves that fd under the right name and meta: refused, unmapped."""
    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, _table_fd(source, fp, size, header, owner), fp, size)

    with squatter(body, uid=None):
        with pytest.raises(error, match=match):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
            table.close()
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is kept"


@ROOT_ONLY
def test_a_served_table_fd_owned_by_another_uid_is_refused(source):
    """`check_sealed`: the broker is of our user, the fd it hands over is not (a file another
    user made, passed on): sealed, 0600, the right size and header, and still refused."""
    _refused(source, {}, NOBODY, PleEnvironmentError, f"belongs to uid {NOBODY}")


def test_a_served_table_fd_readable_by_others_is_refused(source):
    """`check_sealed`: a table fd of our user whose mode lets others in (0644) is not the
    private segment a holder makes (0600), whatever else is right about it."""
    _refused(source, {"mode": 0o644}, None, PleShmError, "not a private shared-memory file")


def test_a_handle_whose_slot_index_is_not_its_place_is_refused():
    """`validate_pair_handle`: a slot's index is the key of every offset checked after it;
    one that is not the slot's place is one `PleHandleError` naming it."""
    from ray_ple.protocol.handles import make_pair_handle, validate_pair_handle

    pair = Pair()
    try:
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        assert validate_pair_handle(handle, GEOMETRY, rank=0) == pair.layout
        moved = handle.model_copy(update={"slots": (
            handle.slots[0].model_copy(update={"index": 1}),)})
        with pytest.raises(PleHandleError, match="has index 1"):
            validate_pair_handle(moved, GEOMETRY, rank=0)
    finally:
        pair.close()


def test_a_segment_whose_size_is_not_the_handles_is_refused():
    """`open_segment`: the fd behind a handle must be the segment it names, inode and size
    both (a reused fd number or a segment resized since), before anything is mapped."""
    seg = SharedSegment.create("pair", 2 * PAGE)
    try:
        ref = seg.ref()
        for field, value in (("size", ref.size + PAGE), ("inode", ref.inode + 1)):
            with pytest.raises(PleHandleError, match="handle says"):
                SharedSegment.attach(ref.model_copy(update={field: value}))
        SharedSegment.attach(ref).close()
    finally:
        seg.close()


@pytest.mark.parametrize("field,value", [
    ("magic", _MAGIC ^ 1), ("ready", 0), ("rows", 511), ("row_bytes", 32),
    ("fingerprint", bytes(32))])
def test_a_served_table_whose_header_differs_is_refused(source, field, value):
    """`acquire_table`: a sealed table of the right size from our own user whose header says
    another table (or one not fully loaded) is never mapped as this one."""
    _refused(source, {field: value}, None, PleModelError, "served by a peer does not match")
