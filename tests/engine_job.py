"""One engine run in its own process: offloaded or plain vLLM (CPU, or CUDA on a GPU
machine: `engine` overrides the defaults), greedy tokens as JSON.

`python -m tests.engine_job '<json job>'` prints one line `RESULT <json>`. A separate
process per engine keeps every test's environment, memory and vLLM state its own.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ENGINE = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
              enforce_eager=True, seed=0, gpu_memory_utilization=0.3)


def _pair_info(worker: Any) -> dict[str, Any] | None:
    """How this worker's pair runs: who posts, its slots (None: no pair, a plain engine)."""
    from ray_ple.worker import pair as worker_pair

    pair = worker_pair.current()
    if pair is None:
        return None
    config = worker.model_runner.vllm_config
    return {"stream_posts": pair.stream_posts, "slots": list(pair.handle.slot_names),
            "transport": type(pair.transport).__name__,
            "async_scheduling": bool(config.scheduler_config.async_scheduling),
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "compile_mode": str(config.compilation_config.mode)}


def _kill_mid_decode(llm: Any, pairs: Any, job: dict[str, Any],
                     sp_long: Any) -> dict[str, Any]:
    """Kill the offload actors once a long generate has run `kill_after_steps` steps; what
    that generate and the next one return (or raise) is the outcome."""
    import threading
    import time

    steps = int(job["kill_mid_decode"])
    start = pairs.statuses()[0].posted

    def killer() -> None:
        while pairs.statuses()[0].posted < start + steps:
            time.sleep(0.005)
        pairs.kill()

    thread = threading.Thread(target=killer, daemon=True)
    prompts = [{"prompt_token_ids": p} for p in job["batches"][0]]
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    thread.start()
    try:
        out["during"] = {"tokens": [list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, sp_long, use_tqdm=False)]}
    except Exception as exc:  # noqa: BLE001 - what the user sees is the point
        out["during"] = {"error": type(exc).__name__, "seconds": round(time.monotonic() - t0, 2)}
    thread.join(timeout=60)
    t0 = time.monotonic()
    try:
        out["after"] = {"tokens": [list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, sp_long, use_tqdm=False)]}
    except Exception as exc:  # noqa: BLE001
        out["after"] = {"error": type(exc).__name__, "seconds": round(time.monotonic() - t0, 2)}
    return out


def _inventory(worker: Any) -> list[tuple[str, list[int]]]:
    model = worker.model_runner.get_model()  # the module itself, under any graph wrapper
    named = list(model.named_parameters()) + list(model.named_buffers())
    return [(n, list(t.shape)) for n, t in named]


def _altered_copy(checkpoint: str, fill: float, out_dir: str, row: int | None = None) -> str:
    """The checkpoint with every PLE row (or only `row`) set to `fill`, all else shared
    (symlinks).

    The node table is a sealed, read-only copy of the checkpoint's tensor: nothing can alter
    it in place, so the altered table is served from an altered checkpoint instead.
    """
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(checkpoint), Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).symlink_to(f.resolve())
            continue
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if "embed_tokens_per_layer" in name:
                (t if row is None else t[row]).fill_(fill)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return str(dst)


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from ray_ple.config import PleConfig
    from ray_ple.offline import offloaded_llm

    sp = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 8), ignore_eos=True)
    engine = {**ENGINE, **job.get("engine", {})}
    ple = PleConfig.model_validate(job.get("ple", {}))
    out: dict[str, Any] = {}
    def generate(batches: list[list[list[int]]], params: Any = sp) -> list[list[list[int]]]:
        return [[list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
            for batch in batches]

    with offloaded_llm(job["model"], ple, **engine) as llm:
        out["tokens"] = generate(job["batches"])
        out["inventory"] = llm.collective_rpc(_inventory)
        out["pair"] = llm.collective_rpc(_pair_info)
        pairs = getattr(llm, "ray_ple_pairs", None)
        if pairs is not None:
            out["status"] = [s.model_dump() for s in pairs.statuses()]
        if "kill_mid_decode" in job:  # tokens of a long generate (plain: its reference)
            sp_long = SamplingParams(temperature=0, max_tokens=job["long_tokens"],
                                     ignore_eos=True)
            if pairs is None:
                out["long"] = generate([job["batches"][0]], sp_long)[0]
            else:
                out["kill"] = _kill_mid_decode(llm, pairs, job, sp_long)
        if job.get("kill_offload"):  # offline there is no supervisor: the worker's checks end it
            import time

            pairs.kill()
            t0 = time.monotonic()
            try:
                out["after_kill"] = {"tokens": generate(job["batches"][:1])}
            except Exception as exc:  # noqa: BLE001 - what the user sees is the point
                out["after_kill"] = {"error": type(exc).__name__,
                                     "seconds": round(time.monotonic() - t0, 2)}
    if "altered_table" in job:  # the same engine over a checkpoint whose PLE rows differ
        import tempfile

        from ray_ple.checkpoints.source import resolve

        with tempfile.TemporaryDirectory() as tmp:
            altered = _altered_copy(resolve(job["model"]), job["altered_table"], tmp)
            with offloaded_llm(altered, ple, **engine) as llm:
                out["tokens_altered_table"] = generate(job["batches"])
    return out


if __name__ == "__main__":
    import ray

    from tests.engines import report

    # collective_rpc of a test function (the worker's parameter inventory) needs pickle
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    result = run(json.loads(sys.argv[1]))
    report(result)
