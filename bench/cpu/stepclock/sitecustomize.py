"""Bench-only step clock for `bench_serve.py --step-clock`: the same instrument on both sides.

Put on `PYTHONPATH` of both applications' replicas (so every vLLM process they start imports
it), with `RAY_PLE_STEPCLOCK_DIR` set. When vLLM's worker and engine-core modules are first
imported it wraps, on vLLM's own classes (so the plain side, which runs no ray-ple code, is
timed exactly as the offloaded one):

- `Worker.execute_model` (`exec`) and `Worker.sample_tokens` (`sample`) in the worker,
- `GPUModelRunner._model_forward` (`fwd`: the model alone; ray-ple's post and release run
  around it, inside `exec`),
- `EngineCore.step` (`step`) in the engine core,

and writes one line per call, `kind t0_ns t1_ns thread_cpu_ns`, to
`<dir>/<side>-<pid>.txt` once a second (`side` is `ple` when the engine's worker class is
ray-ple's). `RAY_PLE_STEPCLOCK_EXTRA` (`module:Class.method,...`) times more methods the
same way, each named `Class.method` (ray-ple's classes count as the `ple` side, so the
offload actor's loop can be timed too).
Without `RAY_PLE_STEPCLOCK_DIR` it does nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading
import time

_DIR = os.environ.get("RAY_PLE_STEPCLOCK_DIR")
_records: list[str] = []
_lock = threading.Lock()
_side: list[str] = []


def _flusher() -> None:
    while True:
        time.sleep(1.0)
        with _lock:  # appenders never take the lock: take what is there, drop only that
            lines = _records[:]
            del _records[:len(lines)]
        if lines and _side:
            with open(os.path.join(_DIR, f"{_side[0]}-{os.getpid()}.txt"), "a") as f:
                f.write("".join(lines))


def _timed(kind: str, fn, side_of):  # noqa: ANN001, ANN202
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not _side and (side := side_of(self)) != "unknown":
            _side.append(side)
            threading.Thread(target=_flusher, daemon=True, name="stepclock").start()
        c0, t0 = time.thread_time_ns(), time.monotonic_ns()
        try:
            return fn(self, *args, **kwargs)
        finally:
            t1, c1 = time.monotonic_ns(), time.thread_time_ns()
            _records.append(f"{kind} {t0} {t1} {c1 - c0}\n")
    return wrapper


def _worker_side(worker) -> str:  # noqa: ANN001
    return "ple" if type(worker).__name__.startswith("Ple") else "plain"


def _runner_side(runner) -> str:  # noqa: ANN001
    return "ple" if type(runner).__name__.startswith("Ple") else "plain"


def _core_side(core) -> str:  # noqa: ANN001
    return "ple" if "ray_ple" in str(core.vllm_config.parallel_config.worker_cls) else "plain"


def _extra_side(obj) -> str:  # noqa: ANN001
    """ray-ple's own objects (the offload actor's, say) run only on the offloaded side."""
    return "ple" if type(obj).__module__.startswith("ray_ple") else "unknown"


_EXTRA: dict[str, list[str]] = {}
for _item in filter(None, os.environ.get("RAY_PLE_STEPCLOCK_EXTRA", "").split(",")):
    _mod, _attr = _item.split(":")
    _EXTRA.setdefault(_mod, []).append(_attr)


def _patch(name: str, module) -> None:  # noqa: ANN001
    for attr in _EXTRA.get(name, ()):
        cls_name, meth = attr.split(".")
        cls = getattr(module, cls_name)
        setattr(cls, meth, _timed(attr, getattr(cls, meth), _extra_side))
    if name == "vllm.v1.worker.gpu_worker":
        w = module.Worker
        w.execute_model = _timed("exec", w.execute_model, _worker_side)
        w.sample_tokens = _timed("sample", w.sample_tokens, _worker_side)
    elif name == "vllm.v1.worker.gpu_model_runner":
        r = module.GPUModelRunner
        r._model_forward = _timed("fwd", r._model_forward, _runner_side)
    elif name == "vllm.v1.engine.core":
        e = module.EngineCore
        e.step = _timed("step", e.step, _core_side)


_TARGETS = {"vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
            "vllm.v1.engine.core", *_EXTRA}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module, _name=fullname):  # noqa: ANN001, ANN202
                    _exec(module)
                    _patch(_name, module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


if _DIR:
    sys.meta_path.insert(0, _PatchAfterImport())
