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
from ray_ple.offload.table_segment import SEALS, TableSegment
from ray_ple.offload.table_store import _HDR, _MAGIC, acquire_table
from ray_ple.protocol.fatal import Reason
from ray_ple.protocol.handles import PairHandle
from ray_ple.protocol.layout import MAX_SLOTS, ControlBlock, PairLayout, State
from ray_ple.protocol.shm import PAGE, SharedSegment
from ray_ple.protocol.transaction import OffloadEnd, invariant_violation, went_back
from ray_ple.table_source import TableSource
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
    fields = {"magic": _MAGIC, "version": 1, "ready": 1, "rows": source.table.rows,
              "row_bytes": source.table.row_bytes, "fingerprint": bytes.fromhex(fp)} | header
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
    """`validate_pair_handle`: a slot's index is the key of its offsets; one that is not the
    slot's place is one `PleHandleError` naming it."""
    from ray_ple.protocol.handles import make_pair_handle, validate_pair_handle

    pair = Pair()
    try:
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        assert validate_pair_handle(handle, GEOMETRY, rank=0) == pair.layout
        moved = handle.model_copy(update={"slots": (
            handle.slots[0].model_copy(update={"index": 1}),)})
        with pytest.raises(PleHandleError, match=r"\.index = 1, expected 0"):
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


# The handle against the segment: size, and the header the segment carries ------------------
def test_a_handle_whose_segment_size_is_not_the_layouts_is_refused():
    """`validate_pair_handle`: a handle that names a segment of another size than its own
    layout needs would map views past the segment's end (or rows of another layout); one
    `PleHandleError` before anything is mapped."""
    from ray_ple.protocol.handles import make_pair_handle, validate_pair_handle

    pair = Pair()
    try:
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        assert validate_pair_handle(handle, GEOMETRY, rank=0) == pair.layout
        for size in (pair.layout.size - PAGE, pair.layout.size + PAGE):
            other = handle.model_copy(update={
                "segment": handle.segment.model_copy(update={"size": size})})
            with pytest.raises(PleHandleError, match="segment size"):
                validate_pair_handle(other, GEOMETRY, rank=0)
    finally:
        pair.close()


@pytest.mark.parametrize("field", ["magic", "version", "slots", "max_tokens"])
def test_a_segment_whose_header_is_not_the_handles_is_refused(field):
    """`validate_segment_header`: the header the mapped segment carries (written by the side
    that made it) must be a pair's and say the handle's layout version, slot count and token
    bound: a reused fd or a stale handle is one `PleHandleError`, whatever else matches."""
    from ray_ple.protocol.handles import make_pair_handle, validate_segment_header
    from ray_ple.protocol.layout import _HDR as PAIR_HDR

    pair = Pair()
    try:
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        validate_segment_header(pair.block.read_header(), handle)  # as written: accepted
        magic, version, slots, max_tokens, token, fp = PAIR_HDR.unpack_from(pair.segment.map, 0)
        fields = {"magic": magic, "version": version, "slots": slots, "max_tokens": max_tokens}
        fields[field] += 1
        pair.segment.map[:PAIR_HDR.size] = PAIR_HDR.pack(*fields.values(), token, fp)
        with pytest.raises(PleHandleError, match="not a ray-ple pair" if field == "magic"
                           else "differs from the handle"):
            validate_segment_header(pair.block.read_header(), handle)
    finally:
        pair.close()


# The geometry: a split of the row into parts ----------------------------------------------
@pytest.mark.parametrize("parts", [(), (0, 8), (-1, 9), (3, 4)],
                         ids=["none", "an_empty_part", "a_negative_part", "short"])
def test_parts_that_do_not_split_the_row_are_one_config_error(parts):
    """`split_layers`: given parts must be at least one, each of at least one layer, adding
    up to the row's layers; an empty or negative part would make a slot of no rows (or a
    gate that never opens), so it is a `PleConfigError`, not an `IndexError` later."""
    from ray_ple.errors import PleConfigError
    from ray_ple.protocol.geometry import split_layers

    assert split_layers(8, (1, 7)) == (1, 7)
    with pytest.raises(PleConfigError, match="parts of >= 1 layer"):
        split_layers(8, parts)


@pytest.mark.parametrize("change,match", [
    ({"row_layers": 2, "resident_layers": 2}, "leave none of 2 to offload"),
    ({"row_layers": 4, "parts": (1, 2)}, "do not split 4 layers"),
    ({"row_layers": 4, "parts": (0, 4)}, "do not split 4 layers"),
    ({"row_layers": 4, "parts": (5, -1)}, "do not split 4 layers"),
    ({"row_layers": 3}, "values per row are not 3 layers"),
], ids=["all_resident", "short", "an_empty_part", "a_negative_part", "uneven_row"])
def test_a_geometry_that_does_not_cover_the_row_is_refused(change, match):
    """`PleGeometry`: a geometry read back from elsewhere (a handle, another process) is
    validated again: every offloaded layer in exactly one part of >= 1 layer, at least one
    layer offloaded, a row that splits into whole layers. Else a slot would hold columns of
    no layer, or a layer's columns would straddle two slots."""
    from pydantic import ValidationError

    from ray_ple.protocol.geometry import PleGeometry

    base = GEOMETRY.model_dump()
    PleGeometry.model_validate(base | {"row_layers": 4, "resident_layers": 1,
                                       "parts": (1, 2)})  # a valid split: accepted
    with pytest.raises(ValidationError, match=match):
        PleGeometry.model_validate(base | change)


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


def test_a_checkpoint_of_an_unsupported_dtype_is_one_model_error(tmp_path):
    """`_engine_dtype`: a table dtype the transport cannot copy (int8 here) is one
    `PleModelError` naming it, before any geometry or segment is made from it."""
    import json

    from ray_ple.protocol.geometry import geometry_from_config, read_hf_config

    cfg = {"architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 2,
           "hidden_size_per_layer_input": 8, "vocab_size": 64, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert geometry_from_config(read_hf_config(tmp_path), max_tokens=8).tables[0].dtype \
        == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "int8"}))
    with pytest.raises(PleModelError, match="unsupported dtype 'int8'"):
        geometry_from_config(read_hf_config(tmp_path), max_tokens=8)


# Shared memory: what a handed-over fd must be, and how a segment is made and sealed ---------
def _memfd(size: int, sealed: bool) -> int:
    fd = os.memfd_create("ray-ple-guard", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o600)
    os.posix_fallocate(fd, 0, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def test_a_handed_over_fd_is_refused_unless_a_sealed_private_file_of_the_size():
    """`check_sealed`: what a peer hands over must be a regular private file (not a pipe,
    whose mode is 0600 too), of exactly the size this side computed, sealed against writes
    and resizes; each is its own `PleShmError`, and the right one passes."""
    from ray_ple.offload.table_segment import check_sealed

    good = _memfd(PAGE, sealed=True)
    r, w = os.pipe()
    big, loose = _memfd(2 * PAGE, sealed=True), _memfd(PAGE, sealed=False)
    try:
        check_sealed(good, PAGE, "table")
        with pytest.raises(PleShmError, match="not a private shared-memory file"):
            check_sealed(r, PAGE, "table")
        with pytest.raises(PleShmError, match=f"holds {2 * PAGE} bytes"):
            check_sealed(big, PAGE, "table")
        with pytest.raises(PleShmError, match="not sealed against writes"):
            check_sealed(loose, PAGE, "table")
    finally:
        for fd in (good, r, w, big, loose):
            os.close(fd)


def test_a_segment_in_a_missing_directory_is_one_shm_error(tmp_path):
    """`SharedSegment.create`: a shared-memory directory that is not there (a pod without
    /dev/shm mounted) is one `PleShmError` naming it, not a bare `FileNotFoundError`."""
    with pytest.raises(PleShmError, match="does not exist"):
        SharedSegment.create("pair", PAGE, str(tmp_path / "nope"))


def test_sealing_waits_out_a_transient_pin_then_gives_up(monkeypatch):
    """`TableSegment.seal`: the kernel refuses the write seal (EBUSY) while a writable
    mapping of the file exists; a pin that goes within `SEAL_WAIT_S` is waited out, one
    that stays is one `PleShmError` at the deadline (not a wait forever), and an fd that
    cannot be sealed at all fails at once."""
    import mmap
    import threading

    from ray_ple.offload import table_segment

    monkeypatch.setattr(table_segment, "SEAL_WAIT_S", 1.0)
    seg = TableSegment.create("guard", PAGE)
    pin = mmap.mmap(seg.fd, PAGE)  # a second writable mapping: EBUSY until it goes
    timer = threading.Timer(0.3, pin.close)
    timer.start()
    try:
        seg.seal()
        assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    finally:
        timer.join()
        seg.close()
    seg = TableSegment.create("guard", PAGE)
    pin = mmap.mmap(seg.fd, PAGE)
    try:
        t0 = time.monotonic()
        with pytest.raises(PleShmError, match="cannot seal"):
            seg.seal()
        assert 0.9 < time.monotonic() - t0 < 3
    finally:
        pin.close()
        seg.close()
    tmpfs = SharedSegment.create("guard", PAGE)  # a tmpfs file, no seals at all
    seg = TableSegment(os.dup(tmpfs.fd), tmpfs.size, tmpfs.token, owner=False)
    tmpfs.close()
    try:
        t0 = time.monotonic()
        with pytest.raises(PleShmError, match="cannot seal"):
            seg.seal()
        assert time.monotonic() - t0 < 0.5
    finally:
        seg.close()


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


def test_a_huge_segment_on_a_host_without_hugetlb_is_one_shm_error(monkeypatch):
    """`TableSegment._create_huge`: a host with no huge page size (or a Python without
    `MFD_HUGETLB`) is one `PleShmError` saying so, not a division by a zero page size or
    a missing attribute."""
    from ray_ple.offload import table_segment

    monkeypatch.setattr(table_segment, "huge_page_size", lambda: 0)
    with pytest.raises(PleShmError, match="no hugetlb pages"):
        TableSegment.create("table", PAGE, huge=True)
    monkeypatch.setattr(table_segment, "huge_page_size", lambda: 2 << 20)
    monkeypatch.delattr(os, "MFD_HUGETLB", raising=False)
    with pytest.raises(PleShmError, match="no hugetlb pages"):
        TableSegment.create("table", PAGE, huge=True)


def test_a_segment_where_o_tmpfile_is_unsupported_falls_back_to_a_name_unlinked_at_once(
        monkeypatch):
    """`_open_nameless`: a kernel or filesystem without `O_TMPFILE` (EOPNOTSUPP) still gets
    its segment, through a 0600 file whose name is unlinked right after the open; any other
    error is the caller's."""
    import errno
    import stat

    real_open = os.open

    def no_tmpfile(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202 - os.open's
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported here")
        return real_open(path, flags, *args, **kwargs)

    before = set(ple_shm_entries())
    monkeypatch.setattr(os, "open", no_tmpfile)
    seg = SharedSegment.create("pair", PAGE)
    try:
        st = os.fstat(seg.fd)
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600 and st.st_nlink == 0
        assert set(ple_shm_entries()) == before, "no name is left behind"
    finally:
        seg.close()


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


def test_a_checkpoint_whose_table_is_not_the_configs_shape_is_refused(tmp_path):
    """`check_shape`: a PLE tensor of another shape than the model config implies (here one
    row more than `vocab_size_per_layer_input`) is one `PleModelError`: rows read at the
    config's stride from it would be other tokens' rows."""
    import json

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rows=64, layers=2, ple_dim=8)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"vocab_size_per_layer_input": 63}))
    source = spec_for(ckpt, max_tokens=8).sources[0]
    table = None
    try:
        with pytest.raises(PleModelError, match=r"has shape \[64, 16\], the model config says"):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
    finally:
        if table is not None:
            table.close()


def test_huge_pages_are_not_asked_for_where_python_cannot_ask(monkeypatch):
    """`want_huge_pages`: a Python or platform without `mmap.MADV_HUGEPAGE` gets False (the
    table is served on small pages), not an `AttributeError` that ends the load."""
    import mmap

    from ray_ple.offload.table_store import want_huge_pages

    seg = TableSegment.create("table", PAGE)
    try:
        assert want_huge_pages(seg) in (True, False)
        monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
        assert want_huge_pages(seg) is False
    finally:
        seg.close()


def test_a_checkpoint_cut_short_inside_its_table_is_refused(tmp_path):
    """A safetensors file that ends inside the PLE tensor (a copy cut short) is one
    `PleModelError` naming it, never a table whose last rows are zeros (or a load that spins
    on a read of nothing): refused by its header check before anything is made, and by
    `load_rows` when it is cut after its header was read."""
    from ray_ple.offload.table_file import TableFile
    from tests.test_table_store import _load_into_segment

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rows=64, layers=2, ple_dim=8)
    (path,) = ckpt.glob("*.safetensors")
    source = spec_for(ckpt, max_tokens=8).sources[0]
    with TableFile.open(source) as table:  # header read whole; cut before the rows are read
        os.truncate(path, path.stat().st_size - 100)
        with pytest.raises(PleModelError, match="ends inside"):
            _load_into_segment(table, source)
    with pytest.raises(PleModelError, match="the file is truncated"):
        acquire_table(source, shm_dir="/dev/shm", deadline_s=30)


def test_a_broker_that_sends_no_fd_is_waited_out_not_a_crash(source):
    """`receive_table`: a broker of our own user whose answer carries no fd (a holder going away,
    or one that is not a holder) is "not served yet": the wait goes on to its deadline's one
    error, never an `IndexError`."""
    import json
    import socket

    from tests.test_squatter import yield_ready

    fp, name, size = _names(source)

    def body() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(name)
        sock.listen(8)
        yield_ready()
        while True:
            conn, _ = sock.accept()
            conn.sendall(json.dumps({"fingerprint": fp, "size": size}).encode())
            conn.close()

    with squatter(body, uid=None):
        with pytest.raises(PleModelError, match="not available within"):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=1)
            table.close()
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is kept"


@ROOT_ONLY
def test_the_table_broker_hands_its_fd_to_no_other_uid(tmp_path):
    """`NodeTable._serve`: anyone can connect to the broker's abstract name; a client of
    another uid is let go without the table's fd (it would map our rows read-only)."""
    import socket

    from ray_ple.offload.table_broker import broker_name

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rows=64, layers=2, ple_dim=8)
    table = acquire_table(spec_for(ckpt, max_tokens=8).sources[0], shm_dir="/dev/shm",
                          deadline_s=30)
    try:
        name = broker_name(table.fingerprint)
        pid = os.fork()
        if pid == 0:  # the other user: how many fds did the broker hand over?
            code = 9
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5)
                sock.connect(name)
                _, fds, _, _ = socket.recv_fds(sock, 4096, 1)
                code = len(fds)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the fd went to uid 65534"
    finally:
        table.close()


# The worker's pair: its post mode, its registry; the engine's settings ---------------------
def test_a_pair_refuses_a_post_mode_its_transport_cannot_take():
    """`WorkerPair`: `ple.post` is 'host', or 'stream' with a transport whose consumer is a
    stream (cuda); anything else is one `PleConfigError` before a transport is made."""
    from ray_ple.errors import PleConfigError
    from ray_ple.protocol.handles import make_pair_handle
    from ray_ple.worker.pair import WorkerPair
    from tests.test_transaction_rules import FAST

    pair = Pair()
    try:
        handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                                  actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                                  layout=pair.layout)
        WorkerPair(handle, pair.segment, pair.block, "cpu", FAST, 0.1, post="host").close()
        for post, transport in (("bogus", "cpu"), ("stream", "cpu")):
            with pytest.raises(PleConfigError, match="ple.post"):
                WorkerPair(handle, pair.segment, pair.block, transport, FAST, 0.1, post=post)
        try:  # stream posting with cuda passes the check (here it may fail for want of a GPU)
            WorkerPair(handle, pair.segment, pair.block, "cuda", FAST, 0.1,
                       post="stream").close()
        except Exception as exc:  # noqa: BLE001 - any error but the post check's
            assert "ple.post" not in str(exc), exc
    finally:
        pair.close()


def test_a_pull_for_a_slot_no_pair_of_this_process_serves_is_refused(monkeypatch):
    """`pair_of_slot`: the ops look a slot up by name; no live pair, or a name it does not
    serve, is one `PleHandleError` (never a pull through a pair of None or slot None)."""
    from ray_ple.worker import pair as registry

    monkeypatch.setattr(registry, "_PAIR", None)
    monkeypatch.setattr(registry, "_SLOTS", {"served": 0})
    for name in ("served", "other"):  # no pair at all: neither is served
        with pytest.raises(PleHandleError, match="serves slot"):
            registry.pair_of_slot(name)
    monkeypatch.setattr(registry, "_PAIR", object())  # a pair, but not of that slot
    with pytest.raises(PleHandleError, match="serves slot 'other'"):
        registry.pair_of_slot("other")
    assert registry.pair_of_slot("served")[1] == 0


def test_an_engine_without_ray_ples_settings_is_one_config_error():
    """`PleEngineSettings.from_additional_config`: an engine started without the builder's
    `additional_config` entry is told to start through the builder, not a validation error
    of None."""
    from ray_ple.engine_settings import PleEngineSettings
    from ray_ple.errors import PleConfigError

    for additional in (None, {}, {"other": 1}):
        with pytest.raises(PleConfigError, match="start it through ray_ple's builder"):
            PleEngineSettings.from_additional_config(additional)


def test_a_broker_that_says_it_serves_another_table_is_refused(source):
    """`receive_table`: the broker's answer names the table it serves; one that names another
    fingerprint than the one asked for is refused before its fd is checked or mapped,
    whatever that fd holds."""
    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, _table_fd(source, fp, size, {}), "f" * 64, size)

    with squatter(body, uid=None):
        with pytest.raises(PleModelError, match="the broker serves table f{12}"):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
            table.close()
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is kept"


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


@ROOT_ONLY
def test_a_name_held_by_a_visible_other_uid_is_refused_after_one_refusal_window(source):
    """`_acquire`: a broker name bound, not served, by a process of another uid that this
    user can see is refused once `_REFUSED_S` of refusals has passed; only an invisible
    holder (uid unknown) waits the longer window."""
    from ray_ple.offload.table_store import _REFUSED_S

    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, -1, fp, size, listen=False)

    with squatter(body) as pid:
        t0 = time.monotonic()
        with pytest.raises(PleEnvironmentError, match=f"pid {pid} of uid {NOBODY}"):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
        assert time.monotonic() - t0 < 3.8 * _REFUSED_S, "refused after one window, not four"


def test_a_name_held_by_our_own_user_without_serving_is_waited_for(source):
    """`_acquire`: a broker name bound, not yet served, by a process of our own user is a
    holder still starting (or one that died bound): it is waited for up to the deadline,
    never refused as another user's."""
    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, -1, fp, size, listen=False)

    with squatter(body, uid=None):
        with pytest.raises(PleModelError, match="not available within 2"):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=2)


def test_a_process_attaches_one_pair_once_and_only_its_own(monkeypatch):
    """`attach_process`: the engine's handles must hold this worker's rank; a second call
    for the same rank and slots returns the pair already attached (a second attach would
    find it READY), and a call for another rank or other slots is refused."""
    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.handles import EngineHandles, make_pair_handle
    from ray_ple.protocol.layout import Side
    from ray_ple.worker import pair as registry

    pair = Pair()
    pair.block.set_state(State.INIT)
    handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                              actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                              layout=pair.layout)
    monkeypatch.setattr(registry, "_PAIR", None)
    monkeypatch.setattr(registry, "_SLOTS", {})
    for key, value in EngineHandles(pairs=(handle,)).env().items():
        monkeypatch.setenv(key, value)
    slow = PleDeadlines(step_s=5, offload_wait_s=5, heartbeat_s=5, startup_s=5)
    kw = {"transport": "cpu", "deadlines": slow, "heartbeat_s": 0.02}
    dump = GEOMETRY.model_dump()
    layer = dump["tables"][0]
    layer[next(k for k in layer if k.endswith("name"))] = "model.other_table"
    other = type(GEOMETRY).model_validate(dump)
    attached = None
    try:
        with pytest.raises(PleHandleError, match="no pair handle for worker rank 1"):
            registry.attach_process(GEOMETRY, rank=1, **kw)
        pair.block.beat(Side.OFFLOAD, time.monotonic_ns())
        attached = registry.attach_process(GEOMETRY, rank=0, **kw)
        assert registry.attach_process(GEOMETRY, rank=0, **kw) is attached
        for geometry, rank in ((GEOMETRY, 1), (other, 0)):
            with pytest.raises(PleHandleError, match="already attached to another pair"):
                registry.attach_process(geometry, rank=rank, **kw)
    finally:
        if attached is not None:
            attached.close()
        pair.close()
