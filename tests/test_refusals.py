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

from ray_ple.checkpoints.tiny import PRESETS, build
from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload
from ray_ple.errors import PleConfigError
from ray_ple.protocol.posting import engine_post, plan_post, scheduling_kwargs
from ray_ple.serve.builder import offload_llm_config, validate_args
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
    assert engine_post(auto.settings.post, "cuda", True) == "stream"
    assert engine_post("auto", "cuda", False) == engine_post("auto", "cuda", None) == "host"
    host = plan_offload(ckpt, PleConfig(post="host"), {"async_scheduling": True}, "cuda")
    assert host.settings.post == "host" and host.engine_kwargs["async_scheduling"] is False
    stream = plan_offload(ckpt, PleConfig(post="stream"), {}, "cuda")
    assert engine_post(stream.settings.post, "cuda", False) == "stream", "as configured"
    cpu = plan_offload(ckpt, PleConfig(), {}, "cpu")
    assert cpu.settings.post == "host" and engine_post(cpu.settings.post, "cpu", True) == "host"
    with pytest.raises(PleConfigError, match="needs the cuda transport"):
        plan_offload(ckpt, PleConfig(post="stream"), {}, "cpu")


@pytest.mark.parametrize(("requested", "transport", "media", "planned"), [
    ("auto", "cpu", False, "host"), ("host", "cpu", False, "host"),
    ("stream", "cpu", False, "needs the cuda transport"),
    ("auto", "cpu", True, "host"), ("stream", "cpu", True, "needs the cuda transport"),
    ("auto", "cuda", False, "auto"), ("host", "cuda", False, "host"),
    ("stream", "cuda", False, "stream"), ("auto", "cuda", True, "stream"),
    ("host", "cuda", True, "not served with media"), ("stream", "cuda", True, "stream")])
def test_the_post_decision_over_every_request_transport_and_media(requested, transport, media,
                                                                  planned):
    """`plan_post` then `engine_post`, each case: what the plan settles, and what the worker
    settles under either async scheduling (a host post on CUDA never meets it switched on:
    the plan turns it off, and a worker that finds it on refuses)."""
    if planned not in ("auto", "host", "stream"):
        with pytest.raises(PleConfigError, match=planned):
            plan_post(requested, transport, media)
        return
    assert plan_post(requested, transport, media) == planned
    for async_on in (False, True):
        if planned == "host" and transport == "cuda" and async_on:
            assert scheduling_kwargs(planned, transport) == {"async_scheduling": False}
            with pytest.raises(PleConfigError, match="async scheduling must be off"):
                engine_post(planned, transport, async_on)
            continue
        want = ("stream" if transport == "cuda" and async_on else "host") \
            if planned == "auto" else planned
        assert engine_post(planned, transport, async_on) == want


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
