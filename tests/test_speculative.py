"""Speculative decoding with the PLE table offloaded: n-gram and Gemma 4's MTP drafter.

Each verification (target) forward is one transaction at T = the scheduled tokens including
the draft slots; the drafter's forwards (MTP) move no rows. Real vLLM-CPU engines, each in
its own process (`python -m tests.test_speculative '<json job>'`, as tests/engine_job.py),
against this module's Ray cluster. A tiny random model rarely repeats itself, so the prompts
are ones whose greedy continuations do (runs of one token), and the MTP drafter is built to
propose the last token again (`build_mtp_drafter`): drafts are accepted there, and the tests
read that from vLLM's own spec-decode counters, so a run with none accepted fails.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from ray_ple.checkpoints.tiny import PRESETS, build, build_mtp_drafter
from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload
from ray_ple.errors import PleConfigError
from tests.engines import local_cluster, report, run_job

# greedy continuations of these repeat a token several times (runs of 210, 240, 166, 68)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [10, 11, 12, 13, 14, 10, 11, 12, 13, 14],
           [60, 60, 60, 60, 60, 60], [100, 101], [9, 30, 31, 32, 33], [210, 210, 210, 210],
           [44, 45, 46, 44, 45, 46, 44, 45, 46]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts",
                "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted"}


def mtp_config() -> dict[str, Any]:
    return {"model": str(build_mtp_drafter(PRESETS["tiny-gemma4"])),
            "num_speculative_tokens": 2}


# --- the engine job (runs in its own process) -----------------------------------------------
def _count_target_forwards(worker: Any) -> None:
    """A pre-hook on the target model: the tokens of every forward it runs (never the
    drafter's, a module of its own)."""
    model = worker.model_runner.get_model()  # the module itself, under any graph wrapper
    model.ray_ple_forwards = []

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        module.ray_ple_forwards.append(int(ids.shape[0]))

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _target_forwards(worker: Any) -> list[int]:
    return list(worker.model_runner.get_model().ray_ple_forwards)


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from ray_ple.offline import offloaded_llm
    from tests.engine_job import ENGINE

    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    engine = {**ENGINE, "disable_log_stats": False, "speculative_config": job["spec"],
              **job.get("engine", {})}
    out: dict[str, Any] = {}
    with offloaded_llm(job["model"], PleConfig.model_validate(job.get("ple", {})),
                       **engine) as llm:
        pairs = getattr(llm, "ray_ple_pairs", None)
        if pairs is not None:
            out["before"] = [s.model_dump() for s in pairs.statuses()]
        llm.collective_rpc(_count_target_forwards)
        outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], sp,
                               use_tqdm=False)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        (out["forwards"],) = llm.collective_rpc(_target_forwards)
        if pairs is not None:
            out["after"] = [s.model_dump() for s in pairs.statuses()]
        out["spec"] = {SPEC_METRICS[m.name]: m.value for m in llm.get_metrics()
                       if m.name in SPEC_METRICS}
    return out


# --- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    yield from local_cluster()


def _runs(cluster: str, spec: dict[str, Any]) -> tuple[dict, dict]:
    job = {"model": "ray-ple://tiny-gemma4", "prompts": PROMPTS, "max_tokens": 48,
           "spec": spec}
    offload = run_job(cluster, job, module="tests.test_speculative")
    plain = run_job(cluster, {**job, "ple": {"enabled": False}}, module="tests.test_speculative")
    return offload, plain


def _check(offload: dict, plain: dict) -> None:
    assert offload["tokens"] == plain["tokens"]
    assert all(len(t) == 48 for t in offload["tokens"])
    spec = offload["spec"]
    assert spec["accepted"] > 0, spec  # vLLM's own counter: drafts were verified and kept
    assert spec == plain["spec"], "the same drafts, accepted alike"
    (before,), (after,) = offload["before"], offload["after"]
    forwards = offload["forwards"]
    assert after["posted"] - before["posted"] == after["released"] - before["released"] \
        == len(forwards) > 0, (before, after, forwards)
    assert all(p == after["posted"] for p in after["published"])
    # the forwards' tokens: the prompts, one per request per decode step (at least 47 per
    # request, fewer by what was accepted) and every draft slot vLLM verified
    least = sum(map(len, PROMPTS)) + len(PROMPTS) * 47 - spec["accepted"]
    assert sum(forwards) >= least + spec["draft_tokens"], (sum(forwards), least, spec)


@pytest.mark.slow
def test_ngram_tokens_equal_plain_with_drafts_accepted_one_transaction_per_target_forward(
        cluster):
    _check(*_runs(cluster, NGRAM))


@pytest.mark.slow
def test_mtp_drafter_tokens_equal_plain_with_drafts_accepted_its_forwards_move_no_rows(
        cluster):
    """Gemma 4's MTP drafter runs its own forwards after each verification step; only the
    target's forwards are transactions (the pair counts exactly those)."""
    _check(*_runs(cluster, mtp_config()))


# --- what the offload cannot serve, refused when the app is built ----------------------------
def _plan(spec: dict[str, Any], preset: str = "tiny-gemma4", **engine: Any):  # noqa: ANN202
    return plan_offload(str(build(PRESETS[preset])), PleConfig(),
                        {"speculative_config": spec, **engine}, "cpu")


def test_served_methods_are_planned():
    assert _plan(NGRAM).engine_kwargs["speculative_config"] == NGRAM
    assert _plan({"model": "ngram", "num_speculative_tokens": 2}).engine_kwargs
    assert _plan({**mtp_config(), "method": "mtp"}).engine_kwargs
    assert _plan(mtp_config()).engine_kwargs  # vLLM infers mtp from the drafter's model_type


def test_a_drafter_with_a_ple_table_of_its_own_is_refused():
    drafter = str(build(PRESETS["tiny-gemma4"]))
    for spec in ({"model": drafter, "num_speculative_tokens": 2},
                 {"model": drafter, "method": "mtp", "num_speculative_tokens": 1}):
        with pytest.raises(PleConfigError, match="per-layer-embedding table of its own"):
            _plan(spec)


def test_mtp_is_refused_for_a_target_other_than_gemma_4():
    with pytest.raises(PleConfigError, match="MTP is served for a Gemma 4 target"):
        _plan(mtp_config(), preset="tiny-gemma3n")


@pytest.mark.parametrize("spec", [
    {"method": "eagle3", "model": "x", "num_speculative_tokens": 2},
    {"method": "suffix", "num_speculative_tokens": 2},
    {"method": "mtp", "num_speculative_tokens": 1},
    "ngram",
])
def test_other_methods_are_refused(spec):
    with pytest.raises(PleConfigError, match="speculative"):
        _plan(spec)


def test_slots_smaller_than_the_scheduled_tokens_with_draft_slots_are_refused():
    """vLLM 0.32 counts the draft slots inside `max_num_batched_tokens` (the scheduler's
    input budget; `max_num_scheduled_tokens` defaults to it): the slots must hold it."""
    ckpt = str(build(PRESETS["tiny-gemma4"]))
    for key in ("max_num_batched_tokens", "max_num_scheduled_tokens"):
        with pytest.raises(PleConfigError, match=f"{key}=512 exceeds ple.max_tokens=256.*"
                                                 "draft slots"):
            plan_offload(ckpt, PleConfig(max_tokens=256),
                         {"speculative_config": NGRAM, key: 512}, "cpu")


def test_the_worker_refuses_what_vllm_resolved_to_a_drafter_it_cannot_serve():
    """The worker's own check, on vLLM's resolved config (past the build-time check)."""
    from ray_ple.protocol.support import check_resolved_speculation

    def resolved(method: str, model_type: str, ple_dim: int = 0) -> SimpleNamespace:
        text = SimpleNamespace(hidden_size_per_layer_input=ple_dim,
                               vocab_size_per_layer_input=256 if ple_dim else 0)
        hf = SimpleNamespace(model_type=model_type, text_config=text)
        return SimpleNamespace(method=method, draft_model_config=SimpleNamespace(hf_config=hf))

    check_resolved_speculation(None)
    check_resolved_speculation(resolved("ngram", "gemma4_text", 16))
    check_resolved_speculation(resolved("mtp", "gemma4_mtp"))
    for bad in (resolved("mtp", "gemma4_mtp", 16), resolved("eagle", "llama"),
                resolved("draft_model", "gemma4_text", 16), resolved("ngram_gpu", "gemma4")):
        with pytest.raises(PleConfigError, match="not served with PLE offload"):
            check_resolved_speculation(bad)


if __name__ == "__main__":
    import ray

    # collective_rpc of this module's functions (the forward counter) needs pickle
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    result = run(json.loads(sys.argv[1]))
    report(result)
