"""vLLM's own GPU runner with the PLE table offloaded: the same token ids as plain vLLM on the
same GPU, with vLLM's defaults (torch.compile, CUDA graphs, async scheduling) and eager.

Every engine is `vllm.LLM` through `ray_ple.offline.offloaded_llm` in its own process
(tests/engine_job.py and the media and speculation jobs), with the project's CUDA defaults
(`ple.transport: auto` -> cuda, `post: auto` -> the stream post under async scheduling, the
late pull in parts, layer 0 resident), against one Ray cluster; the engines of a case run at
once, each with a fixed KV cache (`kv_cache_memory_bytes`), so that they share the GPU
without disturbing each other's memory profile. Compare offload with plain in the same mode
only: random bf16 weights make near-ties, and eager and compiled may round them apart.

Runs where vLLM's CUDA build and a GPU are present (`scripts/gpu_device_run.sh vllm`, its
summary kept under `bench/cuda/results/`); elsewhere every test is skipped with the reason.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.engines import finish_jobs, local_cluster, start_job
from tests.gpu.vllm_cuda import needs_vllm_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_vllm_cuda("vllm")]

# a fixed KV cache per engine: several engines profile at once on one GPU
GPU = {"gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 256 << 20}
MODES = {"compiled": {"enforce_eager": False}, "eager": {"enforce_eager": True}}
MODELS = {"gemma4": "ray-ple://tiny-gemma4", "gemma3n": "ray-ple://tiny-gemma3n"}
# eight prompts (ids >= 192 are outside Gemma 3n's per-layer vocabulary: row 0, as vLLM);
# each of the first six alone (batch 1), then all eight together (batch 8)
PROMPTS = [[5, 6, 7, 8], [100, 101], [9, 30, 31, 32, 33, 34, 35, 36, 37, 38], [250],
           [2, 17, 200, 201, 202, 255, 4], [60] * 20, [191, 192, 193], [44, 45, 46]]
BATCHES = [[p] for p in PROMPTS[:6]] + [PROMPTS]
MAX_TOKENS = 24
# every engine's start and runs: the device stage's limit less a minute, as
# `scripts/gpu_device_run.sh vllm` sets it (560 - 60 s by default)
JOBS_S = float(os.environ.get("RAY_PLE_GPU_JOBS_S", "500"))


def _job(model: str, mode: str, enabled: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODELS[model], "batches": BATCHES, "max_tokens": MAX_TOKENS,
            "engine": {**GPU, **MODES[mode]}, "ple": {"enabled": enabled}, **extra}


@pytest.fixture(scope="module")
def cluster():
    yield from local_cluster()


@pytest.fixture(scope="module")
def runs(cluster: str) -> dict[tuple[str, ...], dict]:
    """Every engine of the module at once (about 14 on one GPU, each with its fixed KV
    cache): both tiny models offload and plain, compiled and eager; then an image and a video
    through Gemma 4 with towers, n-gram speculation, and a long decode whose offload actor is
    killed, offload and plain of each."""
    jobs: dict[tuple[str, ...], tuple[str, dict]] = {
        (m, mode, v): ("tests.engine_job", _job(m, mode, v == "offload"))
        for m in MODELS for mode in MODES for v in ("offload", "plain")}
    engine = {**GPU, **MODES["compiled"]}
    features = {
        "media": ("tests.test_media_offload",
                  {"model": "gemma4", "max_tokens": 16, "engine": engine}),
        "ngram": ("tests.test_speculative",
                  {"model": MODELS["gemma4"], "max_tokens": 48, "engine": engine,
                   "prompts": SPEC_PROMPTS, "spec": NGRAM}),
        "kill": ("tests.engine_job", {**_job("gemma4", "compiled"), "batches": [PROMPTS],
                                      "kill_mid_decode": 40, "long_tokens": 200}),
    }
    for name, (module, job) in features.items():
        for v in ("offload", "plain"):
            jobs[name, v] = (module, {**job, "ple": {"enabled": v == "offload"}})
    started = [start_job(cluster, job, module) for module, job in jobs.values()]
    return dict(zip(jobs, finish_jobs(started, timeout_s=JOBS_S, keep_failures=True)))


def _run(runs: dict[tuple[str, ...], dict], *key: str) -> dict:
    """One engine's result; an engine that failed fails only the tests that read it."""
    run = runs[key]
    if "failed" in run:
        pytest.fail(f"{'/'.join(key)}: {run['failed']}\n{run['output']}", pytrace=False)
    return run


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_token_ids_identical_to_plain_vllm_on_the_same_gpu(runs, model, mode):
    offload, plain = _run(runs, model, mode, "offload"), _run(runs, model, mode, "plain")
    assert offload["tokens"] == plain["tokens"]
    assert all(len(t) == MAX_TOKENS for batch in offload["tokens"] for t in batch)
    (status,) = offload["status"]
    forwards = status["posted"]
    assert forwards == status["released"] >= len(BATCHES) * MAX_TOKENS, status
    assert all(p == forwards for p in status["published"])
    assert status["cuda_evidence"] == [] and status["torch_imported"] is False


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_projects_cuda_defaults_as_vllm_resolved_them(runs, mode):
    """vLLM's async scheduling kept and the stream posting each step (`post: auto`), the
    cuda transport; compiled with CUDA graphs, or eager."""
    (pair,) = _run(runs, "gemma4", mode, "offload")["pair"]
    (none,) = _run(runs, "gemma4", mode, "plain")["pair"]
    assert none is None
    assert pair["transport"] == "CudaTransport" and pair["async_scheduling"], pair
    assert pair["stream_posts"], pair
    if mode == "compiled":
        assert "NONE" not in pair["cudagraph_mode"], pair
    else:
        assert "NONE" in pair["cudagraph_mode"], pair


def test_worker_holds_no_ple_table_on_the_gpu(runs):
    for model in MODELS:
        (inv_off,) = _run(runs, model, "compiled", "offload")["inventory"]
        (inv_plain,) = _run(runs, model, "compiled", "plain")["inventory"]
        assert [n for n, _ in inv_plain if "embed_tokens_per_layer" in n], "plain holds it"
        assert not [n for n, _ in inv_off if "embed_tokens_per_layer" in n]


# prompts whose greedy continuations repeat (tests/test_speculative.py), so drafts are kept
SPEC_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [10, 11, 12, 13, 14, 10, 11, 12, 13, 14],
                [60, 60, 60, 60, 60, 60], [100, 101], [210, 210, 210, 210]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def test_image_and_video_through_gemma4_with_towers_equal_plain(runs):
    offload, plain = _run(runs, "media", "offload"), _run(runs, "media", "plain")
    assert offload["tokens"] == plain["tokens"]
    assert offload["prompt_tokens"] == plain["prompt_tokens"]
    images = offload["tokens"][:2]
    assert images[0] != images[1], "two images, two continuations: the media reach the output"
    (after,) = offload["after"]
    assert after["posted"] == after["released"] > 0


def test_ngram_speculation_equal_plain_with_drafts_accepted(runs):
    offload, plain = _run(runs, "ngram", "offload"), _run(runs, "ngram", "plain")
    assert offload["tokens"] == plain["tokens"]
    assert offload["spec"]["accepted"] > 0, offload["spec"]
    assert offload["spec"] == plain["spec"]
    (after,) = offload["after"]
    assert after["posted"] == after["released"] > 0


def test_offload_killed_mid_decode_the_generate_fails_closed(runs):
    """The offload actor dies while a long decode runs (CUDA graphs replaying the pull): no
    token computed from a missing row comes back, and the next generate raises."""
    kill = _run(runs, "kill", "offload")["kill"]
    reference = _run(runs, "kill", "plain")["long"]
    during, after = kill["during"], kill["after"]
    if "tokens" in during:  # finished before the kill took effect: then every token is right
        assert during["tokens"] == reference
    else:
        assert during["error"] == "EngineDeadError", during
    assert "tokens" not in after and after["error"] == "EngineDeadError", after
