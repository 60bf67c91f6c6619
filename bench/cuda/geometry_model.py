"""A random-weight checkpoint of a released model's geometry (Gemma 4 E4B, Gemma 3n E4B).

No real checkpoint can be fetched where the benchmarks run, and what a GPU has left for the KV
cache depends only on the shapes: this writes the released text config (`configs/`, each
value's source in `configs/SOURCES.md`) with every tensor of the architecture's text model
filled from a seeded generator (bf16, std 0.02; norms and scalars 1), sharded safetensors,
and the word tokenizer of the tiny test models (`w<i>` for id i), so that a served model
takes text prompts. The text model only: the
vision and audio towers of the released checkpoints are left out (about 0.3 B parameters
that weigh the same with and without the offload).

    python -m bench.cuda.geometry_model --model gemma-4-E4B --out DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import time
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent / "configs"
# model -> (text config file, architecture, transformers class)
MODELS = {
    "gemma-4-E4B": ("gemma-4-E4B-text.json", "Gemma4ForCausalLM", "Gemma4ForCausalLM"),
    "gemma-3n-E4B": ("gemma-3n-E4B-text.json", "Gemma3nForCausalLM", "Gemma3nForCausalLM"),
}
SHARD_BYTES = 4 << 30
FORMAT = 2  # bump when what is written changes: a directory of another format is rebuilt


def config(model: str) -> dict[str, Any]:
    """The checkpoint's `config.json`: the released text config, as a causal LM."""
    name, arch, _ = MODELS[model]
    cfg = json.loads((CONFIGS / name).read_text())
    return {**cfg, "architectures": [arch], "torch_dtype": "bfloat16"}


def tensor_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, by name, from transformers' own class built on the
    meta device (nothing allocated); a tied `lm_head` is left out, as `save_pretrained` does."""
    import torch
    import transformers

    cfg = config(model)
    _, _, cls_name = MODELS[model]
    hf_config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        module = getattr(transformers, cls_name)(hf_config)
    shapes = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    if cfg.get("tie_word_embeddings", True):
        shapes.pop("lm_head.weight", None)
    return shapes


def _fill(name: str, shape: tuple[int, ...], gen: Any, device: str) -> Any:
    import torch

    if "norm" in name or "scalar" in name or len(shape) == 0 or len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    t = torch.empty(shape, dtype=torch.float32, device=device)
    t.normal_(0.0, 0.02, generator=gen)
    return t.to(torch.bfloat16)


def build(model: str, out: Path, device: str = "cuda", seed: int = 0) -> Path:
    """Write the checkpoint once (a complete directory of this format is kept; a build in
    another process is waited for)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(model, out, device, seed)


def _build(model: str, out: Path, device: str, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    done = out / ".complete"
    if done.exists() and json.loads(done.read_text()) == {"model": model, "format": FORMAT,
                                                          "seed": seed}:
        return out
    for old in out.glob("*.safetensors"):
        old.unlink()
    shapes = tensor_shapes(model)
    total = sum(math.prod(s) for s in shapes.values()) * 2
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    t0, written, shard, shard_bytes, index = time.monotonic(), 0, {}, 0, {}
    names = sorted(shapes)

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            fname = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            index.update({n: fname for n in shard})
            shard, shard_bytes = {}, 0
            print(json.dumps({"event": "geometry_model_progress", "model": model,
                              "written_gib": round(written / 2**30, 2),
                              "total_gib": round(total / 2**30, 2),
                              "elapsed_s": round(time.monotonic() - t0, 1)}), flush=True)

    for name in names:
        t = _fill(name, shapes[name], gen, device).cpu()
        shard[name] = t
        shard_bytes += t.numel() * 2
        written += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(config(model), indent=1))
    from ray_ple.checkpoints.words import word_tokenizer

    word_tokenizer(config(model)["vocab_size"], out)
    done.write_text(json.dumps({"model": model, "format": FORMAT, "seed": seed}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    build(args.model, args.out, args.device)


if __name__ == "__main__":
    main()
