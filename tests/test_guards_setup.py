"""Guards at setup: the handle against its segment and its header, the geometry's parts, one
worker per pair, the worker's post mode and slot registry, the engine's settings; each with a
test that fails without it (docs/mutation.md).

Every row reaches one check through the real code path, with real parts: a pair segment in
shared memory and the side that breaks the rule in a forked child (`run_side`), the
project's offload actor and worker in spawned processes (`tests.rig`), a broker in a forked
child that serves a real sealed memfd (`tests.test_squatter.squatter`). Each was seen failing
with its check removed (`scripts/mutation_pass.py` applies that to a copy of the tree).
"""

from __future__ import annotations

import time

import pytest

from ray_ple.config import PleDeadlines
from ray_ple.errors import PleHandleError
from ray_ple.protocol.handles import PairHandle
from ray_ple.protocol.layout import State
from ray_ple.protocol.shm import PAGE, SharedSegment
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, start_offload, start_worker, write_checkpoint
from tests.test_transaction_rules import GEOMETRY, Pair


def test_an_engine_started_without_its_handles_says_so():
    """`EngineHandles.from_env`: no `RAY_PLE_PAIRS` is one error that says how the engine
    was started, not a parse error of an empty payload."""
    from ray_ple.protocol.handles import PAIRS_ENV, EngineHandles

    for environ in ({}, {PAIRS_ENV: ""}):
        with pytest.raises(PleHandleError, match=f"{PAIRS_ENV} is not set"):
            EngineHandles.from_env(environ)


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


def _valid_handle(pair: Pair) -> PairHandle:
    """The handle of `pair`'s segment, as a setup makes it, checked valid as made."""
    from ray_ple.protocol.handles import make_pair_handle, validate_pair_handle

    handle = make_pair_handle(rank=0, segment=pair.segment.ref(), node_id="local",
                              actor_name="t", fingerprint="0" * 64, geometry=GEOMETRY,
                              layout=pair.layout)
    assert validate_pair_handle(handle, GEOMETRY, rank=0) == pair.layout
    return handle


def test_a_handle_whose_slot_index_is_not_its_place_is_refused():
    """`validate_pair_handle`: a slot's index is the key of its offsets; one that is not the
    slot's place is one `PleHandleError` naming it."""
    from ray_ple.protocol.handles import validate_pair_handle

    pair = Pair()
    try:
        handle = _valid_handle(pair)
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


# The handle against the segment: size, and the header the segment carries ------------------
def test_a_handle_whose_segment_size_is_not_the_layouts_is_refused():
    """`validate_pair_handle`: a handle that names a segment of another size than its own
    layout needs would map views past the segment's end (or rows of another layout); one
    `PleHandleError` before anything is mapped."""
    from ray_ple.protocol.handles import validate_pair_handle

    pair = Pair()
    try:
        handle = _valid_handle(pair)
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
