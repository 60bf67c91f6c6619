"""vLLM 0.32 plugin (entry point `vllm.general_plugins`): registers the offload model classes.

Loaded in every vLLM process; registration is lazy (by qualified name) and idempotent, and
changes nothing unless an engine is configured to use a `RayPle*` architecture.
"""

from __future__ import annotations

from ray_ple.protocol.geometry import ARCHITECTURES

_MODULES = {
    "RayPleGemma4ForCausalLM": "ray_ple.worker.vllm_plugin.gemma4:RayPleGemma4ForCausalLM",
    "RayPleGemma3nForCausalLM": "ray_ple.worker.vllm_plugin.gemma3n:RayPleGemma3nForCausalLM",
    "RayPleGemma4ForConditionalGeneration":
        "ray_ple.worker.vllm_plugin.gemma4_media:RayPleGemma4ForConditionalGeneration",
    "RayPleGemma3nForConditionalGeneration":
        "ray_ple.worker.vllm_plugin.gemma3n_media:RayPleGemma3nForConditionalGeneration",
}


def register() -> None:
    from vllm import ModelRegistry

    archs = {a for spec in ARCHITECTURES.values() for a in (spec.offload_arch, spec.media_arch)}
    for arch in archs - {None}:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, _MODULES[arch])
