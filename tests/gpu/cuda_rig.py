"""The GPU rig: a pattern table, the offload side in its own process, a stand-in model whose
forward contains the real offload layer, and a small engine loop of the project's own.

vLLM cannot run on the GPU test machine, so this loop plays the engine: it posts every step
through `WorkerPair.step` (the same bracket the vLLM runner hook uses), runs the forward
eagerly, from a CUDA graph captured as a local forward, or through torch.compile, and reads
the next ids back the way a decode engine reads sampled tokens. It replays the graphs it
captured without telling the transport, as vLLM's runner does; what a capture recorded is
read from the transport's `captures` (`newest_capture`).

Run as a module from the repository root (`python -m tests.gpu.cuda_rig`); benches import it
as `tests.gpu.cuda_rig`.

Every row is checkable: element j (as int32) of table row r is r * W + j (W = row_bytes / 4),
and the model compares every gathered word with that, on the device, every step. The next
step's ids come from the previous step's output (a closed loop), so a stale or misplaced row
cannot pass. Runs on CPU too (transport 'cpu', no graphs) so the rig itself is tested in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_ple.config import PleConfig, PleDeadlines
from ray_ple.protocol.geometry import PleGeometry, TableGeometry
from ray_ple.protocol.handles import EngineHandles, PairHandle
from ray_ple.table_source import TableSource
from ray_ple.worker import pair as worker_pair
from ray_ple.worker.vllm_plugin.embedding import PleOffloadEmbedding

REPO = Path(__file__).resolve().parents[2]  # the rig's processes run its modules from here

TABLE = "model.embed_tokens_per_layer"
TENSOR = "model.embed_tokens_per_layer.weight"
ROW_ELEMS = 35 * 256  # Gemma 4 E2B/E4B-like: 35 layers x 256 dims, bf16 -> 17,920 B a row


# the table ---------------------------------------------------------------------------------
def write_pattern_checkpoint(directory: Path, rows: int, row_elems: int = ROW_ELEMS) -> Path:
    """A safetensors file whose bf16 table holds int32 words r * W + j (data 64-B aligned)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    words = row_elems // 2
    nbytes = rows * row_elems * 2
    meta = {TENSOR: {"dtype": "BF16", "shape": [rows, row_elems], "data_offsets": [0, nbytes]}}
    header = json.dumps(meta).encode()
    header += b" " * ((-(8 + len(header))) % 64)
    cols = np.arange(words, dtype=np.int32)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        chunk = max(1, (64 << 20) // (words * 4))
        for r0 in range(0, rows, chunk):
            r = np.arange(r0, min(rows, r0 + chunk), dtype=np.int32)
            f.write((r[:, None] * words + cols).tobytes())
    (directory / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForCausalLM"]}))
    return path


def table_view(path: Path) -> np.memmap:
    """The checkpoint's table as a read-only (rows, row_bytes) uint8 memmap (variants B, D)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))[TENSOR]
    rows, elems = meta["shape"]
    return np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(rows, elems * 2))


def geometry(rows: int, max_tokens: int, parts: tuple[int, ...] = (),
             row_elems: int = ROW_ELEMS, resident_layers: int = 0) -> PleGeometry:
    """One table; `parts` (model layers per slot, 256 values each) splits its row into
    slots named `TABLE#p` (late pull); `()` is one slot, the whole row, named `TABLE`.
    `resident_layers`: the first layers are the worker's own; the parts cover the rest."""
    shape = TableGeometry(name=TABLE, rows=rows, row_elems=row_elems, dtype="bfloat16")
    if not parts:
        return PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=max_tokens,
                           tables=(shape,))
    return PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=max_tokens, tables=(shape,),
                       row_layers=row_elems // 256, resident_layers=resident_layers,
                       parts=tuple(parts))


def deadlines() -> PleDeadlines:
    return PleDeadlines(startup_s=600, step_s=30, offload_wait_s=10, heartbeat_s=10)


# the offload side --------------------------------------------------------------------------
class OffloadProcess:
    """The project's offload actor in a separate CPU-only process (no torch, no CUDA)."""

    def __init__(self, checkpoint_dir: Path, geo: PleGeometry, *, spin_us: float = 0.0,
                 shm_dir: str = "/dev/shm", actor_name: str = "gpu-rig-offload",
                 env: dict[str, str] | None = None, gather_threads: int = 1) -> None:
        cfg = PleConfig(transport="cuda", offload_spin_us=spin_us, shm_dir=shm_dir,
                        deadlines=deadlines(), gather_threads=gather_threads)
        source = TableSource(checkpoint_dir=str(Path(checkpoint_dir).resolve()),
                             tensor_names=(TENSOR,),
                             table=geo.tables[0])
        spec = {"rank": 0, "actor_name": actor_name, "geometry": geo.model_dump(mode="json"),
                "sources": [source.model_dump(mode="json")],
                "config": cfg.model_dump(mode="json")}
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.gpu.offload_proc"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=full_env, cwd=REPO)
        reply = self._ask(json.dumps(spec))
        self.handle = PairHandle.model_validate(reply["handle"])
        self.pid = int(reply["pid"])

    def _ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"offload process exited with {self.proc.wait(5)}")
        return json.loads(out)

    def status(self) -> dict[str, Any]:
        return self._ask("status")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask("close")
            finally:
                self.proc.wait(10)


def attach(handle: PairHandle, geo: PleGeometry, transport: str) -> worker_pair.WorkerPair:
    """Attach this process's pair exactly as a worker does (registry keyed by slot name)."""
    os.environ.update(EngineHandles(pairs=(handle,)).env())
    return worker_pair.attach_process(geo, rank=0, transport=transport, deadlines=deadlines(),
                                      heartbeat_s=0.25)


def attach_another(handle: PairHandle, geo: PleGeometry, transport: str = "cuda"
                   ) -> worker_pair.WorkerPair:
    """A second pair in this process (bench and tests only: an engine worker has one).

    The op resolves names through the process registry, so a forward that uses this pair
    runs inside `registered(pair)`; graphs hold their addresses and need it only to capture.
    """
    return worker_pair.WorkerPair.attach(handle, geo, rank=0, transport=transport,
                                         deadlines=deadlines(), heartbeat_s=0.25)


@contextmanager
def registered(pair: worker_pair.WorkerPair) -> Iterator[worker_pair.WorkerPair]:
    """Point this process's registry at `pair` for the duration (restored after)."""
    saved = worker_pair._PAIR, dict(worker_pair._SLOTS)
    worker_pair._PAIR = pair
    worker_pair._SLOTS.clear()
    worker_pair._SLOTS.update({n: i for i, n in enumerate(pair.handle.slot_names)})
    try:
        yield pair
    finally:
        worker_pair._PAIR = saved[0]
        worker_pair._SLOTS.clear()
        worker_pair._SLOTS.update(saved[1])


def part_slots(geo: PleGeometry) -> list[tuple[str, int, int]]:
    """(slot name, first int32 word of the row, int32 words) of every slot of the table."""
    return [(s.name, s.col_offset // 4, s.row_bytes // 4) for s in geo.slots()]


# the stand-in model ------------------------------------------------------------------------
class StandIn(torch.nn.Module):
    """PLE lookup (the real offload layer), a row-by-row check, a consumer, the next ids."""

    def __init__(self, rows: int, row_elems: int = ROW_ELEMS) -> None:
        super().__init__()
        self.ple = PleOffloadEmbedding(TABLE, row_elems, torch.bfloat16)
        self.rows, self.words = rows, row_elems // 2
        self.register_buffer("cols", torch.arange(self.words, dtype=torch.int32),
                             persistent=False)
        gen = torch.Generator().manual_seed(0)
        self.mix = torch.nn.Parameter(torch.randn(256, 16, generator=gen), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.ple(ids)
        words = rows.view(torch.int32)
        bad = wrong_words(words, ids, self.cols)
        consumed = (words[:, :256] & 0xFF).float() @ self.mix
        t = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
        nxt = ((ids * 1103515245 + 12345 + t * 7919) % 2147483648) % self.rows
        return bad, nxt, consumed


class PartBuffers(list):
    """Each part's `[T, width]` view of one flat buffer (parts concatenated, any widths)."""

    flat: torch.Tensor


class LateStandIn(torch.nn.Module):
    """The late pull: every part's `pull_async` first, then per part its `pull_wait` and the
    check of its words. Parts of equal width share one buffer `(P, T, words per part)` and a
    broadcast check; parts of unequal width (or `indexed=True`) sit in one flat buffer and
    are checked against per-T index maps (one more gather over the words than the broadcast)."""

    def __init__(self, rows: int, geo: PleGeometry, row_elems: int = ROW_ELEMS,
                 indexed: bool = False) -> None:
        super().__init__()
        import ray_ple.worker.ops  # noqa: F401 - registers the pull ops

        self.slots = part_slots(geo)
        widths = [w for _, _, w in self.slots]
        self.equal = len(set(widths)) == 1 and not indexed
        self.rows, self.words, self.widths = rows, row_elems // 2, widths
        self.part_words = widths[0] if self.equal else 0
        self.register_buffer("cols", torch.tensor(
            [[c0 + j for j in range(w)] for _, c0, w in self.slots] if self.equal else [],
            dtype=torch.int32), persistent=False)
        self.maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        gen = torch.Generator().manual_seed(0)
        self.mix = torch.nn.Parameter(torch.randn(128, 16, generator=gen), requires_grad=False)
        self.register_buffer("anchor", torch.zeros(1), persistent=False)

    def pull(self, ids: torch.Tensor) -> torch.Tensor | PartBuffers:
        buf = self.buffers(ids)
        self.start(buf)
        return buf

    def start(self, buf: torch.Tensor | PartBuffers) -> None:
        """Every part's `pull_async` into its buffer, one after another."""
        for (name, _, _), view in zip(self.slots, buf, strict=True):
            torch.ops.ray_ple.pull_async(view, name)

    def buffers(self, ids: torch.Tensor) -> torch.Tensor | PartBuffers:
        """Every part's `[T, width]` buffer (one tensor, or views of one flat buffer)."""
        t = ids.shape[0]
        if self.equal:
            buf = torch.empty((len(self.slots), t, self.part_words * 2),
                              dtype=torch.bfloat16, device=ids.device)
        else:
            buf = PartBuffers()
            buf.flat = torch.empty(t * self.words * 2, dtype=torch.bfloat16, device=ids.device)
            at = 0
            for w in self.widths:
                buf.append(buf.flat[at:at + t * w * 2].view(t, w * 2))
                at += t * w * 2
        return buf

    def wait(self, buf: torch.Tensor | PartBuffers, p: int) -> None:
        """Join part p (anchored on a buffer of its own: no compiler reorders this model)."""
        torch.ops.ray_ple.pull_wait(buf[p], self.anchor, self.slots[p][0])

    def index_maps(self, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, column) of every word of the flat buffer at `t` tokens; built on the first
        (eager, warm-up) forward of each size, so a capture only reads them."""
        if t not in self.maps:
            tok, col = [], []
            for _, c0, w in self.slots:
                tok.append(torch.arange(t, dtype=torch.int32).repeat_interleave(w))
                col.append((torch.arange(w, dtype=torch.int32) + c0).repeat(t))
            self.maps[t] = (torch.cat(tok).to(device), torch.cat(col).to(device))
        return self.maps[t]

    def check(self, buf: torch.Tensor | PartBuffers, ids: torch.Tensor) -> torch.Tensor:
        """Wrong int32 words of every part (0 when every row is right)."""
        if self.equal:
            words = buf.view(torch.int32)
            expect = ids.to(torch.int32)[None, :, None] * self.words + self.cols[:, None, :]
            return (words != expect).sum()
        tok, col = self.index_maps(ids.shape[0], ids.device)
        expect = (ids.to(torch.int32) * self.words).index_select(0, tok) + col
        return (buf.flat.view(torch.int32) != expect).sum()

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buf = self.pull(ids)
        for p in range(len(self.slots)):
            self.wait(buf, p)
        bad = self.check(buf, ids)
        consumed = (buf[0][:, :256].view(torch.int32) & 0xFF).float() @ self.mix  # layer 0
        t = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
        nxt = ((ids * 1103515245 + 12345 + t * 7919) % 2147483648) % self.rows
        return bad, nxt, consumed


def wrong_words(words: torch.Tensor, ids: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """How many int32 words differ from the pattern of the rows `ids` name (0 when right)."""
    expect = ids.to(torch.int32)[:, None] * cols.shape[0] + cols
    return (words != expect).sum()


def first_ids(t: int, rows: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, rows, size=t, dtype=np.int64)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# the engine loop ---------------------------------------------------------------------------
class Engine:
    """Posts each step through `WorkerPair.step` (the host's copy of the ids, read with a
    sync) or, `stream=True`, `WorkerPair.stream_step` (the GPU posts the model's int32 ids
    itself; the host never waits, as with vLLM's async scheduling); closes the loop on the
    model's own ids."""

    def __init__(self, pair: worker_pair.WorkerPair, model: Any, t: int, rows: int,
                 device: torch.device, seed: int = 1, stream: bool = False) -> None:
        self.pair, self.model, self.t, self.rows, self.device = pair, model, t, rows, device
        self.ids = torch.from_numpy(first_ids(t, self.rows, seed)).to(device)
        self.err = torch.zeros((), dtype=torch.int64, device=device)
        self.steps = 0
        self.stream = stream

    def eager(self, n: int) -> int:
        """n closed-loop steps, eager forward; returns the wrong words seen (0 expected)."""
        for _ in range(n):
            if self.stream:
                with self.pair.stream_step(self.ids.to(torch.int32)):
                    bad, nxt, _ = self.model(self.ids)
            else:
                host = self.ids.to(torch.int32).cpu().numpy()  # the engine's read (a sync)
                with self.pair.step(host):
                    bad, nxt, _ = self.model(self.ids)
            self.err += bad
            self.ids = nxt
            self.steps += 1
        return int(self.err.item())

    def capture(self) -> GraphStep:
        return GraphStep(self)


def newest_capture(pair: worker_pair.WorkerPair, rows: int) -> Any:
    """The transport's record of the newest graph captured for `rows` tokens (a
    `CaptureRecord`), None where there is none (or no graphs: the CPU transport)."""
    records = getattr(pair.transport, "captures", {}).get(rows, [])
    return records[-1] if records else None


class GraphStep:
    """One forward captured as a local forward, then replayed inside each step (the release
    stays the transport's, after the replay, as in vLLM's runner)."""

    def __init__(self, engine: Engine) -> None:
        e = engine
        self.engine = e
        self.transport = e.pair.transport
        self.ids = e.ids.clone()
        self.ids32 = e.ids.to(torch.int32)  # what a stream post reads (vLLM's dtype)
        self.host_ids = torch.empty(e.t, dtype=torch.int32, pin_memory=True)  # posted ids
        self.err = torch.zeros((), dtype=torch.int64, device=e.device)
        self.graph = torch.cuda.CUDAGraph()
        with e.pair.local_forward():
            side = torch.cuda.Stream(e.device)
            side.wait_stream(torch.cuda.current_stream(e.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up (eager local forwards: zero rows, no counter)
                    e.model(self.ids)
            torch.cuda.current_stream(e.device).wait_stream(side)
            with torch.cuda.graph(self.graph):
                bad, nxt, _ = e.model(self.ids)
                self.err.add_(bad)
                self.ids.copy_(nxt)
                self.ids32.copy_(nxt)
                self.host_ids.copy_(self.ids32, non_blocking=True)
        self.record = newest_capture(e.pair, e.t)
        self.err.zero_()
        self.ids.copy_(e.ids)
        self.ids32.copy_(e.ids)
        self.host_ids.copy_(e.ids)
        sync(e.device)

    def run(self, n: int, *, stamps: list[float] | None = None, wait: bool = True) -> int:
        """n closed-loop steps by replay; returns the wrong words seen (0 expected).
        `wait=False` (stream posts only): the host never waits for a step, it runs ahead."""
        e, pair = self.engine, self.engine.pair
        stream = torch.cuda.current_stream(e.device)
        for _ in range(n):
            if wait:
                stream.synchronize()  # the decode engine's wait for its sampled tokens
            if stamps is not None:
                stamps.append(time.perf_counter())
            if e.stream:
                with pair.stream_step(self.ids32):
                    self.graph.replay()
            else:
                with pair.step(self.host_ids.numpy()):
                    self.graph.replay()
            e.steps += 1
        stream.synchronize()
        if stamps is not None:
            stamps.append(time.perf_counter())
        e.ids.copy_(self.ids)
        return int(self.err.item())


# vLLM's piecewise CUDA graphs --------------------------------------------------------------
@contextmanager
def piecewise() -> Iterator[None]:
    """The forward runs piece by piece (vLLM's `in_piecewise_cudagraph()`), for the duration."""
    from ray_ple.worker import ops

    saved = ops._piecewise
    ops.set_piecewise_probe(lambda: True)
    try:
        yield
    finally:
        ops.set_piecewise_probe(saved)


class Pieces:
    """A forward as vLLM's piecewise backend runs it: captured segments (one CUDA graph each,
    one memory pool) between eager ones (its splitting ops, whose Python runs on every
    replay too); replays are declared to no one, as vLLM's are. Segments keep their tensors
    on a state object of their own: a captured segment's outputs are the graph's static
    buffers, which later segments read."""

    def __init__(self, segments: list[tuple[bool, Any]]) -> None:
        self.segments = segments  # (captured?, fn() -> None)
        self.run_list: list[Any] = []

    def capture(self, warmups: int = 1) -> None:
        """Warm-up eagerly, then capture every captured segment, in order (vLLM's capture
        `_dummy_run`: one forward; the eager segments run between the captures)."""
        with piecewise():
            for _ in range(warmups):
                for _, fn in self.segments:
                    fn()
            pool = torch.cuda.graph_pool_handle()
            for captured, fn in self.segments:
                if not captured:
                    fn()
                    self.run_list.append(fn)
                    continue
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    fn()
                self.run_list.append(g.replay)

    def replay(self) -> None:
        with piecewise():
            for fn in self.run_list:
                fn()


# torch.compile across processes ------------------------------------------------------------
def dynamo_graph(pair: worker_pair.WorkerPair, model: torch.nn.Module,
                 ids: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The FX graph Dynamo hands a backend (what vLLM compiles), traced as a local forward."""
    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    traced = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    with pair.local_forward():
        traced(ids)
    return seen["gm"], seen["inputs"]


def load_artifact(model: torch.nn.Module, path: Path) -> Any:
    """torch.compile whose backend loads the saved Inductor artefact instead of compiling."""
    from torch._inductor import CompiledArtifact

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        art = CompiledArtifact.load(path=str(path), format="unpacked")
        return lambda *args: art(*args)

    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)


def live_addresses(pair: worker_pair.WorkerPair) -> dict[str, int]:
    """Every address of this process's pair a compile cache could have baked in."""
    block, t = pair.block, pair.transport
    base = block.segment.address()
    out = {"segment": base}
    for i, off in enumerate(block.layout.slot_offsets):
        out[f"slot{i}"] = base + off
    for i, off in enumerate(block.layout.flag_offsets):
        out[f"flag{i}"] = base + off
    reg = getattr(t, "registration", None)
    if reg is not None:
        out["device_segment"] = reg.device_ptr
        for i, off in enumerate(block.layout.flag_offsets):
            out[f"device_flag{i}"] = reg.device_ptr + off
        for i, off in enumerate(block.layout.slot_offsets):
            out[f"device_slot{i}"] = reg.device_ptr + off
    return out


def addresses_in(directory: Path, addresses: dict[str, int]) -> list[str]:
    """Names of the addresses found in any file under `directory` (text, hex or raw bytes)."""
    needles = {}
    for name, a in addresses.items():
        needles[name] = (str(a).encode(), hex(a).encode(), a.to_bytes(8, "little"))
    found = set()
    for f in directory.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            found.update(n for n, forms in needles.items() if any(x in data for x in forms))
    return sorted(found)


def compile_scenario(role: str, work: Path, rows: int, t: int, steps: int,
                     parts: tuple[int, ...] = ()) -> dict[str, Any]:
    """`save`: compile + save + run; `load`: new process, new segment, load + run. With
    `parts`, the late pull (`LateStandIn`: every part's `pull_async`, then each
    `pull_wait`), whose ops name a slot (`TABLE#p`) where the single pull names the table."""
    import mmap
    import secrets

    import ray_ple.worker.ops  # noqa: F401 - registers ray_ple::pull in this process

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    spacer = mmap.mmap(-1, (1 + secrets.randbelow(4096)) * mmap.PAGESIZE)  # shift the layout
    geo = geometry(rows, max_tokens=max(t, 16), parts=parts)
    off = OffloadProcess(work / "ckpt", geo, spin_us=1000 if cuda else 0)
    try:
        pair = attach(off.handle, geo, "cuda" if cuda else "cpu")
        model = (LateStandIn(rows, geo) if parts else StandIn(rows)).to(device)
        artifact = work / "artifact"
        ids = torch.from_numpy(first_ids(t, rows)).to(device)
        result: dict[str, Any] = {"role": role, "pid": os.getpid(), "device": str(device)}
        t0 = time.perf_counter()
        if role == "save":
            gm, inputs = dynamo_graph(pair, model, ids)
            from torch._inductor import standalone_compile

            art = standalone_compile(gm, inputs)
            art.save(path=str(artifact), format="unpacked")
            result["ops_in_graph"] = sum(1 for n in gm.graph.nodes
                                         if "ray_ple" in str(n.target))
            fn: Any = load_artifact(model, artifact)  # run what was saved, here too
        else:
            fn = load_artifact(model, artifact)
        result["compile_or_load_s"] = round(time.perf_counter() - t0, 2)
        engine = Engine(pair, fn, t, rows, device)
        result["eager_wrong_words"] = engine.eager(steps)
        if cuda:
            graph = engine.capture()
            result["graph_wrong_words"] = graph.run(steps)
            result["graph_record"] = graph.record.model_dump() if graph.record else None
        result["steps"] = engine.steps
        result["counters"] = list(pair.block.counters()[::2])
        addrs = live_addresses(pair)
        result["addresses"] = {k: hex(v) for k, v in addrs.items()}
        result["addresses_in_artifact"] = addresses_in(artifact, addrs)
        if role == "load":
            saved = json.loads((work / "save.json").read_text())["addresses"]
            result["addresses_equal_to_saver"] = sorted(
                k for k, v in result["addresses"].items() if saved.get(k) == v)
        (work / f"{role}.json").write_text(json.dumps(result))
        del spacer
        return result
    finally:
        off.close()


def geometry_mismatch_scenario(work: Path) -> None:
    """Replay a graph captured for 8 tokens in a step that posted 16: must end the process."""
    import ray_ple.worker.ops  # noqa: F401

    geo = geometry(4096, max_tokens=64)
    off = OffloadProcess(work / "ckpt", geo, spin_us=1000)
    try:
        pair = attach(off.handle, geo, "cuda")
        engine = Engine(pair, StandIn(4096).cuda(), 8, 4096, torch.device("cuda"))
        graph = engine.capture()
        print(json.dumps({"captured_rows": graph.record.rows}), flush=True)
        with pair.step(first_ids(16, 4096).astype(np.int32)):
            graph.graph.replay()  # fatal at the release: no graph captured for 16 tokens
        print(json.dumps({"error": "mismatched replay was not stopped"}), flush=True)
    finally:
        off.close()


def stamp_mismatch_scenario(work: Path, late: bool) -> None:
    """A slot whose stamp is not the step in flight: the GPU must fail closed (trap, reason).

    The stream is held in a sleep while the offload side publishes; then this process
    overwrites one slot's stamp (as a stale or misplaced publish would leave it) and the
    forward's copy finds it. Prints what the host words say after the context is lost.
    """
    import ray_ple.worker.ops  # noqa: F401
    from ray_ple.worker.transport.cuda import STAMP_REASON

    parts = (7, 7, 7, 7, 7) if late else ()
    geo = geometry(4096, max_tokens=64, parts=parts)
    off = OffloadProcess(work / "ckpt", geo, spin_us=1000)
    pair = attach(off.handle, geo, "cuda")
    model = (LateStandIn(4096, geo) if late else StandIn(4096)).cuda()
    ids = torch.from_numpy(first_ids(8, 4096)).cuda()
    torch.cuda.synchronize()
    block, slot = pair.block, len(pair.block.flags) - 1
    result: dict[str, Any] = {"slots": len(block.flags), "expected_reason": int(STAMP_REASON)}
    try:
        with pair.step(ids.to(torch.int32).cpu().numpy()) as s:
            torch.cuda._sleep(400_000_000)  # the stream waits ~0.2 s before the forward
            deadline = time.monotonic() + 10
            while int(block.flags[slot][0]) != 1 and time.monotonic() < deadline:
                pass
            block.set_stamp(slot, s + 5)  # stale: not the step in flight
            bad, _, _ = model(ids)
        torch.cuda.synchronize()
        result["error"] = None
        result["wrong_words"] = int(bad)
    except Exception as exc:  # noqa: BLE001 - the lost context is the expected outcome
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    result["state"], result["reason"] = block.state.name, block.reason
    result["released"], result["posted"] = block.released, block.posted
    print(json.dumps(result), flush=True)
    os._exit(0)  # the context is gone; the offload side ends itself on FAILED


def stream_post_twice_scenario(work: Path) -> None:
    """One announcement, two stream posts (a post enqueued twice): the second `ple_post`
    finds `posted` ahead of `released`, stores STREAM_POST and FAILED and traps."""
    import ray_ple.worker.ops  # noqa: F401
    from ray_ple.protocol.fatal import Reason

    geo = geometry(4096, max_tokens=64)
    off = OffloadProcess(work / "ckpt", geo, spin_us=1000)
    pair = attach(off.handle, geo, "cuda")
    model = StandIn(4096).cuda()
    engine = Engine(pair, model, 8, 4096, torch.device("cuda"), stream=True)
    print(json.dumps({"wrong_words": engine.eager(3), "expected_reason":
                      Reason.STREAM_POST.name}), flush=True)
    ids32 = engine.ids.to(torch.int32)
    with pair.stream_step(ids32):
        pair.transport.stream_post(ids32)  # the bug: the same step posted again
        torch.cuda.synchronize()  # raises: the context is lost (the forward is abandoned)
    print(json.dumps({"error": "a second post of one step was not stopped"}), flush=True)
    off.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", choices=["compile-save", "compile-load", "geometry-mismatch",
                                         "stamp-early", "stamp-late", "stream-post-twice"])
    ap.add_argument("work", type=Path)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--parts", default="", help="compile-*: layers per part, equal (e.g. "
                    "7,7,7,7,7: the late pull; unequal parts build index maps on their first "
                    "forward, which a saved artefact does not replay); none: one pull")
    a = ap.parse_args()
    if a.scenario == "geometry-mismatch":
        geometry_mismatch_scenario(a.work)
        sys.exit(0)
    if a.scenario == "stream-post-twice":
        stream_post_twice_scenario(a.work)
    if a.scenario.startswith("stamp-"):
        stamp_mismatch_scenario(a.work, late=a.scenario == "stamp-late")
    res = compile_scenario(a.scenario.split("-")[1], a.work, a.rows, a.tokens, a.steps,
                           tuple(int(p) for p in a.parts.split(",") if p))
    print(json.dumps(res), flush=True)
