"""vLLM's GPU runner on a released geometry, the PLE table offloaded vs on the GPU: the memory
it gives back and what that buys, side by side in one lease.

For each GPU memory budget (`--budgets`, a fraction of the card, or `l4`: what vLLM's default
0.9 takes of an NVIDIA L4's 22.5 GiB, here on a larger card), offload and plain run in turn
(`--first`), each `vllm.LLM` in its own process
(`ray_ple.offline.offloaded_llm`, the project's CUDA defaults, vLLM's default compile and
CUDA graphs). Per run, from vLLM's own log lines: the weights it loaded, its KV cache (GiB,
tokens) and the concurrency that fits `max_model_len`; from NVML, sampled every 20 ms: the
card's peak memory while the engine loaded (before vLLM reports the model loaded, so a table
allocated on the GPU during the load shows). Then greedy requests at each concurrency, all
submitted at once and stepped through vLLM's engine: output tokens/s, median TPOT and TTFT,
and the sha256 of every generated id (equal hashes: equal outputs). A last case at the
budget's long concurrency, in the second run only: as many 2,048-token requests as the
first run's KV cache holds (`--long-*`; none with `--only` or `--long-prompt-len 0`). Both
sides use vLLM's Triton attention (`--attention-backend`) and, with `--enforce-eager`, no
compile and no CUDA graphs; `--ple` sets the offload's `ple:` block (`{"parts": 1,
"resident_layers": 0}`: the whole row pulled at layer 0), `--only` runs one side.

    python -m bench.cuda.bench_vllm --model gemma-4-E4B --out DIR [--budgets l4 0.9]

One JSON line a measurement in `DIR/vllm_gpu.jsonl` (the keys of bench/README.md's figure
table); each run's log in `DIR/<variant>-<budget>.log`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
L4_GIB = 22.5  # NVIDIA L4: 23,034 MiB; vLLM takes gpu_memory_utilization of it (0.9)
LOG_PATTERNS = {
    "model_load_gib": r"Model loading took ([\d.]+) GiB",
    "kv_cache_gib": r"Available KV cache memory: (-?[\d.]+) GiB",
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
}
LOADED = "Model loading took"


# --- one engine (its own process) -----------------------------------------------------------
def _requests(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(n)]


def _measure(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """All prompts submitted at once, stepped to the end; per-request token times."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    engine = llm.llm_engine
    base = f"r{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        engine.add_request(base + str(i), {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ids: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            toks = list(o.outputs[0].token_ids)
            if toks and o.request_id not in first:
                first[o.request_id] = now
            if len(toks) > len(ids.get(o.request_id, [])):
                ids[o.request_id] = toks
                last[o.request_id] = now
    wall = time.perf_counter() - t0
    order = [base + str(i) for i in range(len(prompts))]
    tokens = sum(len(ids[r]) for r in order)
    tpots = sorted((last[r] - first[r]) / (len(ids[r]) - 1) for r in order if len(ids[r]) > 1)
    ttfts = sorted(first[r] - t0 for r in order)
    return {"output_tok_s": round(tokens / wall, 1), "tpot_ms": round(1e3 * _median(tpots), 3),
            "ttft_ms": round(1e3 * _median(ttfts), 1), "wall_s": round(wall, 3),
            "output_tokens": tokens,
            "ids_sha256": hashlib.sha256(json.dumps([ids[r] for r in order]).encode()
                                         ).hexdigest()}


def _median(xs: list[float]) -> float:
    return xs[len(xs) // 2] if xs else float("nan")


def _pair_info(worker: Any) -> dict[str, Any] | None:
    from ray_ple.worker import pair as worker_pair

    pair = worker_pair.current()
    return None if pair is None else {"post": "stream" if pair.stream_posts else "host",
                                      "slots": len(pair.handle.slot_names)}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import vllm

    from ray_ple.offline import offloaded_llm

    # the same scheduler budget on both sides (the offload's slots default to it)
    engine = {"dtype": "bfloat16", "max_model_len": job["max_model_len"],
              "gpu_memory_utilization": job["gpu_memory_utilization"],
              "max_num_seqs": job["max_num_seqs"], "max_num_batched_tokens": 8192,
              "skip_tokenizer_init": True, "seed": 0,
              "attention_backend": job.get("attention_backend", "TRITON_ATTN"),
              "enforce_eager": job.get("enforce_eager", False)}
    t0 = time.monotonic()
    out: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__}
    ple = ({**job.get("ple", {}), "enabled": True} if job["variant"] == "offload"
           else {"enabled": False})
    with offloaded_llm(job["checkpoint"], ple,
                       **engine) as llm:
        out["build_s"] = round(time.monotonic() - t0, 1)
        out["device"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                         else "cpu")
        (out["pair"],) = llm.collective_rpc(_pair_info)
        config = llm.llm_engine.vllm_config
        out["cudagraph_mode"] = str(config.compilation_config.cudagraph_mode)
        out["async_scheduling"] = bool(config.scheduler_config.async_scheduling)
        # warm-up, not recorded: each case's shapes once, so that no Triton kernel is
        # compiled inside a measured case (it would land in that case's first token)
        for case in job["cases"]:
            _measure(llm, _requests(case["concurrency"], case["prompt_len"], job["vocab"], 99), 4)
        cases = []
        for case in job["cases"]:
            prompts = _requests(case["concurrency"], case["prompt_len"], job["vocab"],
                                seed=case["concurrency"] * 1000 + case["prompt_len"])
            cases.append({**case, **_measure(llm, prompts, case["output_len"])})
            print(json.dumps({"event": "bench_vllm_case", "variant": job["variant"],
                              **cases[-1]}), flush=True)
        out["cases"] = cases
    return out


# --- the driver -----------------------------------------------------------------------------
class GpuSampler:
    """The card's used memory every 20 ms (NVML: every process, context included)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.total = pynvml.nvmlDeviceGetMemoryInfo(self._h).total
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._h).used

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append((time.monotonic(), self.used()))

    def __enter__(self) -> GpuSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def peak(self, until: float) -> int:
        return max((u for t, u in self.samples if t <= until), default=0)


def _end_group(proc: subprocess.Popen) -> None:
    """The run's whole process group (its engine processes too)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_variant(job: dict[str, Any], log: Path) -> dict[str, Any]:
    """One engine in its own process: its RESULT, what its log reported, the load peak."""
    base = GpuSampler()
    idle = base.used()
    loaded_at = None
    lines: list[str] = []
    with base, open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bench.cuda.bench_vllm", "--one",
                                 json.dumps(job)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        # a run that has not exited 30 s after its RESULT is ended (with its engine
        # processes), so that the next run finds the card free; its output is still read
        # to the end, into the log
        ender = threading.Timer(30, _end_group, (proc,))
        for line in proc.stdout:
            f.write(line)
            lines.append(line)
            if loaded_at is None and LOADED in line:
                loaded_at = time.monotonic()
            if line.startswith(("{\"event\": \"bench_vllm_case\"", "RESULT")) or \
                    any(k in line for k in ("Error", "KV cache size")):
                print(line.rstrip()[:400], flush=True)
            if line.startswith("RESULT ") and not ender.is_alive():
                ender.start()
        proc.wait()
        ender.cancel()
        _end_group(proc)
    text = "".join(lines)
    result_lines = [ln for ln in lines if ln.startswith("RESULT ")]
    if not result_lines:
        return {"error": f"exit {proc.returncode}", "tail": text[-3000:]}
    result = json.loads(result_lines[-1][len("RESULT "):])
    result["exit"] = proc.returncode  # -9: ended 30 s after its RESULT
    for key, pattern in LOG_PATTERNS.items():
        m = re.search(pattern, text)
        result[key] = (None if m is None else float(m.group(1).replace(",", "")))
    if result["kv_cache_tokens"] is not None:
        result["kv_cache_tokens"] = int(result["kv_cache_tokens"])
    if loaded_at is not None:
        result["load_peak_gib"] = round((base.peak(loaded_at) - idle) / 2**30, 3)
    result["card_total_gib"] = round(base.total / 2**30, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gemma-4-E4B")
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/ray-ple-geometry"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budgets", nargs="+", default=["l4", "0.9"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-prompt-len", type=int, default=2048, help="0: no long case")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    # vLLM's Triton attention: the FlashAttention build picks its CuTe kernels for E4B's
    # 512-wide global heads, which need the CUTLASS DSL the bundle leaves out
    ap.add_argument("--attention-backend", default="TRITON_ATTN")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--first", choices=["offload", "plain"], default="offload")
    ap.add_argument("--only", choices=["offload", "plain"],
                    help="one side (the other's figures from an earlier run)")
    ap.add_argument("--ple", type=json.loads, default={},
                    help='the offload\'s `ple:` block, as JSON (e.g. \'{"parts": 1}\')')
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    from bench.cuda.geometry_model import build, config

    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = build(args.model, args.checkpoint_dir / args.model)
    vocab = config(args.model)["vocab_size"]
    total_gib = GpuSampler().total / 2**30
    order = [args.only] if args.only else [
        args.first, "plain" if args.first == "offload" else "offload"]
    command = "python -m bench.cuda.bench_vllm " + " ".join(sys.argv[1:])
    for budget in args.budgets:
        util = round(0.9 * L4_GIB / total_gib, 4) if budget == "l4" else float(budget)
        cases = [{"concurrency": c, "prompt_len": args.prompt_len,
                  "output_len": args.output_len} for c in args.concurrency]
        long_c = None
        for variant in order:
            job = {"checkpoint": str(ckpt), "variant": variant, "gpu_memory_utilization": util,
                   "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                   "vocab": vocab, "attention_backend": args.attention_backend,
                   "enforce_eager": args.enforce_eager, "ple": args.ple,
                   "cases": cases + ([{"concurrency": long_c,
                                                       "prompt_len": args.long_prompt_len,
                                                       "output_len": args.output_len,
                                                       "long": True}] if long_c else [])}
            r = run_variant(job, args.out / f"{variant}-{budget}.log")
            common = {"model": args.model, "variant": variant, "budget": budget,
                      "gpu_memory_utilization": util, "max_model_len": args.max_model_len,
                      "enforce_eager": args.enforce_eager,
                      "ple": args.ple if variant == "offload" else None, "command": command}
            if "error" in r:
                line = {**common, "error": r["error"], "tail": r["tail"][-1500:]}
                with open(args.out / "vllm_gpu.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
                print(json.dumps(line)[:3000], flush=True)
                continue
            if long_c is None and args.long_prompt_len > 0 and r.get("max_concurrency"):
                # as many long requests as this run's KV cache holds at once (the first run
                # sets it; `--first offload` makes that the offload's)
                long_c = min(args.max_num_seqs, int(r["max_concurrency"] * args.max_model_len
                                                    // (args.long_prompt_len + args.output_len)))
            for case in r.pop("cases"):
                line = {**common, **{k: v for k, v in r.items() if k != "pair"},
                        "post": (r["pair"] or {}).get("post"), **case}
                with open(args.out / "vllm_gpu.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            print(json.dumps({k: r.get(k) for k in ("device", "build_s", "model_load_gib",
                                                    "load_peak_gib", "kv_cache_gib",
                                                    "kv_cache_tokens", "max_concurrency")}
                             | {"variant": variant, "budget": budget}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a fn
    main()
