"""The CUDA transport on a real GPU, driven by the rig's engine loop (`cuda_rig.py`).

Runs wherever CUDA is present (`scripts/gpu_device_run.sh` runs it on the lent H200 and keeps
the output under `bench/cuda/results/`); elsewhere every CUDA test is skipped with the reason.
The writer is always the project's offload actor in a separate CPU-only process.
The two rig tests at the end run everywhere (CPU transport), so the rig itself stays honest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_rig as rig

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here); "
    "scripts/gpu_device_run.sh runs this module on the GPU machine")
ROWS, MAX_TOKENS = 4096, 256
RIG = Path(__file__).with_name("cuda_rig.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ple") / "ckpt"
    rig.write_pattern_checkpoint(d, ROWS)
    return d


@pytest.fixture(scope="module")
def gpu(ckpt: Path) -> Iterator[tuple[rig.OffloadProcess, object]]:
    """One offload process and this process's one CUDA pair, shared by the CUDA tests."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    import ray_ple.worker.ops  # noqa: F401 - registers ray_ple::pull

    geo = rig.geometry(ROWS, MAX_TOKENS)
    off = rig.OffloadProcess(ckpt, geo, spin_us=2000)
    try:
        yield off, rig.attach(off.handle, geo, "cuda")
    finally:
        off.close()


def _engine(pair, t: int, seed: int = 1) -> rig.Engine:
    return rig.Engine(pair, rig.StandIn(ROWS).cuda(), t, ROWS, torch.device("cuda"), seed)


@needs_cuda
def test_setup_registers_the_pair_segment_and_checks_the_device(gpu) -> None:
    _, pair = gpu
    t = pair.transport
    assert t.name == "cuda"
    assert t.registration.size == pair.block.segment.size
    assert t.caps.can_map_host_memory and t.caps.stream_mem_ops and t.caps.unified_addressing
    assert t.registration.device_ptr != 0


@needs_cuda
@pytest.mark.parametrize("t", [1, 7, 64, 256])
def test_eager_closed_loop_rows_verified(gpu, t: int) -> None:
    _, pair = gpu
    before = pair.block.posted
    engine = _engine(pair, t, seed=t)
    assert engine.eager(500) == 0
    assert pair.block.counters() == (before + 500, (before + 500,), before + 500)


@needs_cuda
@pytest.mark.parametrize("copy_mode", ["sm", "dma"])
@pytest.mark.parametrize("t", [8, 256])
def test_graph_closed_loop_rows_verified(gpu, t: int, copy_mode: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, pair = gpu
    monkeypatch.setattr(pair.transport, "options",
                        pair.transport.options.model_copy(update={"copy_mode": copy_mode}))
    before = pair.block.posted
    graph = _engine(pair, t, seed=100 + t).capture()
    assert pair.block.posted == before, "a capture must not post"
    rec = graph.record
    assert rec.rows == t and not rec.release
    assert [(c.rows, c.nbytes, c.mode) for c in rec.copies] == [(t, t * 17920, copy_mode)]
    assert graph.run(2000) == 0
    assert pair.block.counters() == (before + 2000, (before + 2000,), before + 2000)


@needs_cuda
def test_whole_step_graph_carries_the_release(gpu) -> None:
    _, pair = gpu
    before = pair.block.posted
    graph = _engine(pair, 16, seed=7).capture(release_in_graph=True)
    assert graph.record.release
    assert graph.run(2000) == 0
    assert pair.block.counters() == (before + 2000, (before + 2000,), before + 2000)


@needs_cuda
def test_released_is_advanced_by_the_stream_itself(gpu) -> None:
    _, pair = gpu
    engine = _engine(pair, 4, seed=3)
    s0 = pair.block.posted
    host = engine.ids.cpu().numpy()
    with pair.step(host):
        torch.cuda._sleep(200_000_000)  # keep the stream busy for ~0.1 s before the forward
        engine.model(engine.ids)
    assert pair.block.released == s0, "the host must not have advanced released"
    torch.cuda.synchronize()
    assert pair.block.released == s0 + 1 and pair.block.flags[0][0] == 0


@needs_cuda
def test_local_forwards_move_no_word(gpu) -> None:
    _, pair = gpu
    before = pair.block.counters()
    engine = _engine(pair, 32, seed=9)
    with pair.local_forward():
        bad, _, _ = engine.model(engine.ids)  # eager dummy run: zero rows, nothing posted
    torch.cuda.synchronize()
    zero_words = int((engine.ids == 0).sum())  # row 0, word 0 is the only zero of the table
    assert int(bad) == 32 * 8960 // 2 - zero_words
    engine.capture()
    torch.cuda.synchronize()
    assert pair.block.counters() == before and pair.block.flags[0][0] == 0


@needs_cuda
def test_offload_process_holds_no_cuda_context(gpu) -> None:
    off, _ = gpu
    st = off.status()
    assert st["cuda_evidence"] == [] and not st["torch_imported"]
    assert st["cuda_libraries_mapped"] == []
    mine = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert any(p.startswith("/dev/nvidia") for p in mine), "control: this process has a context"
    if shutil.which("nvidia-smi"):
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30,
                              check=False).stdout.split()
        assert str(off.pid) not in apps


@pytest.mark.parametrize("parts", ["", "7,7,7,7,7"], ids=["pull", "late-parts"])
def test_compiled_artifact_runs_in_a_new_process(ckpt: Path, tmp_path: Path, parts: str) -> None:
    """An Inductor artefact of the pull (one op) or of the late pull (each part's
    `pull_async` and `pull_wait`) saved by one process runs in a new one, on a new segment
    at other addresses: its ops carry slot names, never an address. On the GPU its steps
    also run as a captured graph; without one, on the CPU transport, eagerly."""
    (tmp_path / "ckpt").symlink_to(ckpt)
    results = {}
    for role in ("save", "load"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{role}")}
        proc = subprocess.run([sys.executable, str(RIG), f"compile-{role}", str(tmp_path),
                               "--steps", "1000", "--parts", parts], capture_output=True,
                              text=True, env=env, check=False, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[role] = json.loads(proc.stdout.strip().splitlines()[-1])
    save, load = results["save"], results["load"]
    assert save["ops_in_graph"] == (2 * len(parts.split(",")) if parts else 1)
    graphs = torch.cuda.is_available()  # then 1,000 graph steps follow the eager ones
    for r in (save, load):
        assert r["eager_wrong_words"] == 0 and r["steps"] == (2000 if graphs else 1000)
        assert r.get("graph_wrong_words", 0) == 0 and ("graph_wrong_words" in r) == graphs
        assert r["addresses_in_artifact"] == [], "a live address was baked into the artefact"
    assert load["pid"] != save["pid"] and load["addresses_equal_to_saver"] == []


@needs_cuda
def test_graph_replayed_for_another_token_count_is_fatal(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpt").symlink_to(ckpt)
    proc = subprocess.run([sys.executable, str(RIG), "geometry-mismatch", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 86, proc.stdout + proc.stderr[-3000:]
    verdicts = [json.loads(line) for line in proc.stderr.splitlines()
                if '"verdict"' in line and line.startswith("{")]
    assert verdicts and verdicts[0]["reason"] == "GEOMETRY" and verdicts[0]["where"] == "consumer"


# the stream post: the GPU posts the step from the model's own ids -------------------------
@needs_cuda
@pytest.mark.parametrize("t", [1, 64, 256])
def test_stream_post_closed_loop_rows_verified(gpu, t: int) -> None:
    """Eager and graph steps posted by the stream, with the host waiting for each step and
    running ahead (vLLM's async scheduling), between host-posted steps on the same pair."""
    _, pair = gpu
    before = pair.block.posted
    host = _engine(pair, t, seed=400 + t)
    stream = rig.Engine(pair, rig.StandIn(ROWS).cuda(), t, ROWS, torch.device("cuda"),
                        seed=500 + t, stream=True)
    assert stream.eager(200) == 0
    assert host.eager(50) == 0
    graph = stream.capture()
    assert pair.block.posted == before + 250, "a capture must not post"
    assert graph.run(500) == 0
    assert graph.run(1000, wait=False) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 1750, before + 1750,
                                                        {before + 1750})
    assert pair.block.announced == before + 1750 and pair.block.token_count == t


@needs_cuda
def test_stream_post_late_pull_host_ahead(late) -> None:
    _, pair, geo = late
    before = pair.block.posted
    with rig.registered(pair):
        engine = rig.Engine(pair, rig.LateStandIn(ROWS, geo).cuda(), 64, ROWS,
                            torch.device("cuda"), seed=600, stream=True)
        assert engine.eager(100) == 0
        graph = engine.capture()
    assert graph.run(1000, wait=False) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 1100, before + 1100,
                                                        {before + 1100})


@needs_cuda
def test_a_step_posted_twice_by_the_stream_fails_closed_on_the_gpu(ckpt: Path,
                                                                   tmp_path: Path) -> None:
    """`ple_post` checks the counters in stream order: a second post of one step traps after
    writing STREAM_POST and FAILED; the offload side ends itself naming it, the worker's
    next CUDA call raises and it fails closed (exit 86)."""
    (tmp_path / "ckpt").symlink_to(ckpt)
    proc = subprocess.run([sys.executable, str(RIG), "stream-post-twice", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    verdicts = [json.loads(line) for line in proc.stderr.splitlines()
                if '"verdict"' in line and line.startswith("{")]
    assert proc.returncode == 86, proc.stdout + proc.stderr[-3000:]
    assert lines and lines[0]["wrong_words"] == 0, lines
    offload = [v for v in verdicts if v["where"] == "offload"]
    worker = [v for v in verdicts if v["where"] == "worker"]
    assert offload and offload[0]["reason"] == "PEER_FAILED", verdicts
    assert "reason STREAM_POST" in offload[0]["detail"], verdicts
    assert worker and "CUDA error" in worker[0]["detail"], verdicts


# the late pull: one slot per part, copied on a side stream, joined before its use ----------
PARTS = (7, 7, 7, 7, 7)  # 35 layers of 256 values: 5 slots of 3,584 B a row


@pytest.fixture(scope="module")
def late(ckpt: Path, gpu) -> Iterator[tuple[rig.OffloadProcess, object]]:
    """A second pair in this process, its row split into 5 slots (same node table)."""
    geo = rig.geometry(ROWS, MAX_TOKENS, PARTS)
    off = rig.OffloadProcess(ckpt, geo, spin_us=2000, actor_name="gpu-rig-late")
    try:
        yield off, rig.attach_another(off.handle, geo), geo
    finally:
        off.close()


def _late_engine(pair, geo, t: int, seed: int) -> rig.Engine:
    return rig.Engine(pair, rig.LateStandIn(ROWS, geo).cuda(), t, ROWS, torch.device("cuda"),
                      seed)


@needs_cuda
@pytest.mark.parametrize("t", [1, 64])
def test_late_pull_eager_closed_loop_rows_verified(late, t: int) -> None:
    _, pair, geo = late
    before = pair.block.posted
    with rig.registered(pair):
        assert _late_engine(pair, geo, t, seed=200 + t).eager(300) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 300, before + 300,
                                                         {before + 300})


@needs_cuda
@pytest.mark.parametrize(("t", "copy_mode", "release_in_graph"),
                         [(8, "sm", False), (256, "dma", False), (64, "auto", True)])
def test_late_pull_graph_closed_loop_rows_verified(late, t: int, copy_mode: str,
                                                   release_in_graph: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, pair, geo = late
    monkeypatch.setattr(pair.transport, "options",
                        pair.transport.options.model_copy(update={"copy_mode": copy_mode}))
    before = pair.block.posted
    with rig.registered(pair):
        graph = _late_engine(pair, geo, t, seed=300 + t).capture(release_in_graph)
    assert pair.block.posted == before, "a capture must not post"
    rec = graph.record
    assert rec.rows == t and rec.release == release_in_graph
    assert [(c.layer, c.nbytes, c.late) for c in rec.copies] == [
        (i, t * 3584, True) for i in range(len(PARTS))]
    # auto: a late copy goes to the copy engine (it runs beside the layers; late-run12)
    assert {c.mode for c in rec.copies} == {"dma" if copy_mode == "auto" else copy_mode}
    assert graph.run(1000) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 1000, before + 1000,
                                                        {before + 1000})


RESIDENT = 7  # `ple.resident_layers`: layers 0-6 the worker's own, parts of 7 for the rest


@needs_cuda
def test_late_pull_after_resident_layers_graph_closed_loop_rows_verified(ckpt: Path,
                                                                         gpu) -> None:
    """A geometry whose first 7 layers are the worker's own: 4 slots cover layers 7-34,
    each part's words checked at its own columns (from layer 7's on), captured, 300 steps."""
    geo = rig.geometry(ROWS, MAX_TOKENS, PARTS[1:], resident_layers=RESIDENT)
    assert [s.first_layer for s in geo.slots()] == [7, 14, 21, 28]
    off = rig.OffloadProcess(ckpt, geo, spin_us=2000, actor_name="gpu-rig-resident")
    try:
        pair = rig.attach_another(off.handle, geo)
        with rig.registered(pair):
            assert _late_engine(pair, geo, 64, seed=500).eager(50) == 0
            graph = _late_engine(pair, geo, 64, seed=501).capture(False)
        assert [(c.layer, c.nbytes) for c in graph.record.copies] == [
            (i, 64 * 3584) for i in range(len(PARTS) - 1)]
        assert graph.run(300) == 0
        c = pair.block.counters()
        assert (c.posted, c.released) == (350, 350)
    finally:
        off.close()


@needs_cuda
def test_external_event_wait_resolves_the_record_made_before_launch() -> None:
    """What the piecewise joins rest on: a graph's external event wait waits for the
    event's record made before the graph's launch, and not for one made after it (the next
    step's fork re-records done[layer] while this step's pieces may still be queued)."""
    import mmap

    import numpy as np

    from ray_ple.worker.transport.cuda_host import check, driver, register_host

    d = driver()
    page = mmap.mmap(-1, mmap.PAGESIZE)
    words = np.frombuffer(page, dtype=np.int32)
    dev = register_host(int(words.ctypes.data), mmap.PAGESIZE, words,
                        what="event probe page").device_ptr
    ev = check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    eq = d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    s_before, s_after, cap = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=cap):
        check(d.cuStreamWaitEvent(cap.cuda_stream, ev,
                                  d.CUevent_wait_flags.CU_EVENT_WAIT_EXTERNAL), "wait ext")
        check(d.cuStreamWriteValue32(cap.cuda_stream, dev + 4, 1, 0), "write")
    # record A: held until word 0 is 1; the launch; record B (after it): held on word 2
    check(d.cuStreamWaitValue32(s_before.cuda_stream, dev, 1, eq), "hold A")
    check(d.cuEventRecord(ev, s_before.cuda_stream), "record A")
    g.replay()
    check(d.cuStreamWaitValue32(s_after.cuda_stream, dev + 8, 1, eq), "hold B")
    check(d.cuEventRecord(ev, s_after.cuda_stream), "record B")
    time.sleep(0.05)
    held = int(words[1])
    words[0] = 1  # A completes; B stays held
    deadline = time.monotonic() + 5
    while int(words[1]) != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    after_a = int(words[1])
    words[2] = 1
    torch.cuda.synchronize()
    assert held == 0, "the graph did not wait for the record made before its launch"
    assert after_a == 1, "the graph waited for a record made after its launch"


@needs_cuda
@pytest.mark.parametrize(("t", "stream"), [(8, False), (64, True), (256, True)])
def test_piecewise_pieces_join_eager_forks_closed_loop_rows_verified(late, t: int,
                                                                     stream: bool) -> None:
    """vLLM's piecewise graphs with `pull_async` a splitting op: the forks run eagerly
    between the pieces on every replay, the pieces join them as external events; the
    capture records joins and no copy; replays declared to no one (as vLLM's), released
    through the capture found by token count; 300 steps, every word checked."""
    _, pair, geo = late
    before = pair.block.posted
    with rig.registered(pair):
        engine = rig.Engine(pair, rig.LateStandIn(ROWS, geo).cuda(), t, ROWS,
                            torch.device("cuda"), seed=700 + t, stream=stream)
        step = rig.PiecewiseLate(engine)
        assert pair.block.posted == before, "a capture must not post"
        assert (step.record.copies, step.record.joins) == ((), tuple(range(len(PARTS))))
        assert step.run(300, wait=not stream) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 300, before + 300,
                                                        {before + 300})


@needs_cuda
@pytest.mark.parametrize("fault", ["unjoined", "unstarted"])
def test_piecewise_pieces_that_miss_a_join_or_a_start_are_fatal(ckpt: Path, tmp_path: Path,
                                                                 fault: str) -> None:
    """A capture whose pieces do not join every eager pull is refused when it ends; a step
    whose pieces replay without their eager pulls (joins that would wait for no copy) is
    refused before its release: both end the process (exit 86), naming GEOMETRY."""
    (tmp_path / "ckpt").symlink_to(ckpt)
    proc = subprocess.run([sys.executable, str(RIG), f"piecewise-{fault}", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    verdicts = [json.loads(line) for line in proc.stderr.splitlines()
                if '"verdict"' in line and line.startswith("{")]
    assert proc.returncode == 86, proc.stdout + proc.stderr[-3000:]
    assert verdicts and verdicts[0]["reason"] == "GEOMETRY", verdicts
    assert verdicts[0]["where"] == "consumer", verdicts
    if fault == "unstarted":  # the pieces ran right while their pulls ran
        assert lines and lines[0]["wrong_words"] == 0 and lines[0]["captured_joins"] == [
            0, 1, 2, 3, 4], lines
    else:
        assert not lines, lines


@needs_cuda
def test_piecewise_forward_pulls_each_part_in_stream_at_its_wait(
        late, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `pull_async` captured inside a piece (not a splitting op) could not be joined in a
    later piece: captured under the piecewise probe it starts nothing and `pull_wait`,
    finding no started pull, waits and copies on the model stream (no side-stream copy in
    the graph); eager, it forks and joins; rows verified."""
    from ray_ple.worker import ops

    _, pair, geo = late
    monkeypatch.setattr(ops, "_piecewise", lambda: True)
    before = pair.block.posted
    with rig.registered(pair):
        assert _late_engine(pair, geo, 8, seed=400).eager(100) == 0
        graph = _late_engine(pair, geo, 8, seed=401).capture(False)
    assert [(c.layer, c.late) for c in graph.record.copies] == [
        (i, False) for i in range(len(PARTS))]
    assert graph.run(300) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 400, before + 400,
                                                        {before + 400})


@needs_cuda
@pytest.mark.parametrize("mode", ["early", "late"])
def test_stale_step_stamp_fails_closed_on_the_gpu(ckpt: Path, tmp_path: Path, mode: str) -> None:
    """A slot stamped with another step: the copy traps after writing the reason word and
    FAILED (the offload side reads them and ends itself), the forward's next CUDA call
    raises and the worker fails closed (exit 86): the step's tokens never leave."""
    from ray_ple.worker.transport.cuda import STAMP_REASON

    (tmp_path / "ckpt").symlink_to(ckpt)
    proc = subprocess.run([sys.executable, str(RIG), f"stamp-{mode}", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    verdicts = [json.loads(line) for line in proc.stderr.splitlines()
                if '"verdict"' in line and line.startswith("{")]
    assert proc.returncode == 86, proc.stdout + proc.stderr[-3000:]
    offload = [v for v in verdicts if v["where"] == "offload"]
    worker = [v for v in verdicts if v["where"] == "worker"]
    assert offload and offload[0]["reason"] == "PEER_FAILED", verdicts
    assert f"reason {STAMP_REASON.name}" in offload[0]["detail"], verdicts
    assert worker and "CUDA error" in worker[0]["detail"], verdicts


# the rig itself (runs everywhere) ----------------------------------------------------------
def test_wrong_words_counts_a_single_flipped_word() -> None:
    ids = torch.tensor([5, 0, 4095])
    cols = torch.arange(8960 // 2, dtype=torch.int32)
    words = ids.to(torch.int32)[:, None] * cols.shape[0] + cols
    assert int(rig.wrong_words(words, ids, cols)) == 0
    words[2, 17] ^= 1
    assert int(rig.wrong_words(words, ids, cols)) == 1


def _rig_on_cpu(body: str, ckpt: Path) -> dict:
    """Run `body` after the rig's imports in a fresh process with no GPU; its last JSON line.
    `body` sees `r` (cuda_rig), `torch`, `json` and `ckpt` (the checkpoint directory)."""
    code = (f"import sys, json, torch; sys.path.insert(0, {str(RIG.parent)!r}); "
            "import cuda_rig as r; import ray_ple.worker.ops; from pathlib import Path; "
            f"ckpt = Path({str(ckpt)!r})\n" + body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rig_closed_loop_on_the_cpu_transport(ckpt: Path) -> None:
    """The same engine loop and offload process, CPU transport, in a fresh process."""
    out = _rig_on_cpu(
        f"g = r.geometry({ROWS}, 64); o = r.OffloadProcess(ckpt, g); "
        "p = r.attach(o.handle, g, 'cpu'); "
        f"e = r.Engine(p, r.StandIn({ROWS}), 8, {ROWS}, torch.device('cpu')); "
        "print(json.dumps({'wrong': e.eager(200), 'c': list(p.block.counters()[::2]), "
        "'st': o.status()})); o.close()", ckpt)
    assert out["wrong"] == 0 and out["c"] == [200, 200]
    assert out["st"]["cuda_evidence"] == [] and not out["st"]["torch_imported"]


def test_rig_late_pull_on_the_cpu_transport(ckpt: Path) -> None:
    """The late stand-in and ops (5 slots) through a synchronous transport (CPU)."""
    out = _rig_on_cpu(
        f"g = r.geometry({ROWS}, 64, {PARTS!r}); o = r.OffloadProcess(ckpt, g); "
        "p = r.attach(o.handle, g, 'cpu'); "
        f"e = r.Engine(p, r.LateStandIn({ROWS}, g), 8, {ROWS}, torch.device('cpu')); "
        "print(json.dumps({'wrong': e.eager(100), 'c': [p.block.posted, p.block.released], "
        "'slots': list(p.handle.layer_names)})); o.close()", ckpt)
    assert out["wrong"] == 0 and out["c"] == [100, 100]
    assert out["slots"] == [f"{rig.LAYER}#{i}" for i in range(len(PARTS))]


def test_rig_late_pull_after_resident_layers_on_the_cpu_transport(ckpt: Path) -> None:
    """Slots that start after the resident layers: the offload actor gathers each part's
    own columns (layer 7's on), every word checked where it belongs."""
    out = _rig_on_cpu(
        f"g = r.geometry({ROWS}, 64, {PARTS[1:]!r}, resident_layers={RESIDENT}); "
        "o = r.OffloadProcess(ckpt, g); p = r.attach(o.handle, g, 'cpu'); "
        f"e = r.Engine(p, r.LateStandIn({ROWS}, g), 8, {ROWS}, torch.device('cpu')); "
        "print(json.dumps({'wrong': e.eager(100), 'c': [p.block.posted, p.block.released], "
        "'first': [s.first_layer for s in g.slots()]})); o.close()", ckpt)
    assert out["wrong"] == 0 and out["c"] == [100, 100]
    assert out["first"] == [7, 14, 21, 28]


def test_rig_stream_post_is_refused_on_the_cpu_transport(ckpt: Path) -> None:
    """No stream on the CPU transport: a stream step is one clear error, nothing announced."""
    out = _rig_on_cpu(
        "from ray_ple.errors import PleConfigError\n"
        f"g = r.geometry({ROWS}, 64); o = r.OffloadProcess(ckpt, g); "
        "p = r.attach(o.handle, g, 'cpu'); "
        f"e = r.Engine(p, r.StandIn({ROWS}), 8, {ROWS}, torch.device('cpu'), stream=True)\n"
        "try:\n    e.eager(1); err = None\nexcept PleConfigError as x:\n    err = str(x)\n"
        "print(json.dumps({'err': err, 'words': [p.block.announced, p.block.posted], "
        "'phase': p.worker.phase.value, 'st': o.status()['state']})); o.close()", ckpt)
    assert "cannot post a step from a stream" in out["err"]
    assert out["words"] == [0, 0] and out["phase"] == "idle" and out["st"] == "READY"
