"""The tiny multimodal Gemma 4 (`ray-ple://tiny-gemma4-towers`): real towers, real media tokens.

Run with Hugging Face transformers, its reference implementation: the checkpoint's vision and
audio towers reach the output, and the per-layer lookup reads the table's row 0 at every
media position (so an offload that moves row 0 is what a media request depends on), while a
text prompt never reads row 0. These are the facts the offloaded multimodal model must match.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ray_ple.checkpoints.tiny import MEDIA_TOKENS, PRESETS, build, media_token_ids

TEXT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return build(PRESETS["tiny-gemma4-towers"])


@pytest.fixture(scope="module")
def model(checkpoint: Path):  # noqa: ANN201 - transformers' Gemma4ForConditionalGeneration
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(checkpoint,
                                                          dtype=torch.bfloat16).eval()


def _processor_part(checkpoint: Path, part: str) -> dict:
    config = json.loads((checkpoint / "processor_config.json").read_text())[part]
    return {k: v for k, v in config.items() if not k.endswith("_type")}


def _image(checkpoint: Path, rgb: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    processor = Gemma4ImageProcessorPil(**_processor_part(checkpoint, "image_processor"))
    return processor(images=[Image.new("RGB", (96, 96), rgb)], return_tensors="pt")


def _audio(checkpoint: Path, hz: float) -> dict[str, torch.Tensor]:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    extractor = Gemma4AudioFeatureExtractor(**_processor_part(checkpoint, "feature_extractor"))
    t = np.arange(8000) / 16000
    return extractor([np.sin(2 * np.pi * hz * t).astype(np.float32)], sampling_rate=16000,
                     return_tensors="pt")


def _image_prompt(model, image: dict) -> tuple[list[int], dict]:  # noqa: ANN001
    cfg, n = model.config, int(image["num_soft_tokens_per_image"][0])
    ids = [5, 6, cfg.boi_token_id] + [cfg.image_token_id] * n + [cfg.eoi_token_id, 7, 4]
    return ids, {"pixel_values": image["pixel_values"],
                 "image_position_ids": image["image_position_ids"]}


def _audio_prompt(model, audio: dict) -> tuple[list[int], dict]:  # noqa: ANN001
    cfg = model.config
    mask = audio["input_features_mask"]
    with torch.no_grad():
        out = model.model.get_audio_features(audio["input_features"].to(torch.bfloat16), mask)
    n = int(out.attention_mask.sum()) if getattr(out, "attention_mask", None) is not None \
        else out.pooler_output.shape[1]
    ids = [5, cfg.boa_token_id] + [cfg.audio_token_id] * n + [cfg.eoa_token_index, 4]
    return ids, {"input_features": audio["input_features"], "input_features_mask": mask}


def _greedy(model, ids: list[int], **media: torch.Tensor) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, **media)
    return out[0, len(ids):].tolist()


def test_media_tokens_are_in_the_tokenizer_and_the_config(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    ids = media_token_ids(config["text_config"]["vocab_size"])
    assert {n: tok.convert_tokens_to_ids(t) for n, t in MEDIA_TOKENS.items()} == ids
    assert (tok.image_token_id, tok.audio_token_id) == (ids["image_token"], ids["audio_token"])
    assert (config["image_token_id"], config["audio_token_id"], config["boi_token_id"]) == (
        ids["image_token"], ids["audio_token"], ids["boi_token"])
    chat = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "w5 w6"}, {"type": "image"}]}], tokenize=False,
        add_generation_prompt=True)
    assert tok(chat).input_ids.count(ids["image_token"]) == 1


def test_the_image_reaches_the_output_through_the_vision_tower(checkpoint: Path, model) -> None:  # noqa: ANN001
    ids, red_media = _image_prompt(model, _image(checkpoint, (200, 30, 30)))
    green_ids, green_media = _image_prompt(model, _image(checkpoint, (10, 200, 30)))
    assert green_ids == ids
    assert _greedy(model, ids, **red_media) != _greedy(model, ids, **green_media)


def test_the_audio_reaches_the_output_through_the_audio_tower(checkpoint: Path, model) -> None:  # noqa: ANN001
    ids, low = _audio_prompt(model, _audio(checkpoint, 220.0))
    ids_high, high = _audio_prompt(model, _audio(checkpoint, 3000.0))
    assert ids == ids_high
    assert _greedy(model, ids, **low) != _greedy(model, ids, **high)


def test_media_positions_read_row_0_of_the_table_and_text_does_not(checkpoint: Path) -> None:
    """Row 0 altered: the image request's tokens change, a text request's do not (the
    reference the offloaded model must match: its media positions post id 0)."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint,
                                                           dtype=torch.bfloat16).eval()
    ids, media = _image_prompt(model, _image(checkpoint, (200, 30, 30)))
    assert 0 not in ids and 0 not in TEXT
    before = _greedy(model, ids, **media), _greedy(model, TEXT)
    table = model.model.language_model.embed_tokens_per_layer.weight
    with torch.no_grad():
        table[0] = table[0] * -3 + 1
    after = _greedy(model, ids, **media), _greedy(model, TEXT)
    assert after[0] != before[0]
    assert after[1] == before[1]
