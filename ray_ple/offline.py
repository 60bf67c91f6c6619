"""Offline inference with the PLE table offloaded: `vllm.LLM` plus its offload actors.

For batch jobs, tests and benchmarks on a Ray cluster (or a local one): the engine runs in
this process's engine core, the offload actors on this node (pinned to it: the worker opens
their segments by pid).

There is no supervisor here: it ends a Serve replica, and offline the replica would be the
caller's own process. Each side's checks still fail closed: a worker that loses its offload
actor (dead, stopped, stale rows, a broken counter) exits within `heartbeat_s`, vLLM's engine
core with it, and the next `generate` raises `EngineDeadError` instead of returning tokens
(tests/test_vllm_offload.py). Use Serve when a lost pair must be replaced without you.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ray_ple.checkpoints.source import resolve
from ray_ple.config import PleConfig, parse_ple
from ray_ple.engine_plan import plan_offload
from ray_ple.errors import PleConfigError
from ray_ple.protocol.handles import PAIRS_ENV, EngineHandles
from ray_ple.supervision.offload_group import OffloadGroup


@contextmanager
def offloaded_llm(model: str, ple: PleConfig | None = None, **engine_kwargs: Any
                  ) -> Iterator[Any]:
    """Yield a `vllm.LLM` whose PLE table is served by offload actors on this node.

    `ple` may be a `PleConfig` or its dict (the `ple:` block); a bad one is a `PleConfigError`.
    `ple.transport: auto` takes the transport of the vLLM build here (cuda on a CUDA build
    with a GPU, else cpu), as the Serve builder takes it from the accelerator.
    """
    import ray
    from vllm import LLM

    ple = parse_ple(ple)
    transport = _transport(ple)
    checkpoint = resolve(model)
    if not ple.enabled:
        llm = LLM(model=checkpoint, **engine_kwargs)
        try:
            yield llm
        finally:
            _shutdown(llm)
        return
    plan = plan_offload(checkpoint, ple, engine_kwargs, transport)
    if not ray.is_initialized():
        ray.init()
    pairs = OffloadGroup(ple, plan.geometry, plan.sources, tag=f"offline-{secrets.token_hex(4)}")
    saved = {k: os.environ.get(k) for k in (*plan.env, PAIRS_ENV)}
    llm = None
    try:
        handles = pairs.start(plan.world_size, None, list(range(plan.world_size)))
        os.environ.update({**plan.env, **EngineHandles(pairs=tuple(handles)).env()})
        llm = LLM(model=checkpoint, **plan.engine_kwargs)
        llm.ray_ple_pairs = pairs  # for callers that inspect or fault the pairs
        yield llm
    finally:
        if llm is not None:
            _shutdown(llm)
        pairs.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _transport(ple: PleConfig) -> str:
    from vllm.platforms import current_platform

    here = "cuda" if current_platform.is_cuda() else "cpu"
    if ple.transport not in ("auto", here):
        raise PleConfigError(f"ple.transport {ple.transport!r} does not fit this vLLM build "
                             f"({current_platform.device_type or 'no device'}): use {here!r} "
                             f"or 'auto'")
    return here


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
