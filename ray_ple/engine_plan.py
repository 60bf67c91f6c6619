"""From a checkpoint, a `ple:` block and engine kwargs to everything an offloaded engine needs.

Shared by the Serve builder and the offline API, so both start engines the same way.
"""

from __future__ import annotations

from typing import Any

from ray_ple.base import Frozen
from ray_ple.config import PleConfig
from ray_ple.engine_settings import PleEngineSettings
from ray_ple.errors import PleConfigError
from ray_ple.offload.table_file import check_checkpoint
from ray_ple.protocol.geometry import (
    ARCHITECTURES,
    PleGeometry,
    geometry_from_config,
    read_hf_config,
)
from ray_ple.protocol.posting import plan_post, scheduling_kwargs
from ray_ple.protocol.support import (
    check_drafter,
    check_media,
    check_media_imports,
    media_asked,
    refuse_unsupported,
    speculation,
)
from ray_ple.table_source import TableSource
from ray_ple.worker.vllm_plugin.mirror import check_vllm_version

DEFAULT_MAX_TOKENS = 8192
# vLLM's `worker_cls` per transport, by name: the plan never imports vLLM's worker modules
# (tests/test_layout.py checks that each names a class that exists).
WORKER_CLS = {"cpu": "ray_ple.worker.vllm_plugin.workers_cpu.PleCPUWorker",
              "cuda": "ray_ple.worker.vllm_plugin.workers_gpu.PleGPUWorker"}


def table_sources(geometry: PleGeometry, checkpoint_dir: str,
                  tensor: str | None) -> tuple[TableSource, ...]:
    """The checkpoint tensor of each offloaded table (the `ple.table_tensor` override first)."""
    names = (tensor,) if tensor else ARCHITECTURES[geometry.architecture].checkpoint_tensors
    return tuple(TableSource(checkpoint_dir=checkpoint_dir, tensor_names=names, table=table)
                 for table in geometry.tables)


class OffloadPlan(Frozen):
    checkpoint_dir: str
    geometry: PleGeometry
    settings: PleEngineSettings
    sources: tuple[TableSource, ...]
    engine_kwargs: dict[str, Any]
    env: dict[str, str]

    @property
    def world_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))


def slot_tokens(ple: PleConfig, engine_kwargs: dict[str, Any]) -> int:
    """Slot rows (`max_tokens`), after the support checks, and checked against the batch.

    Needs no checkpoint, so manifests can be checked where the checkpoint does not exist.
    """
    refuse_unsupported(engine_kwargs)
    engine_max = engine_kwargs.get("max_num_batched_tokens")
    max_tokens = ple.max_tokens or engine_max or DEFAULT_MAX_TOKENS
    draft = ("; with speculative decoding it includes the draft slots"
             if engine_kwargs.get("speculative_config") else "")
    for key in ("max_num_batched_tokens", "max_num_scheduled_tokens"):
        if (n := engine_kwargs.get(key)) is not None and n > max_tokens:
            raise PleConfigError(f"{key}={n} exceeds ple.max_tokens={max_tokens}: a step's "
                                 f"tokens must fit the slots{draft}")
    return max_tokens


def plan_offload(checkpoint_dir: str, ple: PleConfig, engine_kwargs: dict[str, Any],
                 transport: str) -> OffloadPlan:
    """Validate and derive; raises one clear `PleError` for any bad input."""
    import vllm

    check_vllm_version(vllm.__version__)
    kw = dict(engine_kwargs)
    max_tokens = slot_tokens(ple, kw)
    kw.setdefault("max_num_batched_tokens", max_tokens)
    geometry = geometry_from_config(read_hf_config(checkpoint_dir), max_tokens=max_tokens,
                                    engine_dtype=kw.get("dtype"), parts=ple.parts,
                                    resident_layers=ple.resident_layers,
                                    transport=transport)
    check_checkpoint(checkpoint_dir)
    if speculation(kw.get("speculative_config")) == "mtp":
        check_drafter(kw["speculative_config"], geometry.architecture)
    arch = ARCHITECTURES[geometry.architecture].offload_arch
    if asked := media_asked(kw):
        arch = check_media(geometry.architecture, asked, transport)
    post = plan_post(ple.post, transport, media=bool(asked))
    if asked:
        check_media_imports(geometry.architecture)
    settings = PleEngineSettings(geometry=geometry, transport=transport,  # type: ignore[arg-type]
                                 post=post, deadlines=ple.deadlines,
                                 heartbeat_interval_s=ple.supervisor.heartbeat_interval_s)
    if kw.get("worker_cls") not in (None, "auto", WORKER_CLS[transport]):
        raise PleConfigError(f"worker_cls is set by ray-ple ({WORKER_CLS[transport]})")
    kw["worker_cls"] = WORKER_CLS[transport]
    hf_overrides = dict(kw.get("hf_overrides") or {})
    hf_overrides["architectures"] = [arch]
    kw["hf_overrides"] = hf_overrides
    kw["additional_config"] = {**(kw.get("additional_config") or {}),
                               **settings.additional_config()}
    kw.update(scheduling_kwargs(post, transport))
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if transport == "cuda":
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(i) for i in range(
            int(kw.get("tensor_parallel_size", 1))))
    return OffloadPlan(checkpoint_dir=checkpoint_dir, geometry=geometry, settings=settings,
                       sources=table_sources(geometry, checkpoint_dir, ple.table_tensor),
                       engine_kwargs=kw, env=env)
