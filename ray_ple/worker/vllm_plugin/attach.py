"""Attach this vLLM worker process to its pair, after checking the engine can honour it."""

from __future__ import annotations

from vllm.config import VllmConfig

from ray_ple.engine_settings import PleEngineSettings
from ray_ple.errors import PleConfigError
from ray_ple.worker import pair as worker_pair


def worker_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_engine(vllm_config: VllmConfig, settings: PleEngineSettings) -> None:
    sched, par = vllm_config.scheduler_config, vllm_config.parallel_config
    # a target forward's T (draft slots included, padding included) is at most this
    if sched.max_num_batched_tokens > settings.geometry.max_tokens:
        raise PleConfigError(
            f"max_num_batched_tokens={sched.max_num_batched_tokens} exceeds the PLE slots "
            f"({settings.geometry.max_tokens} tokens)")
    if par.pipeline_parallel_size != 1 or par.data_parallel_size != 1:
        raise PleConfigError("PLE offload supports tensor parallelism only (pp = dp = 1)")
    if (settings.transport == "cuda" and settings.post == "host"
            and sched.async_scheduling):
        raise PleConfigError("async scheduling must be off with ple.post 'host' on the cuda "
                             "transport: the worker posts ids from the host copy of the batch "
                             "(ple.post 'stream' keeps it on)")
    check_speculation(vllm_config.speculative_config)


def check_speculation(spec) -> None:  # noqa: ANN001 - vLLM's SpeculativeConfig or None
    """As vLLM resolved it: n-gram (no drafter model), or Gemma 4's MTP drafter (no PLE
    table). The drafter's forwards are not bracketed, so a drafter that read PLE rows would
    fail closed at its first forward; refused here instead, before any step."""
    if spec is None or spec.method == "ngram":
        return
    draft = spec.draft_model_config.hf_config if spec.draft_model_config else None
    text = getattr(draft, "text_config", None) or draft
    if (spec.method == "mtp" and getattr(draft, "model_type", None) == "gemma4_mtp"
            and not getattr(text, "hidden_size_per_layer_input", 0)
            and not getattr(text, "vocab_size_per_layer_input", 0)):
        return
    raise PleConfigError(f"speculative decoding method {spec.method!r} "
                         f"({getattr(draft, 'model_type', None)!r} drafter) is not served "
                         f"with PLE offload (served: n-gram, Gemma 4's MTP drafter)")


def attach_worker(vllm_config: VllmConfig, settings: PleEngineSettings) -> worker_pair.WorkerPair:
    import ray_ple.worker.ops  # noqa: F401 - registers torch.ops.ray_ple.pull in this process

    check_engine(vllm_config, settings)
    return worker_pair.attach_process(
        settings.geometry, rank=worker_rank(), transport=settings.transport,
        deadlines=settings.deadlines, heartbeat_s=settings.heartbeat_interval_s,
        post=settings.post_for(vllm_config.scheduler_config.async_scheduling))
