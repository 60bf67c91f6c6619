"""What PLE offload does not serve is refused with one clear error, never served wrong.

Speculative decoding other than n-gram and Gemma 4's MTP drafter, media for a model served as
text (those an architecture's media class cannot serve: tests/test_media_offload.py), and
prompt embeddings are refused when the app is built (before any replica, actor or segment
exists). A request that carries an image or audio reaches a model served as text: `serve run`
answers it with a 400 and the replica keeps serving (tested in tests/test_serve.py, in the
same `serve run`).
"""

from __future__ import annotations

import pytest

from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload
from ray_ple.errors import PleConfigError
from ray_ple.serve.builder import offload_llm_config, validate_args
from ray_ple.tiny_model import PRESETS, build
from tests.serving import load_config


def _args(**engine: object) -> dict:
    llm = load_config()["applications"][0]["args"]["llm_configs"][0]
    llm["engine_kwargs"].update(engine)
    return {"llm_configs": [llm]}


SPECULATIVE = {  # what the offload does not serve (served ones: tests/test_speculative.py)
    "eagle": {"method": "eagle", "model": "some-eagle-head", "num_speculative_tokens": 2},
    "draft_model": {"method": "draft_model", "model": "some-draft", "num_speculative_tokens": 2},
    "ngram_gpu": {"method": "ngram_gpu", "num_speculative_tokens": 2},
    "mtp-without-drafter": {"method": "mtp", "num_speculative_tokens": 1},
}


@pytest.mark.parametrize("method", sorted(SPECULATIVE))
def test_speculative_methods_not_served_are_refused_when_the_app_is_built(method):
    with pytest.raises(PleConfigError, match="speculative decoding"):
        validate_args(_args(speculative_config=SPECULATIVE[method]))
    with pytest.raises(PleConfigError, match="speculative decoding"):
        offload_llm_config(_args(speculative_config=SPECULATIVE[method])["llm_configs"][0])


def test_speculative_decoding_not_served_is_refused_by_the_offline_plan():
    with pytest.raises(PleConfigError, match="speculative decoding"):
        plan_offload(str(build(PRESETS["tiny-gemma3n"])), PleConfig(),
                     {"speculative_config": SPECULATIVE["eagle"]}, "cpu")


@pytest.mark.parametrize("preset", ["tiny-gemma4", "tiny-gemma3n"])
@pytest.mark.parametrize("limits", [{"image": 1}, {"audio": 2, "image": 0},
                                    {"video": {"count": 1, "num_frames": 2}}])
def test_media_for_a_model_served_as_text_are_refused(preset, limits):
    """Served for the multimodal checkpoints only, by modality (tests/test_media_offload.py)."""
    with pytest.raises(PleConfigError, match="as text: media are served for "
                       "Gemma3nForConditionalGeneration and Gemma4ForConditionalGeneration"):
        plan_offload(str(build(PRESETS[preset])), PleConfig(),
                     {"limit_mm_per_prompt": limits}, "cpu")


def test_a_malformed_media_limit_is_refused_when_the_app_is_built():
    with pytest.raises(PleConfigError, match="limit_mm_per_prompt must be a mapping"):
        validate_args(_args(limit_mm_per_prompt=["image"]))


def test_multimodal_limits_of_zero_are_accepted():
    validate_args(_args(limit_mm_per_prompt={"image": 0, "audio": 0}))


def test_prompt_embeddings_are_refused():
    with pytest.raises(PleConfigError, match="token ids"):
        validate_args(_args(enable_prompt_embeds=True))


def test_the_unoffloaded_model_is_not_refused():
    args = _args(speculative_config=SPECULATIVE["eagle"])
    args["llm_configs"][0]["ple"] = {"enabled": False}
    validate_args(args)


def test_who_posts_follows_the_transport_and_the_engine_scheduling():
    """On CUDA `auto` is settled by the worker once vLLM has resolved async scheduling:
    the GPU stream posts where the engine schedules asynchronously (async scheduling left as
    configured), the host where it does not; a host post needs the ids on the host, so it
    turns async scheduling off; a stream post on the CPU transport (no stream) is refused
    before anything starts."""
    ckpt = str(build(PRESETS["tiny-gemma4"]))
    auto = plan_offload(ckpt, PleConfig(), {}, "cuda")
    assert auto.settings.post == "auto" and "async_scheduling" not in auto.engine_kwargs
    assert auto.settings.post_for(True) == "stream"
    assert auto.settings.post_for(False) == auto.settings.post_for(None) == "host"
    host = plan_offload(ckpt, PleConfig(post="host"), {"async_scheduling": True}, "cuda")
    assert host.settings.post == "host" and host.engine_kwargs["async_scheduling"] is False
    stream = plan_offload(ckpt, PleConfig(post="stream"), {}, "cuda")
    assert stream.settings.post_for(False) == "stream", "as configured"
    cpu = plan_offload(ckpt, PleConfig(), {}, "cpu")
    assert cpu.settings.post == "host" and cpu.settings.post_for(True) == "host"
    with pytest.raises(PleConfigError, match="needs the cuda transport"):
        plan_offload(ckpt, PleConfig(post="stream"), {}, "cpu")


def test_env_vars_of_every_user_layer_kept_and_a_conflicting_one_refused():
    """A plain replica gets the deployment's and the model's env vars: so does an offloaded
    one, with ray-ple's own added; a user value for a variable ray-ple must set is one error
    at build time (the application's own layer is checked in tests/test_serve.py)."""
    llm = _args()["llm_configs"][0]
    llm["deployment_config"]["ray_actor_options"] = {
        "num_cpus": 0.25, "runtime_env": {"env_vars": {"FROM_DEPLOYMENT": "1", "BOTH": "d"}}}
    llm["runtime_env"] = {"env_vars": {"FROM_MODEL": "2", "BOTH": "m"}}
    env = offload_llm_config(llm).runtime_env["env_vars"]
    assert {k: env.get(k) for k in ("FROM_DEPLOYMENT", "FROM_MODEL", "BOTH")} == {
        "FROM_DEPLOYMENT": "1", "FROM_MODEL": "2", "BOTH": "m"}
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    llm["runtime_env"]["env_vars"]["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    with pytest.raises(PleConfigError, match="VLLM_USE_V2_MODEL_RUNNER"):
        offload_llm_config(llm)
