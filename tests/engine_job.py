"""One engine run in its own process: offloaded or plain vLLM-CPU, greedy tokens as JSON.

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


def _inventory(worker: Any) -> list[tuple[str, list[int]]]:
    model = worker.model_runner.model
    named = list(model.named_parameters()) + list(model.named_buffers())
    return [(n, list(t.shape)) for n, t in named]


def _overwrite_table(pairs: Any, fill: float) -> None:
    """Write into the node's shared table copy (as a second holder would see it)."""
    import numpy as np

    from ray_ple.offload.table_store import acquire_table
    from ray_ple.protocol.shm import PAGE

    table = acquire_table(pairs.sources[0], shm_dir="/dev/shm", deadline_s=30)
    view = np.ndarray((table.layer.rows, table.layer.row_bytes), np.uint8, table.segment.map,
                      PAGE)
    bf16_bits = np.array([fill], dtype=np.float32).view(np.uint32) >> 16
    view.view(np.uint16)[:] = bf16_bits.astype(np.uint16)
    table.close()


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from ray_ple.config import PleConfig
    from ray_ple.offline import offloaded_llm

    sp = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 8), ignore_eos=True)
    engine = {**ENGINE, **job.get("engine", {})}
    ple = PleConfig.model_validate(job.get("ple", {}))
    out: dict[str, Any] = {}
    with offloaded_llm(job["model"], ple, **engine) as llm:
        def generate(batches: list[list[list[int]]]) -> list[list[list[int]]]:
            return [[list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)]
                for batch in batches]

        out["tokens"] = generate(job["batches"])
        out["inventory"] = llm.collective_rpc(_inventory)
        pairs = getattr(llm, "ray_ple_pairs", None)
        if pairs is not None:
            out["status"] = [s.model_dump() for s in pairs.statuses()]
            if "overwrite_table" in job:
                _overwrite_table(pairs, job["overwrite_table"])
                out["tokens_after_overwrite"] = generate(job["batches"])
    return out


if __name__ == "__main__":
    import ray

    # collective_rpc of a test function (the worker's parameter inventory) needs pickle
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    result = run(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
