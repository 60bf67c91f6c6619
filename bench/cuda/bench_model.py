"""The late pull on an E4B-shaped forward: what a model step pays for its PLE rows.

One GPU process, one table (262,144 rows x 42 layers x 256 bf16 = 21,504 B a row, 5.6 GB),
one id sequence. The model consumer is a 42-layer stand-in shaped like Gemma 4 E4B (hidden
2560; per layer: RMS norm, the q/k/v projection 2560 -> 8 x 256 + 2 x 2 x 256, the output
projection 2048 -> 2560, RMS norm, gate/up 2560 -> 2 x 10240, GELU-tanh product, down
10240 -> 2560, and at its end the PLE gate: gate = gelu(h @ W_gate) * ple_l, h += norm(gate
@ W_proj), W_gate 2560 -> 256, W_proj 256 -> 2560; attention over a KV cache left out),
captured in one CUDA graph per variant and token count, run closed loop (the next ids come
from this step's ids on the GPU, read back on the host before the next step). Every word of
every PLE row is checked on the GPU against its pattern (`wrong_words`, 0 expected).

Variants (where the rows come from, and when the model waits for them):

    A       table on the GPU (index_select before layer 0): the baseline
    B       UVA zero copy: a gather kernel reads the registered host table before layer 0
    C       today's pull: one slot (the whole row), `ray_ple::pull` before layer 0
    L       the late pull: P slots of 42/P layers, every `ray_ple::pull_async` before layer
            0, each part's `ray_ple::pull_wait` just before its first layer's gate; the
            worker posts, then launches (the vLLM hook's order)
    L_lf    the same, launched first, then posted (the host post overlaps the GPU)
    L_in    (`--extra inline`) the pulls of vLLM's late Gemma 4 class under piecewise CUDA
            graphs: each part waited for and copied on the model stream at its first layer
            (`ray_ple::pull`), no side stream; `L_in_sp` the same posted by the stream
    L_sp    the same as L, posted by the stream (`WorkerPair.stream_step`: the host announces
            and enqueues `ple_post`, which writes the step's ids from the GPU's own ids
            tensor and advances `posted`; then the launch; the host never reads the ids)

With `--extra head` (splits, async scheduling), also `H_sp_as` and `U_sp_as`: L_sp_as with
layer 0's rows from the worker's own copy of layer 0's columns (H: device memory; U:
registered host memory read by UVA loads), part 0 still pulled and joined after the last
layer: what a head kept by the worker would buy at small T.

With `--extra resident`, also `R_sp_as`: `ple.resident_layers: 1` as the product runs it
(layer 0's columns in device memory, looked up before layer 0; the pair's geometry offloads
layers 1-41 in parts of 1, 2, 4, 8, 26, so nothing is posted, gathered or copied for layer 0).

With `--extra piecewise`, the same forward as vLLM's piecewise CUDA graphs run it (mixed
prefill batches; `_pw`, all with async scheduling): one captured piece for the embedding and
the row buffers, one per layer (vLLM splits at each attention, left out here) and one for the
check, eager Python between them. `A_pw_as`, `B_pw_as` (table on the GPU, UVA) and
`L_in_pw_sp_as` (each part waited for and copied in its piece, on the model stream: a
`pull_async` captured inside a piece starts nothing).

No variant tells the transaction which graph replayed (vLLM does not): the release finds a
capture by the step's token count.

With `--extra ahead`, also A, B and L_sp as vLLM's async scheduling runs them (`_as`): the
host never reads the ids and enqueues step s+1 while step s runs (it waits only for step
s-1 to have finished, one step of look-ahead, as vLLM waits for the sampled tokens of the
step before). L and L_lf cannot run so: their host post needs the step's ids on the host.

The offload side of C and L is the project's offload actor in separate CPU-only processes
(`tests.gpu.cuda_rig.OffloadProcess`, `gather_threads` numpy threads), the two sharing the
node's one table copy. The synthetic consumer is `bench_pull`'s (`cuda_rig.StandIn`: the
row check, a small matmul, the next ids) for A, B, C and its late form
(`cuda_rig.LateStandIn`) for L. Output: one JSON object per measurement (`consumer`, `T`,
`variant`, `median_us`, `p99_us`, `wrong_words`, ...) in `<out>/model.jsonl`.

`--tiny` runs the same code on CPU (transport 'cpu', eager, a narrow model, no B) as a
smoke test of everything but the GPU.

Run from the repository root: `python -m bench.cuda.bench_model --out <dir>`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import ray_ple.worker.ops  # noqa: F401 - registers pull, pull_async, pull_wait
from ray_ple.protocol.shm import page_align
from ray_ple.worker.transport import cuda as cuda_transport
from tests.gpu import cuda_rig as rig

LAYERS, D = 42, 256
COPY_CONSTANTS = ("SM_COPY_MAX_BYTES", "LATE_SM_COPY_MAX_BYTES", "LATE_COPY_BLOCKS")
RESIDENT_SPLIT = (1, 1, 2, 4, 8, 26)  # `R`: layer 0 resident, then `auto`'s parts of 41
ROW_ELEMS = LAYERS * D
ROW_BYTES = ROW_ELEMS * 2
EMBED_ROWS = 4096


class Shape:
    """The stand-in's sizes: E4B's, or narrow ones for the CPU smoke run."""

    def __init__(self, tiny: bool) -> None:
        self.hidden, self.inter = (64, 128) if tiny else (2560, 10240)
        self.q, self.kv = (64, 32) if tiny else (8 * 256, 2 * 256)


class Weights:
    """Every layer's own weights (bf16, 186 MB a layer at E4B's sizes)."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        h, i, q, kv = shape.hidden, shape.inter, shape.q, shape.kv

        def w(*dims: int, scale: float = 0.02) -> torch.Tensor:
            return (torch.randn(*dims, generator=g, device=device) * scale).to(torch.bfloat16)

        self.embed = w(EMBED_ROWS, h, scale=1.0)
        self.qkv = [w(h, q + 2 * kv) for _ in range(LAYERS)]
        self.o = [w(q, h) for _ in range(LAYERS)]
        self.gu = [w(h, 2 * i) for _ in range(LAYERS)]
        self.down = [w(i, h) for _ in range(LAYERS)]
        self.gate = [w(h, D) for _ in range(LAYERS)]
        self.proj = [w(D, h) for _ in range(LAYERS)]
        self.norm = [torch.ones(h, dtype=torch.bfloat16, device=device) for _ in range(3)]
        self.shape = shape


# where the rows come from ------------------------------------------------------------------
class Whole:
    """A, B, C: the whole row `[T, 42 x 256]` before layer 0; layer l reads its 256 columns."""

    def __init__(self, fetch: Callable[[torch.Tensor], torch.Tensor], rows: int,
                 device: torch.device) -> None:
        self.fetch, self.rows = fetch, rows
        self.cols = torch.arange(ROW_ELEMS // 2, dtype=torch.int32, device=device)

    def start(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fetch(ids)

    def layer(self, st: torch.Tensor, layer: int) -> torch.Tensor:
        return st[:, layer * D:(layer + 1) * D]

    def check(self, st: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return rig.wrong_words(st.view(torch.int32), ids, self.cols)


class Late:
    """L: P slots; every part's async pull first, each part's wait before its first layer."""

    def __init__(self, late: rig.LateStandIn) -> None:
        self.m = late
        layers = [w * 2 // D for w in late.widths]
        self.at = [(p, k) for p, n in enumerate(layers) for k in range(n)]  # layer -> (part, k)

    def start(self, ids: torch.Tensor) -> Any:
        return self.m.pull(ids)

    def layer(self, buf: Any, layer: int) -> torch.Tensor:
        p, k = self.at[layer]
        if k == 0:
            self.m.wait(buf, p)
        return buf[p][:, k * D:(k + 1) * D]

    def check(self, buf: Any, ids: torch.Tensor) -> torch.Tensor:
        return self.m.check(buf, ids)


class Inline(Late):
    """L_in: the pulls of vLLM's late Gemma 4 class under piecewise CUDA graphs (and of the
    class before the split pulls): each part waited for and copied on the model stream at
    its first layer, nothing started earlier; no side stream."""

    def start(self, ids: torch.Tensor) -> Any:
        return self.m.buffers(ids)

    def layer(self, buf: Any, layer: int) -> torch.Tensor:
        p, k = self.at[layer]
        if k == 0:
            torch.ops.ray_ple.pull(buf[p], self.m.slots[p][0])
        return buf[p][:, k * D:(k + 1) * D]


class HeadLate(Late):
    """H / U (`--extra head`): L with layer 0's rows from the worker's own copy of layer 0's
    columns (H: in device memory, 1/42 of the table; U: registered host memory, read by UVA
    loads), so no arrival is on layer 0's gate. Part 0 is still pulled (the one transaction
    covers every part) and joined after the last layer, off the critical path; its rows are
    checked against the head's."""

    def __init__(self, late: rig.LateStandIn, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(late)
        if late.widths[0] * 2 != D:
            raise ValueError("the head variants need part 0 to be layer 0 alone (1+...)")
        self.head = head

    def start(self, ids: torch.Tensor) -> Any:
        return self.m.pull(ids), self.head(ids)

    def layer(self, buf: Any, layer: int) -> torch.Tensor:
        parts, head = buf
        if layer == 0:
            return head
        p, k = self.at[layer]
        if k == 0:
            self.m.wait(parts, p)
        if layer == LAYERS - 1:
            self.m.wait(parts, 0)
        return parts[p][:, k * D:(k + 1) * D]

    def check(self, buf: Any, ids: torch.Tensor) -> torch.Tensor:
        parts, head = buf
        return self.m.check(parts, ids) + (head.view(torch.int32)
                                           != parts[0].view(torch.int32)).sum()


class Resident(Late):
    """R (`--extra resident`): `ple.resident_layers: 1` as the product runs it. Layer 0's
    columns sit in device memory (1/42 of the table) and are looked up before layer 0; the
    pair's geometry offloads layers 1-41 only (`resident_layers=1`), in parts of 1, 2, 4, 8,
    26 layers, each joined at its first layer's gate. The head's rows share one flat buffer,
    and one indexed check, with the parts' (the same check as `L`'s over a whole row)."""

    def __init__(self, late: rig.LateStandIn, head: torch.Tensor) -> None:
        super().__init__(late)
        self.head, self.at = head, [(-1, 0), *self.at]  # layer 0: the head
        self.head_words = head.shape[1] // 2
        self.maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, ids: torch.Tensor) -> Any:
        """The head's lookup, the part buffers, then every part's start."""
        t, m = ids.shape[0], self.m
        parts = rig.PartBuffers()
        parts.flat = torch.empty(t * (self.head_words + sum(m.widths)) * 2,
                                 dtype=torch.bfloat16, device=ids.device)
        head = parts.flat[:t * self.head_words * 2].view(t, self.head_words * 2)
        torch.index_select(self.head, 0, ids, out=head)
        at = head.numel()
        for w in m.widths:
            parts.append(parts.flat[at:at + t * w * 2].view(t, w * 2))
            at += t * w * 2
        m.start(parts)
        return head, parts

    def layer(self, buf: Any, layer: int) -> torch.Tensor:
        head, parts = buf
        p, k = self.at[layer]
        if p < 0:
            return head
        if k == 0:
            self.m.wait(parts, p)
        return parts[p][:, k * D:(k + 1) * D]

    def check(self, buf: Any, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[0]
        if t not in self.maps:  # built on the eager warm-up forward; a capture only reads
            tok, col = self.m.index_maps(t, ids.device)
            hw = self.head_words
            self.maps[t] = (
                torch.cat([torch.arange(t, dtype=torch.int32).repeat_interleave(hw).to(
                    ids.device), tok]),
                torch.cat([torch.arange(hw, dtype=torch.int32).repeat(t).to(ids.device), col]))
        tok, col = self.maps[t]
        expect = (ids.to(torch.int32) * self.m.words).index_select(0, tok) + col
        return (buf[1].flat.view(torch.int32) != expect).sum()


def parse_split(spec: str) -> tuple[int, ...]:
    """`7` -> seven parts of 6 layers; `1+2+4+8+27` -> those layers per part, in order."""
    if "+" in spec:
        split = tuple(int(x) for x in spec.split("+"))
    else:
        n = int(spec)
        if n < 1 or LAYERS % n:
            raise ValueError(f"{spec}: not a divisor of {LAYERS} (write unequal parts as a+b+...)")
        split = (LAYERS // n,) * n
    if sum(split) != LAYERS or min(split) < 1:
        raise ValueError(f"{spec}: parts must cover the {LAYERS} layers")
    return split


def split_label(split: tuple[int, ...]) -> str:
    return f"P{len(split)}" if len(set(split)) == 1 else "s" + "-".join(map(str, split))


class Stack(torch.nn.Module):
    """The E4B-shaped forward around one PLE source.

    `draft` > 0 shapes every step as a speculative verification step: T / (draft + 1)
    sequences, each its sampled id followed by `draft` draft ids that repeat the sequence's
    ids of the step before, as an n-gram drafter proposes tokens already seen.
    """

    draft = 0

    def __init__(self, w: Weights, source: Any, rows: int) -> None:
        super().__init__()
        self.w, self.src, self.rows = w, source, rows

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.w.embed[ids % EMBED_ROWS]
        st = self.src.start(ids)
        for layer in range(LAYERS):
            h = self.layer(h, st, layer)
        bad, nxt = self.end(st, ids)
        return bad, nxt, h

    def layer(self, h: torch.Tensor, st: Any, layer: int) -> torch.Tensor:
        w, s = self.w, self.w.shape
        hid = (s.hidden,)
        x = F.rms_norm(h, hid, w.norm[0])
        h = h + (x @ w.qkv[layer])[:, :s.q] @ w.o[layer]
        x = F.rms_norm(h, hid, w.norm[1])
        gu = x @ w.gu[layer]
        h = h + (F.gelu(gu[:, :s.inter], approximate="tanh") * gu[:, s.inter:]) @ w.down[layer]
        ple = self.src.layer(st, layer)
        gate = F.gelu(h @ w.gate[layer], approximate="tanh") * ple
        return h + F.rms_norm(gate @ w.proj[layer], hid, w.norm[2])

    def end(self, st: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Wrong words of the step, and the next step's ids."""
        bad = self.src.check(st, ids)
        t = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
        nxt = ((ids * 1103515245 + 12345 + t * 7919) % 2147483648) % self.rows
        if self.draft:
            seqs, k = nxt.view(-1, self.draft + 1), self.draft
            nxt = torch.cat([seqs[:, k:], ids.view(-1, k + 1)[:, :k]], dim=1).reshape(-1)
        return bad, nxt


class UvaRows(torch.nn.Module):
    """B: rows read by SM loads straight from the registered host table."""

    def __init__(self, table_dev: int, rows: int, device: int, elems: int = ROW_ELEMS) -> None:
        super().__init__()
        from bench.cuda.uva_gather import UvaGather

        self.table_dev, self.rows, self.k = table_dev, rows, UvaGather(device)
        self.elems = elems

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty((ids.shape[0], self.elems), dtype=torch.bfloat16, device=ids.device)
        ids32 = ids.to(torch.int32)
        self.k.launch(self.table_dev, ids32.data_ptr(), out.data_ptr(), ids.shape[0],
                      self.elems * 2, self.rows, torch.cuda.current_stream().cuda_stream)
        return out


class TableRows(torch.nn.Module):
    """A: rows from a table in this device's memory."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.table, 0, ids)


def pull_whole(ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty((ids.shape[0], ROW_ELEMS), dtype=torch.bfloat16, device=ids.device)
    torch.ops.ray_ple.pull(out, rig.LAYER)
    return out


@contextlib.contextmanager
def copy_constants(update: dict[str, int]) -> Iterator[None]:
    """The CUDA transport's copy constants set to `update` for the duration (a graph takes
    them at its capture), restored after."""
    saved = {k: getattr(cuda_transport, k) for k in update}
    for k, v in update.items():
        setattr(cuda_transport, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cuda_transport, k, v)


# the closed loop ------------------------------------------------------------------------------
class Loop:
    """One forward captured in a CUDA graph (eager on CPU), stepped closed loop."""

    def __init__(self, model: torch.nn.Module, ids0: torch.Tensor, pair: Any = None,
                 piecewise: bool = False) -> None:
        self.model, self.pair = model, pair
        self.dev = ids0.device
        self.cuda = self.dev.type == "cuda"
        self.ids, self.err = ids0.clone(), torch.zeros((), dtype=torch.int64, device=self.dev)
        self.host_ids = torch.empty(ids0.shape[0], dtype=torch.int32, pin_memory=self.cuda)
        self.host_ids.copy_(ids0)
        self.ids32 = ids0.to(torch.int32)  # what a stream post reads (vLLM's int32 ids)
        self.record = self.captured = self.pieces = None
        if not self.cuda:
            return
        if piecewise:
            self._capture_pieces(model, ids0)
            return
        reg = rig.registered(pair) if pair else contextlib.nullcontext()
        local = pair.local_forward() if pair else contextlib.nullcontext()
        with reg, local:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(self.ids)  # warm-up: a local forward (zero rows, nothing posted)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                bad, nxt, _ = model(self.ids)
                self.err.add_(bad)
                self.ids.copy_(nxt)
                self.ids32.copy_(nxt)
                self.host_ids.copy_(self.ids32, non_blocking=True)
        if pair is not None:
            self.record = rig.newest_capture(pair, ids0.shape[0])
        self.err.zero_()
        self.ids.copy_(ids0)
        torch.cuda.synchronize()

    def _capture_pieces(self, stack: Stack, ids0: torch.Tensor) -> None:
        """`stack` as vLLM's piecewise graphs run it (`--extra piecewise`): the first piece
        (embedding, row buffers), a piece per layer, a last piece (check, next ids);
        captured as one local forward, replays declared to no one."""
        pair, s = self.pair, {}

        def head() -> None:
            s["h"] = stack.w.embed[self.ids % EMBED_ROWS]
            s["st"] = stack.src.start(self.ids)

        def layer(k: int) -> None:
            s["h"] = stack.layer(s["h"], s["st"], k)

        def end() -> None:
            bad, nxt = stack.end(s["st"], self.ids)
            self.err.add_(bad)
            self.ids.copy_(nxt)
            self.ids32.copy_(nxt)
            self.host_ids.copy_(self.ids32, non_blocking=True)

        segs = [(True, head), *((True, lambda k=k: layer(k)) for k in range(LAYERS))]
        self.pieces = rig.Pieces([*segs, (True, end)])
        reg = rig.registered(pair) if pair else contextlib.nullcontext()
        local = pair.local_forward() if pair else contextlib.nullcontext()
        with reg, local:
            self.pieces.capture()
        if pair is not None:
            self.captured = rig.newest_capture(pair, ids0.shape[0])
        self.err.zero_()
        self.ids.copy_(ids0)
        self.ids32.copy_(ids0)
        self.host_ids.copy_(ids0)
        torch.cuda.synchronize()

    def _forward(self) -> None:
        if self.pieces is not None:
            self.pieces.replay()
            return
        if self.cuda:
            self.graph.replay()
            return
        bad, nxt, _ = self.model(self.ids)
        self.err.add_(bad)
        self.ids.copy_(nxt)
        self.host_ids.copy_(nxt)

    def run(self, n: int, launch_first: bool = False, pre: bool = False,
            stream: bool = False, ahead: bool = False) -> tuple[list[float], list[float], int]:
        """n closed-loop steps; per-step wall stamps, host post times, wrong words. `pre`:
        launch only once the host sees every part published (the GPU never waits a flag);
        `stream`: the stream posts (host post time: the announcement and the enqueue);
        `ahead`: step s is enqueued once step s-2 has finished (async scheduling); the
        host's time to enqueue each such step is kept in `self.enqueue_s` (a step whose host
        work is longer than its GPU work is paced by the host)."""
        pair, stamps, posts = self.pair, [], []
        self.enqueue_s: list[float] = []
        sync = torch.cuda.current_stream().synchronize if self.cuda else (lambda: None)
        eager_ops = not self.cuda or self.pieces is not None  # ops whose Python runs per step
        reg = rig.registered(pair) if (pair and eager_ops) else contextlib.nullcontext()
        done: list[Any] = []
        with reg:
            for i in range(n):
                if ahead:  # the engine waits for the tokens of the step before the last
                    if i >= 2:
                        done[i - 2].synchronize()
                    done.append(torch.cuda.Event())
                else:
                    sync()  # the engine's wait for its sampled tokens
                stamps.append(time.perf_counter())
                if ahead and not stream:
                    self._forward()
                    done[i].record()
                    self.enqueue_s.append(time.perf_counter() - stamps[i])
                    continue
                host = self.host_ids.numpy()
                if pair is None:
                    self._forward()
                    continue
                if stream:
                    t0 = time.perf_counter()
                    with pair.stream_step(self.ids32):
                        posts.append(time.perf_counter() - t0)
                        self._forward()
                    if ahead:
                        done[i].record()
                        self.enqueue_s.append(time.perf_counter() - stamps[i])
                    continue
                if launch_first:
                    self._forward()
                t0 = time.perf_counter()
                with pair.step(host) as step:
                    while pre and any(pair.block.published(i) != step
                                      for i in range(len(pair.handle.slot_names))):
                        pass
                    posts.append(time.perf_counter() - t0)  # pre: the post and the gather
                    if not launch_first:
                        self._forward()
            sync()
        stamps.append(time.perf_counter())
        return stamps, posts, int(self.err.item())


def stats(stamps: list[float], warm: int) -> dict[str, float]:
    d = np.diff(np.asarray(stamps))[warm:] * 1e6
    return {"median_us": round(float(np.median(d)), 2),
            "p10_us": round(float(np.percentile(d, 10)), 2),
            "p99_us": round(float(np.percentile(d, 99)), 2), "steps": int(d.size)}


# setup --------------------------------------------------------------------------------------
class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.device = torch.device("cpu" if a.tiny else "cuda")
        self.transport = "cpu" if a.tiny else "cuda"
        self.rows = a.rows
        self.out = a.out / "model.jsonl"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.lines: list[dict[str, Any]] = []
        self.t_start = time.perf_counter()
        self.offloads: list[rig.OffloadProcess] = []
        self.pairs: dict[tuple[int, bool], Any] = {}
        self.geos: dict[tuple[int, ...], Any] = {}
        self.resident_pairs: dict[bool, Any] = {}

    def setup(self) -> None:
        a, max_t = self.a, max(self.tokens())
        t0 = time.perf_counter()
        ckpt = rig.write_pattern_checkpoint(a.work / "ckpt", self.rows, ROW_ELEMS)
        self.info: dict[str, Any] = {"table_write_s": round(time.perf_counter() - t0, 2)}
        # offload processes per part count (and per gather width: `serve`)
        for p in dict.fromkeys([(LAYERS,), *self.parts(), *self.splits()]):
            geo = rig.geometry(self.rows, max_t, p if len(p) > 1 else (), row_elems=ROW_ELEMS)
            self.geos[p] = geo
            for big, pair in self.serve(ckpt, geo, split_label(p)).items():
                self.pairs[p, big] = pair
        if "resident" in a.extra:  # `ple.resident_layers: 1`: layers 1-41 offloaded
            geo = rig.geometry(self.rows, max_t, RESIDENT_SPLIT[1:], row_elems=ROW_ELEMS,
                               resident_layers=1)
            self.geos[RESIDENT_SPLIT] = geo
            self.resident_pairs = self.serve(ckpt, geo, "resident")
        self.info["offload_setup_s"] = round(time.perf_counter() - t0, 2)
        view = rig.table_view(ckpt)
        if self.device.type == "cuda":
            self.table_gpu = torch.from_numpy(np.ascontiguousarray(view)).cuda().view(
                torch.bfloat16)
            fd = os.open(ckpt, os.O_RDWR)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            keep = np.frombuffer(mm, dtype=np.uint8)
            from ray_ple.worker.transport.cuda_host import register_host

            reg = register_host(int(keep.ctypes.data), page_align(size), keep,
                                what="whole PLE table (variant B)")
            self.table_dev = reg.device_ptr + (size - self.rows * ROW_BYTES)
            if "head" in a.extra:  # layer 0's columns in registered host memory (U)
                hb = self.rows * D * 2
                self.head_mm = mmap.mmap(-1, page_align(hb))
                head = np.frombuffer(self.head_mm, dtype=np.uint8)
                head[:hb].reshape(self.rows, D * 2)[:] = view[:, :D * 2]
                hreg = register_host(int(head.ctypes.data), page_align(hb), head,
                                     what="layer 0's columns (variant U)")
                self.head_dev = hreg.device_ptr
                self.head_reg = (reg, hreg)
        else:
            self.table_gpu = torch.from_numpy(np.ascontiguousarray(view)).view(torch.bfloat16)
        if "head" in a.extra or "resident" in a.extra:  # layer 0's columns on the device
            self.head_gpu = self.table_gpu[:, :D].contiguous()
        self.weights = Weights(Shape(a.tiny), self.device)
        self.info["setup_s"] = round(time.perf_counter() - t0, 2)

    def serve(self, ckpt: Path, geo: Any, label: str) -> dict[bool, Any]:
        """Offload processes serving `geo`, one per gather width (`gather_threads` for the
        decode sizes, `gather_threads_big` above 256 tokens: a pool per part costs more than
        it saves on small steps, docs/history.md), and this process's pair of each."""
        pairs: dict[bool, Any] = {}
        for big, threads in {False: self.a.gather_threads, True: self.a.gather_threads_big}.items():
            off = rig.OffloadProcess(ckpt.parent, geo, spin_us=self.a.spin_us,
                                     actor_name=f"bench-model-{label}-{threads}",
                                     gather_threads=threads)
            self.offloads.append(off)
            first = not self.pairs and not pairs
            pairs[big] = (rig.attach(off.handle, geo, self.transport) if first
                          else rig.attach_another(off.handle, geo, self.transport))
        return pairs

    def tokens(self) -> list[int]:
        return [int(x) for x in self.a.tokens.split(",")]

    def parts(self) -> list[tuple[int, ...]]:
        return [parse_split(x) for x in self.a.parts.split(",")]

    def splits(self) -> list[tuple[int, ...]]:
        return [parse_split(x) for x in self.a.splits.split(",") if x]

    def close(self) -> None:
        for off in self.offloads:
            with contextlib.suppress(Exception):
                off.close()

    # measuring ---------------------------------------------------------------------------
    def emit(self, **row: Any) -> None:
        self.lines.append(row)
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def measure(self, consumer: str, t: int, variant: str, model: torch.nn.Module,
                pair: Any, n: int, warm: int, launch_first: bool = False, pre: bool = False,
                stream: bool = False, ahead: bool = False, **extra: Any) -> None:
        if self.a.variants and variant not in self.a.variants.split(","):
            return
        if (launch_first or stream or ahead) and self.device.type != "cuda":
            return  # eager on CPU: a forward launched before its post would pull unposted;
            # a stream post needs a stream
        ids0 = torch.from_numpy(rig.first_ids(t, self.rows, t)).to(self.device)
        if isinstance(extra.get("parts"), tuple):
            split = extra["parts"]
            extra.update(parts=len(split) if len(split) > 1 else 1, split=list(split))
        if pair is not None:
            extra["gather_threads"] = (self.a.gather_threads_big if t > 256
                                       else self.a.gather_threads)
        t0 = time.perf_counter()
        loop = Loop(model, ids0, pair, piecewise="_pw" in variant)
        capture_s = time.perf_counter() - t0
        stamps, posts, wrong = loop.run(n + warm, launch_first, pre, stream, ahead)
        row = {"consumer": consumer, "T": t, "variant": variant, **stats(stamps, warm),
               "wrong_words": wrong, "capture_s": round(capture_s, 2), **extra}
        if posts:
            row["host_post_us"] = round(float(np.median(posts[warm:])) * 1e6, 2)
        if loop.enqueue_s:
            row["host_enqueue_us"] = round(float(np.median(loop.enqueue_s[warm:])) * 1e6, 2)
        if pre:  # the step less its host wait for every part: what the GPU side costs
            row["less_host_us"] = round(float(np.median(
                np.diff(np.asarray(stamps))[warm:] - np.asarray(posts[warm:]))) * 1e6, 2)
        if loop.record is not None:
            row["copies"] = sorted({f"{c.mode}{'-late' if c.late else ''}"
                                    for c in loop.record.copies})
        if loop.captured is not None:  # piecewise: what the pieces copy
            row["copies"] = sorted({c.mode for c in loop.captured.copies})
        self.emit(**row)
        del loop
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def sources(self, t: int) -> dict[str, tuple[Any, Any]]:
        """variant -> (PLE source for the model stack, the pair it pulls from)."""
        dev = self.device
        out: dict[str, tuple[Any, Any]] = {
            "A": (Whole(TableRows(self.table_gpu), self.rows, dev), None)}
        if dev.type == "cuda":
            out["B"] = (Whole(UvaRows(self.table_dev, self.rows, dev.index or 0), self.rows, dev),
                        None)
        out["C"] = (Whole(pull_whole, self.rows, dev), self.pairs[(LAYERS,), t > 256])
        return out

    def late_source(self, p: tuple[int, ...], indexed: bool = False) -> Late:
        return Late(rig.LateStandIn(self.rows, self.geos[p], ROW_ELEMS,
                                    indexed=indexed).to(self.device))

    def piecewise_runs(self, t: int, srcs: dict[str, tuple[Any, Any]], main_stack: Stack,
                       main: tuple[int, ...]) -> list[tuple[str, Stack, Any, tuple[int, ...]]]:
        """`--extra piecewise`: A, B and the in-piece pulls, each as vLLM's piecewise graphs
        run a mixed prefill batch."""
        pair = self.pairs[main, t > 256]
        inline = Stack(self.weights, Inline(self.late_source(main, indexed=True).m), self.rows)
        runs = [(f"{name}_pw_as", Stack(self.weights, srcs[name][0], self.rows), None,
                 (LAYERS,)) for name in ("A", "B")]
        runs.append(("L_in_pw_sp_as", inline, pair, main))
        return runs

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t_start > self.a.budget_s

    def run_model(self) -> None:
        a, main = self.a, self.parts()[0]
        for t in self.tokens():
            n, warm = (a.steps, a.warm) if t <= 256 else (a.big_steps, 3)
            srcs = self.sources(t)
            for name, (src, pair) in srcs.items():
                self.measure("model", t, name, Stack(self.weights, src, self.rows), pair, n, warm,
                             parts=1)
            late = Stack(self.weights, self.late_source(main), self.rows)
            pair = self.pairs[main, t > 256]
            self.measure("model", t, "L", late, pair, n, warm, parts=main)
            self.measure("model", t, "L_lf", late, pair, n, warm, True, parts=main)
            self.measure("model", t, "L_sp", late, pair, n, warm, stream=True, parts=main)
            self.late_caps(t, late, pair, n, warm, main)
            if "pre" in a.extra:
                c_src, c_pair = srcs["C"]
                self.measure("model", t, "C_pre", Stack(self.weights, c_src, self.rows), c_pair,
                             n, warm, pre=True, parts=1)
                self.measure("model", t, "L_pre", late, pair, n, warm, pre=True, parts=main)
            if self.over_budget():
                print(json.dumps({"skipped": "budget", "after_T": t}), flush=True)
                return

    def late_specs(self) -> dict[str, dict[str, int]]:
        """`--late-options` as {name: {copy constant of the CUDA transport: value}}."""
        specs = {}
        for spec in filter(None, self.a.late_options.split(";")):
            name, _, fields = spec.partition(":")
            specs[name] = {k.upper(): int(v)
                           for k, v in (f.split("=") for f in fields.split(",") if f)}
            unknown = [k for k in specs[name] if k not in COPY_CONSTANTS]
            if unknown:
                raise ValueError(f"--late-options {name}: {unknown} not in {COPY_CONSTANTS}")
        return specs

    def late_caps(self, t: int, late: torch.nn.Module, pair: Any, n: int, warm: int,
                  parts: int) -> None:
        """`L` under each set of `--late-options` (the transport's copy constants, baked
        into the graph at capture), interleaved over `--cap-rounds` rounds in this process."""
        specs = self.late_specs()
        if not specs or pair is None or pair.transport.name != "cuda":
            return
        for r in range(self.a.cap_rounds):
            for name in list(specs) if r % 2 == 0 else list(specs)[::-1]:
                with copy_constants(specs[name]):
                    self.measure("model", t, f"L_{name}", late, pair, n, warm, parts=parts,
                                 round=r, options=specs[name])
                    if "pre" in self.a.extra:  # the GPU side alone under these options
                        self.measure("model", t, f"L_pre_{name}", late, pair, n, warm,
                                     pre=True, parts=parts, round=r, options=specs[name])

    def run_parts(self) -> None:
        """The model's L at other part counts (both orders), at fewer token counts."""
        a = self.a
        for t in [int(x) for x in a.parts_tokens.split(",") if x]:
            n, warm = (a.steps, a.warm) if t <= 256 else (a.big_steps, 3)
            for p in self.parts()[1:]:
                late = Stack(self.weights, self.late_source(p), self.rows)
                pair = self.pairs[p, t > 256]
                name = f"L_{split_label(p)}"
                self.measure("model", t, name, late, pair, n, warm, parts=p)
                self.measure("model", t, f"{name}_lf", late, pair, n, warm, True, parts=p)
                if self.over_budget():
                    print(json.dumps({"skipped": "budget", "parts_after_T": t}), flush=True)
                    return

    def run_splits(self) -> None:
        """L under each `--splits` layout (a pair of its own per split), interleaved with A,
        B and the main L (posted then launched, and `L_lf` launched then posted) over
        `--split-rounds` rounds, order alternating: the same machine
        state for every split of a round. Every split is checked through the same index
        maps (`indexed`), so a split's check costs the same whatever its widths; `L` keeps
        the main split's broadcast check, which prices the index check (`L` vs `L_<main>`)."""
        a, main = self.a, self.parts()[0]
        for t in self.tokens():
            n, warm = (a.steps, a.warm) if t <= 256 else (a.big_steps, 3)
            srcs = self.sources(t)
            runs: list[tuple[str, Stack, Any, tuple[int, ...]]] = [
                (name, Stack(self.weights, src, self.rows), pair, (LAYERS,))
                for name, (src, pair) in srcs.items() if name in ("A", "B")]
            main_stack = Stack(self.weights, self.late_source(main), self.rows)
            runs.append(("L", main_stack, self.pairs[main, t > 256], main))
            runs.append(("L_lf", main_stack, self.pairs[main, t > 256], main))
            runs.append(("L_sp", main_stack, self.pairs[main, t > 256], main))
            if "inline" in a.extra:
                inline = Stack(self.weights, Inline(self.late_source(main, indexed=True).m),
                               self.rows)
                runs += [("L_in", inline, self.pairs[main, t > 256], main),
                         ("L_in_sp", inline, self.pairs[main, t > 256], main)]
            if "ahead" in a.extra:
                runs += [(f"{name}_as", model, pair, sp) for name, model, pair, sp in runs
                         if name in ("A", "B", "L_sp", "L_in_sp")]
            if "piecewise" in a.extra and self.device.type == "cuda":
                runs += self.piecewise_runs(t, srcs, main_stack, main)
            for sp in self.splits():
                runs.append((f"L_{split_label(sp)}", Stack(
                    self.weights, self.late_source(sp, indexed=True), self.rows),
                    self.pairs[sp, t > 256], sp))
            if "head" in a.extra:  # (on CPU, H alone and host-posted: a smoke test)
                heads: dict[str, Any] = {"H": TableRows(self.head_gpu)}
                if self.device.type == "cuda":
                    heads = {"H_sp_as": heads["H"], "U_sp_as": UvaRows(
                        self.head_dev, self.rows, self.device.index or 0, elems=D)}
                for name, fetch in heads.items():
                    src = HeadLate(self.late_source(main, indexed=True).m, fetch)
                    runs.append((name, Stack(self.weights, src, self.rows),
                                 self.pairs[main, t > 256], main))
            if "resident" in a.extra:  # (on CPU, host-posted: a smoke test)
                src = Resident(rig.LateStandIn(self.rows, self.geos[RESIDENT_SPLIT], ROW_ELEMS,
                                               indexed=True).to(self.device), self.head_gpu)
                runs.append(("R_sp_as" if self.device.type == "cuda" else "R",
                             Stack(self.weights, src, self.rows), self.resident_pairs[t > 256],
                             RESIDENT_SPLIT))
            opts = self.late_specs()  # the class's structure under each --late-options
            if "ahead" in a.extra and self.device.type == "cuda":
                runs += [(f"L_sp_as_{o}", main_stack, self.pairs[main, t > 256], main)
                         for o in opts]
            for r in range(a.split_rounds):
                for name, model, pair, sp in (runs if r % 2 == 0 else runs[::-1]):
                    o = name.removeprefix("L_sp_as_") if name.startswith("L_sp_as_") else None
                    with copy_constants(opts[o] if o else {}):
                        self.measure("model", t, name, model, pair, n, warm, name == "L_lf",
                                     stream="_sp" in name, ahead=o is not None or
                                     name.endswith("_as"),
                                     parts=sp, round=r, **({"options": opts[o]} if o else {}))
                if self.over_budget():
                    print(json.dumps({"skipped": "budget", "splits_after_T": t, "round": r}),
                          flush=True)
                    return

    def run_synthetic(self) -> None:
        a, main = self.a, self.parts()[0]
        for t in self.tokens():
            n, warm = (a.syn_steps, a.warm) if t <= 256 else (a.big_steps * 2, 3)
            models: dict[str, tuple[torch.nn.Module, Any]] = {}
            base = rig.StandIn(self.rows, ROW_ELEMS).to(self.device)
            base.ple = TableRows(self.table_gpu)
            models["A"] = (base, None)
            if self.device.type == "cuda":
                b = rig.StandIn(self.rows, ROW_ELEMS).to(self.device)
                b.ple = UvaRows(self.table_dev, self.rows, self.device.index or 0)
                models["B"] = (b, None)
            models["C"] = (rig.StandIn(self.rows, ROW_ELEMS).to(self.device),
                           self.pairs[(LAYERS,), t > 256])
            late = rig.LateStandIn(self.rows, self.geos[main], ROW_ELEMS).to(self.device)
            models["L"] = (late, self.pairs[main, t > 256])
            for name, (m, pair) in models.items():
                self.measure("synthetic", t, name, m, pair, n, warm,
                             parts=main if name == "L" else 1)
            self.measure("synthetic", t, "L_lf", late, self.pairs[main, t > 256], n, warm,
                         True, parts=main)
            self.measure("synthetic", t, "L_sp", late, self.pairs[main, t > 256], n, warm,
                         stream=True, parts=main)
            if "ahead" in a.extra:
                for name in ("A", "B", "L"):
                    if name in models:
                        m, pair = models[name]
                        self.measure("synthetic", t, f"{name}_as" if name != "L" else "L_sp_as",
                                     m, pair, n, warm, stream=name == "L", ahead=True,
                                     parts=main if name == "L" else 1)
            if self.over_budget():
                print(json.dumps({"skipped": "budget", "synthetic_after_T": t}), flush=True)
                return


def run_turnaround(b: Bench) -> None:
    """Post -> each slot's flag, seen by the host (the offload side's publish times).

    The forward is launched only once every flag is up, so the GPU takes no part in these
    times: they say when each part could reach the GPU at the earliest."""
    a, main = b.a, b.parts()[0]
    for t in b.tokens():
        n = 100 if t <= 256 else 8
        for p in dict.fromkeys([(LAYERS,), main, *b.splits()]):
            pair = b.pairs[p, t > 256]
            model = (rig.StandIn(b.rows, ROW_ELEMS) if len(p) == 1 else
                     rig.LateStandIn(b.rows, b.geos[p], ROW_ELEMS)).to(b.device)
            loop = Loop(model, torch.from_numpy(rig.first_ids(t, b.rows, t)).to(b.device), pair)
            flags = pair.block.flags
            seen: list[list[float]] = [[] for _ in flags]
            for _ in range(n + 5):
                torch.cuda.current_stream().synchronize()
                host = loop.host_ids.numpy()
                t0 = time.perf_counter()
                with pair.step(host):
                    pending, deadline = list(range(len(flags))), t0 + 10
                    while pending and time.perf_counter() < deadline:
                        now = time.perf_counter()
                        for j in [j for j in pending if int(flags[j][0]) == 1]:
                            seen[j].append(now - t0)
                            pending.remove(j)
                    loop.graph.replay()
            torch.cuda.synchronize()
            b.emit(consumer="turnaround", T=t, variant="C" if len(p) == 1 else "L",
                   parts=len(p), split=list(p),
                   gather_threads=a.gather_threads_big if t > 256 else a.gather_threads,
                   flag_up_us=[round(float(np.median(v[5:])) * 1e6, 1) for v in seen],
                   wrong_words=int(loop.err.item()))


def print_tables(lines: list[dict[str, Any]]) -> None:
    """Per T and variant: the median over rounds of the step's median, added over A of the
    same round (an `_as` variant over `A_as`: both run as async scheduling), each round's
    figure in brackets where there were several."""
    for consumer in ("model", "synthetic"):
        rows = [r for r in lines if r["consumer"] == consumer]
        print(f"\n{consumer}: median us per step over rounds, added vs A [per round] | p99 | "
              "wrong words | host post us")
        for t in dict.fromkeys(r["T"] for r in rows):
            at = [r for r in rows if r["T"] == t]
            base = {(r["variant"], r.get("round", 0)): r["median_us"] for r in at
                    if r["variant"] in ("A", "A_as", "A_pw_as")}
            cells = []
            for v in dict.fromkeys(r["variant"] for r in at):
                rs = [r for r in at if r["variant"] == v]
                a = ("A_pw_as" if "_pw" in v else
                     "A_as" if v.endswith("_as") or v.startswith("L_sp_as_") else "A")
                added = [r["median_us"] - base.get((a, r.get("round", 0)), 0.0) for r in rs]
                posts = [r["host_post_us"] for r in rs if "host_post_us" in r]
                cell = (f"{v}={np.median([r['median_us'] for r in rs]):.1f}"
                        f"({np.median(added):+.1f})")
                if len(rs) > 1:
                    cell += "[" + ",".join(f"{x:+.0f}" for x in added) + "]"
                cell += (f"/p99 {np.median([r['p99_us'] for r in rs]):.0f}"
                         f"/w{sum(r['wrong_words'] for r in rs)}")
                if posts:
                    cell += f"/post {np.median(posts):.0f}"
                cells.append(cell)
            print(f"T={t}: " + "  ".join(cells))


def summarize(path: Path) -> None:
    """The tables of a recorded run (`--summarize <run>/model.jsonl`)."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    print_tables([r for r in lines if r.get("consumer") in ("model", "synthetic")])
    for r in lines:
        if r.get("consumer") == "turnaround":
            # records before unequal splits carry only the part count (`split` absent)
            label = split_label(tuple(r["split"])) if r.get("split") else f"P{r['parts']}"
            print(f"turnaround T={r['T']} {label}: flag up (us after the post) "
                  f"{r['flag_up_us']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--tokens", default="1,8,64,256,8192")
    ap.add_argument("--parts", default="7,2,14",
                    help="part counts (divisors of 42) or splits (1+2+4+8+27); the first is L, "
                    "the rest L_P<n> / L_s<split>")
    ap.add_argument("--parts-tokens", default="1,256,8192",
                    help="token counts for the other part counts")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--syn-steps", type=int, default=2000)
    ap.add_argument("--big-steps", type=int, default=12)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--spin-us", type=float, default=20000)
    ap.add_argument("--gather-threads", type=int, default=1, help="offload, T <= 256")
    ap.add_argument("--gather-threads-big", type=int, default=8, help="offload, T > 256")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--extra", default="", help="comma list: piecewise (A_pw_as, B_pw_as, "
                    "L_in_pw_sp_as: vLLM's piecewise graphs), inline (L_in, L_in_sp), ahead "
                    "(A_as, B_as, L_sp_as, L_in_sp_as: async "
                    "scheduling), pre (C_pre, L_pre: launched once "
                    "the host sees every part published, so no GPU wait is on the path), "
                    "head (H_sp_as, U_sp_as: layer 0's rows from the worker's own copy, on the "
                    "device or registered host memory; needs --parts 1+...), resident "
                    "(R_sp_as: ple.resident_layers 1, the pair offloading layers 1-41)")
    ap.add_argument("--variants", default="", help="comma list: measure only these")
    ap.add_argument("--late-options", default="", help="NAME:CONSTANT=int,...;... copy "
                    "constants of ray_ple.worker.transport.cuda for L, measured as L_NAME, "
                    "interleaved over --cap-rounds (e.g. "
                    "'u:;b4:LATE_COPY_BLOCKS=4;sm:LATE_SM_COPY_MAX_BYTES=1048576')")
    ap.add_argument("--cap-rounds", type=int, default=4)
    ap.add_argument("--splits", default="", help="comma list of splits (as --parts) measured "
                    "as L_<split>, interleaved with A, B and L over --split-rounds")
    ap.add_argument("--split-rounds", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of model,parts,splits,synthetic,"
                    "turnaround to skip")
    ap.add_argument("--draft", type=int, default=0, help="shape each step as a speculative "
                    "verification step: T / (DRAFT + 1) sequences of a sampled id and DRAFT "
                    "draft ids (every --tokens value a multiple of DRAFT + 1)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (transport cpu)")
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/ray-ple-bench-model"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarize", type=Path, help="print the tables of a recorded model.jsonl")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return
    if a.out is None:
        ap.error("--out is required")
    if a.draft < 0 or any(int(t) % (a.draft + 1) for t in a.tokens.split(",")):
        ap.error(f"--draft {a.draft}: every --tokens value must be a multiple of {a.draft + 1}")
    Stack.draft = a.draft
    for spec in [x for x in f"{a.parts},{a.splits}".split(",") if x]:
        try:
            parse_split(spec)
        except ValueError as exc:
            ap.error(f"--parts/--splits {exc}")
    b = Bench(a)
    skip = set(a.skip.split(","))
    try:
        b.setup()
        b.emit(consumer="info", **b.info, gpu=torch.cuda.get_device_name()
               if b.device.type == "cuda" else "cpu", torch=torch.__version__,
               args={k: str(v) for k, v in vars(a).items()})
        if "model" not in skip:
            b.run_model()
        if "synthetic" not in skip:
            b.run_synthetic()
        if "parts" not in skip:
            b.run_parts()
        if "splits" not in skip and b.splits():
            b.run_splits()
        if "turnaround" not in skip and b.device.type == "cuda":
            run_turnaround(b)
        status = [off.status() for off in b.offloads]
        b.emit(consumer="info", offload_status=[
            {k: s[k] for k in ("state", "posted", "released", "cuda_evidence", "torch_imported",
                               "cuda_libraries_mapped", "table_inodes")} for s in status])
    finally:
        b.close()
        shutil.rmtree(a.work, ignore_errors=True)  # the checkpoint written for the offload side
    print_tables([r for r in b.lines if r.get("consumer") in ("model", "synthetic")])


if __name__ == "__main__":
    main()
