"""A real pair without vLLM: an offload process and a worker process over real shared memory.

Used by the transaction and table tests; each side is a separate OS process (spawned), the
offload side is the project's `OffloadActor` outside Ray, the worker side its `WorkerPair`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np

from ray_ple.config import PleConfig
from ray_ple.engine_plan import table_sources
from ray_ple.offload.actor import OffloadSpec
from ray_ple.protocol.geometry import PleGeometry, geometry_from_config, read_hf_config

CTX = mp.get_context("spawn")


def write_checkpoint(path: Path, rows: int, layers: int = 4, ple_dim: int = 8,
                     seed: int = 0) -> np.ndarray:
    """A checkpoint with a Gemma 4 config and only its PLE table (bf16 as raw uint16)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
           "num_hidden_layers": layers, "hidden_size_per_layer_input": ple_dim,
           "vocab_size_per_layer_input": rows, "vocab_size": rows + 64, "dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, layers * ple_dim, generator=gen).to(torch.bfloat16)
    save_file({"model.embed_tokens_per_layer.weight": table}, str(path / "model.safetensors"))
    return table.view(torch.uint16).numpy().view(np.uint8).reshape(rows, -1).copy()


def spec_for(ckpt: Path, max_tokens: int, rank: int = 0, **ple: Any) -> OffloadSpec:
    cfg = PleConfig(**ple)
    geometry = geometry_from_config(read_hf_config(ckpt), max_tokens=max_tokens)
    return OffloadSpec(rank=rank, actor_name=f"rig-{rank}", geometry=geometry,
                       sources=table_sources(geometry, str(ckpt), None), config=cfg)


def _offload_main(spec: dict, conn) -> None:  # noqa: ANN001
    from ray_ple.offload.actor import OffloadActor

    try:
        actor = OffloadActor(spec)
        conn.send(("ok", actor.setup().model_dump(), os.getpid()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}", os.getpid()))
        return
    conn.recv()  # serve until told to stop (or killed)
    actor.close()


def start_offload(spec: OffloadSpec) -> tuple[Any, dict, Any]:
    """(process, handle dict, pipe); raises RuntimeError with the setup error."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_offload_main, args=(spec.model_dump(), child), daemon=True)
    proc.start()
    status, payload, _ = parent.recv()
    if status != "ok":
        proc.join(5)
        raise RuntimeError(payload)
    return proc, payload, parent


def _worker_main(handle: dict, geometry: dict, steps: list[list[int]], table_path: str,
                 conn, pause_at: int | None = None) -> None:  # noqa: ANN001
    import torch

    from ray_ple.config import PleDeadlines
    from ray_ple.protocol.handles import PairHandle
    from ray_ple.worker.pair import WorkerPair

    expect = np.load(table_path)
    geo = PleGeometry.model_validate(geometry)
    pair = WorkerPair.attach(PairHandle.model_validate(handle), geo, rank=handle["rank"],
                             transport="cpu", deadlines=PleDeadlines(step_s=10.0),
                             heartbeat_s=0.05)
    layer = geo.tables[0]
    bad = 0
    for i, ids in enumerate(steps):
        if pause_at is not None and i == pause_at:
            conn.send(("paused", i))
            conn.recv()
        arr = np.asarray(ids, dtype=np.int32)
        with pair.step(arr):
            out = torch.empty((len(ids), layer.row_elems), dtype=torch.bfloat16)
            pair.pull(0, out)
        mapped = np.where((arr >= 0) & (arr < layer.rows), arr, 0)
        got = out.view(torch.uint8).numpy().reshape(len(ids), layer.row_bytes)
        bad += int((got != expect[mapped]).any(axis=1).sum())
    conn.send(("done", bad))
    conn.recv()


def start_worker(handle: dict, geometry: PleGeometry, steps: list[list[int]], table: np.ndarray,
                 tmp: Path, pause_at: int | None = None) -> tuple[Any, Any]:
    table_path = str(tmp / f"expect-{os.getpid()}-{len(steps)}.npy")
    np.save(table_path, table)
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_worker_main, args=(handle, geometry.model_dump(), steps,
                                                  table_path, child, pause_at), daemon=True)
    proc.start()
    return proc, parent
