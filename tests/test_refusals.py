"""What PLE offload does not serve is refused with one clear error, never served wrong.

Speculative decoding, images/audio/video in the config, and prompt embeddings are refused
when the app is built (before any replica, actor or segment exists). A request that carries
an image or audio reaches a model served as text: `serve run` answers it with a 400, and the
replica keeps serving.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
import requests
import yaml

from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload
from ray_ple.errors import PleConfigError
from ray_ple.serve.builder import offload_llm_config, validate_args
from ray_ple.tiny_model import PRESETS, build
from tests.hf_reference import hf_agrees
from tests.serving import BASE, ServeRun, complete, load_config, offload_pids


def _args(**engine: object) -> dict:
    llm = load_config()["applications"][0]["args"]["llm_configs"][0]
    llm["engine_kwargs"].update(engine)
    return {"llm_configs": [llm]}


SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
    "mtp": {"method": "mtp", "num_speculative_tokens": 1},
}


@pytest.mark.parametrize("method", sorted(SPECULATIVE))
def test_speculative_decoding_is_refused_when_the_app_is_built(method):
    with pytest.raises(PleConfigError, match="speculative decoding"):
        validate_args(_args(speculative_config=SPECULATIVE[method]))
    with pytest.raises(PleConfigError, match="speculative decoding"):
        offload_llm_config(_args(speculative_config=SPECULATIVE[method])["llm_configs"][0])


def test_speculative_decoding_is_refused_by_the_offline_plan():
    with pytest.raises(PleConfigError, match="speculative decoding"):
        plan_offload(str(build(PRESETS["tiny-gemma3n"])), PleConfig(),
                     {"speculative_config": SPECULATIVE["ngram"]}, "cpu")


@pytest.mark.parametrize("limits", [{"image": 1}, {"audio": 2, "image": 0},
                                    {"video": {"count": 1}}])
def test_multimodal_inputs_in_the_config_are_refused(limits):
    with pytest.raises(PleConfigError, match="serves the model as text"):
        validate_args(_args(limit_mm_per_prompt=limits))


def test_multimodal_limits_of_zero_are_accepted():
    validate_args(_args(limit_mm_per_prompt={"image": 0, "audio": 0}))


def test_prompt_embeddings_are_refused():
    with pytest.raises(PleConfigError, match="token ids"):
        validate_args(_args(enable_prompt_embeds=True))


def test_the_unoffloaded_model_is_not_refused():
    args = _args(speculative_config=SPECULATIVE["ngram"])
    args["llm_configs"][0]["ple"] = {"enabled": False}
    validate_args(args)


# --- `serve run`: multimodal checkpoints served as text, an image or audio request refused

def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav() -> str:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)
    return base64.b64encode(buf.getvalue()).decode()


MEDIA = {
    "image": lambda: {"type": "image_url", "image_url": {"url": _png()}},
    "audio": lambda: {"type": "input_audio", "input_audio": {"data": _wav(), "format": "wav"}},
}
MODELS = ["tiny-gemma3n", "tiny-gemma4-mm"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = load_config("gemma3n-tiny-cpu.yaml")
    app = cfg["applications"][0]
    g4 = json.loads(json.dumps(app["args"]["llm_configs"][0]))
    g4["model_loading_config"] = {"model_id": "tiny-gemma4-mm",
                                  "model_source": "ray-ple://tiny-gemma4-mm"}
    app["args"]["llm_configs"].append(g4)
    for llm in app["args"]["llm_configs"]:
        llm["placement_group_config"]["bundle_per_worker"] = {"CPU": 0.25}
        llm["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.125}
        llm["ple"]["offload_num_cpus"] = 0.125
    app["args"]["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0.1}}
    tmp = tmp_path_factory.mktemp("serve-mm")
    (tmp / "mm.yaml").write_text(yaml.safe_dump(cfg))
    run = ServeRun(tmp / "mm.yaml", tmp / "serve.log")
    try:
        for model in MODELS:
            run.wait_ready(model)
        yield run
    finally:
        run.stop()


@pytest.mark.slow
def test_gemma3n_served_offloaded_agrees_with_hf(served):
    prompts = [[5, 6, 7, 8], [9, 30, 31, 200, 201, 255]]
    got = [complete("tiny-gemma3n", p)["choices"][0]["token_ids"] for p in prompts]
    # the multimodal layout holds the same weights as the text preset HF loads
    problems, near_ties = hf_agrees(str(build(PRESETS["tiny-gemma3n"])), prompts, got)
    assert problems == [] and near_ties <= 2


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("media", sorted(MEDIA))
def test_a_request_with_media_is_refused_and_the_replica_keeps_serving(served, model, media):
    before = sorted(offload_pids())
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "w5 w6"}, MEDIA[media]()]}]}
    r = requests.post(f"{BASE}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "multimodal" in r.json()["error"]["message"].lower(), r.text
    assert complete(model, [5, 6, 7])["choices"][0]["token_ids"], "still serving"
    assert sorted(offload_pids()) == before, "no replica was replaced"
