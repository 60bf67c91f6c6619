"""The CUDA transport on a real GPU, driven by the rig's engine loop (`tests.gpu.cuda_rig`).

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
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ray_ple.worker.transport.cuda as cuda_transport
from tests.gpu import cuda_rig as rig

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here); "
    "scripts/gpu_device_run.sh runs this module on the GPU machine")
ROWS, MAX_TOKENS = 4096, 256
RIG = [sys.executable, "-m", "tests.gpu.cuda_rig"]  # run with cwd=rig.REPO


def run_rig(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """One rig scenario in a fresh process (run as a module from the repository root)."""
    return subprocess.run([*RIG, *args], capture_output=True, text=True, check=False,
                          cwd=rig.REPO, **kw)


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
    monkeypatch.setattr(cuda_transport, "COPY_MODE", copy_mode)
    before = pair.block.posted
    graph = _engine(pair, t, seed=100 + t).capture()
    assert pair.block.posted == before, "a capture must not post"
    rec = graph.record
    assert rec.rows == t
    assert [(c.rows, c.nbytes, c.mode) for c in rec.copies] == [(t, t * 17920, copy_mode)]
    assert graph.run(2000) == 0
    assert pair.block.counters() == (before + 2000, (before + 2000,), before + 2000)


@needs_cuda
def test_released_is_advanced_by_the_stream_itself(gpu) -> None:
    _, pair = gpu
    engine = _engine(pair, 4, seed=3)
    s0 = pair.block.posted
    host = engine.ids.to(torch.int32).cpu().numpy()
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
        proc = run_rig(f"compile-{role}", str(tmp_path), "--steps", "1000", "--parts", parts,
                       env=env, timeout=900)
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
    proc = run_rig("geometry-mismatch", str(tmp_path), timeout=300)
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
@pytest.mark.parametrize("t", [64, 256])
def test_stream_post_of_media_steps_posts_the_ids_kept_in_stream_order(gpu, t: int) -> None:
    """A media step as vLLM's runner runs it (runner.py): vLLM's embedding, on the model
    stream, writes the ids the per-layer lookup reads into the media class's buffer
    (`ple_ids`, media positions 0), then the stream posts from that buffer and the forward
    (eager, then a graph replay) consumes the rows; the host never waits, and the buffer is
    rewritten every step. The rows are checked against the kept ids, so a post of the raw
    ids, or of the buffer before this step's write, is wrong words at the media positions."""
    _, pair = gpu
    dev = torch.device("cuda")
    model = rig.StandIn(ROWS).cuda()
    kept = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=dev)  # the media class's ple_ids
    media = torch.from_numpy(rig.first_ids(t, 2, seed=800 + t).astype(bool)).to(dev)
    assert 0 < int(media.sum()) < t
    ids = torch.from_numpy(rig.first_ids(t, ROWS, seed=900 + t)).to(dev)
    err = torch.zeros((), dtype=torch.int64, device=dev)
    before = pair.block.posted

    def embed() -> None:  # vLLM's embed_input_ids, as the media class keeps its ids
        kept[:t].copy_(torch.where(media, torch.zeros_like(ids), ids))

    for _ in range(300):
        embed()
        with pair.stream_step(kept[:t]):
            bad, nxt, _ = model(kept[:t].long())
        err.add_(bad)
        ids.copy_(nxt)
    graph, cur = torch.cuda.CUDAGraph(), torch.cuda.current_stream(dev)
    with pair.local_forward():
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            model(kept[:t].long())  # warm-up: an eager local forward (zero rows, no counter)
        cur.wait_stream(side)
        with torch.cuda.graph(graph):
            bad, nxt, _ = model(kept[:t].long())
            err.add_(bad)
            ids.copy_(nxt)
    for _ in range(700):
        embed()
        with pair.stream_step(kept[:t]):
            graph.replay()
    assert int(err.item()) == 0
    c = pair.block.counters()
    assert (c.posted, c.released, set(c.published)) == (before + 1000, before + 1000,
                                                        {before + 1000})


@needs_cuda
def test_a_step_posted_twice_by_the_stream_fails_closed_on_the_gpu(ckpt: Path,
                                                                   tmp_path: Path) -> None:
    """`ple_post` checks the counters in stream order: a second post of one step traps after
    writing STREAM_POST and FAILED; the offload side ends itself naming it, the worker's
    next CUDA call raises and it fails closed (exit 86)."""
    (tmp_path / "ckpt").symlink_to(ckpt)
    proc = run_rig("stream-post-twice", str(tmp_path), timeout=300)
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
@pytest.mark.parametrize(("t", "copy_mode"), [(8, "sm"), (256, "dma"), (64, "auto")])
def test_late_pull_graph_closed_loop_rows_verified(late, t: int, copy_mode: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, pair, geo = late
    monkeypatch.setattr(cuda_transport, "COPY_MODE", copy_mode)
    before = pair.block.posted
    with rig.registered(pair):
        graph = _late_engine(pair, geo, t, seed=300 + t).capture()
    assert pair.block.posted == before, "a capture must not post"
    rec = graph.record
    assert rec.rows == t
    assert [(c.slot, c.nbytes, c.late) for c in rec.copies] == [
        (i, t * 3584, True) for i in range(len(PARTS))]
    # auto: a late copy goes to the copy engine (it runs beside the layers)
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
            graph = _late_engine(pair, geo, 64, seed=501).capture()
        assert [(c.slot, c.nbytes) for c in graph.record.copies] == [
            (i, 64 * 3584) for i in range(len(PARTS) - 1)]
        assert graph.run(300) == 0
        c = pair.block.counters()
        assert (c.posted, c.released) == (350, 350)
    finally:
        off.close()


@needs_cuda
def test_piecewise_forward_pulls_each_part_in_stream_at_its_wait(
        late, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `pull_async` captured inside a piece could not be joined in a later piece:
    captured under the piecewise probe it starts nothing and `pull_wait`, finding no started
    pull, waits and copies on the model stream (no side-stream copy in the graph); eager, it
    forks and joins; rows verified."""
    from ray_ple.worker import ops

    _, pair, geo = late
    monkeypatch.setattr(ops, "_piecewise", lambda: True)
    before = pair.block.posted
    with rig.registered(pair):
        assert _late_engine(pair, geo, 8, seed=400).eager(100) == 0
        graph = _late_engine(pair, geo, 8, seed=401).capture()
    assert [(c.slot, c.late) for c in graph.record.copies] == [
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
    (tmp_path / "ckpt").symlink_to(ckpt)
    proc = run_rig(f"stamp-{mode}", str(tmp_path), timeout=300)
    verdicts = [json.loads(line) for line in proc.stderr.splitlines()
                if '"verdict"' in line and line.startswith("{")]
    assert proc.returncode == 86, proc.stdout + proc.stderr[-3000:]
    offload = [v for v in verdicts if v["where"] == "offload"]
    worker = [v for v in verdicts if v["where"] == "worker"]
    assert offload and offload[0]["reason"] == "PEER_FAILED", verdicts
    assert f"reason {cuda_transport.STAMP_REASON.name}" in offload[0]["detail"], verdicts
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
    code = ("import json, torch; from tests.gpu import cuda_rig as r; import ray_ple.worker.ops; "
            f"from pathlib import Path; ckpt = Path({str(ckpt)!r})\n" + body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          check=False, cwd=rig.REPO)
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
        "'slots': list(p.handle.slot_names)})); o.close()", ckpt)
    assert out["wrong"] == 0 and out["c"] == [100, 100]
    assert out["slots"] == [f"{rig.TABLE}#{i}" for i in range(len(PARTS))]


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
