"""The released geometries the GPU benchmark builds (bench/cuda/geometry_model.py): their
tensors, the table ray-ple offloads from them and the plan it makes on the cuda transport;
and the writer itself, on CPU, for a narrowed copy of the Gemma 4 E4B config."""

from __future__ import annotations

import json
import math

import pytest

from bench.cuda import geometry_model
from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload
from ray_ple.protocol.geometry import geometry_from_config

# (model, parameters, layers, table rows, row bytes): Gemma 4 E4B's 42 x 256 bf16 row and
# Gemma 3n E4B's 35 x 256 (the text models' tensors, towers not included)
RELEASED = [("gemma-4-E4B", 7_463_000_000, 42, 262144, 21504),
            ("gemma-3n-E4B", 6_835_000_000, 35, 262144, 17920)]


@pytest.mark.parametrize("model, params, layers, rows, row_bytes", RELEASED)
def test_released_geometry_and_its_plan(model, params, layers, rows, row_bytes):
    shapes = geometry_model.tensor_shapes(model)
    total = sum(math.prod(s) for s in shapes.values())
    assert abs(total - params) < 5_000_000, total
    assert shapes["model.embed_tokens_per_layer.weight"] == (rows, row_bytes // 2)
    cfg = geometry_model.config(model)
    geometry = geometry_from_config(cfg, max_tokens=8192, engine_dtype="bfloat16",
                                    parts="auto", resident_layers="auto", transport="cuda")
    (table,) = geometry.tables
    assert (table.rows, table.row_bytes) == (rows, row_bytes)
    if model == "gemma-4-E4B":  # layer 0 resident, the rest in parts of 1, 2, 4, 8 and 26
        assert geometry.resident_layers == 1 and geometry.part_layers == (1, 2, 4, 8, 26)
        assert table.table_bytes == 5.25 * 2**30


def test_the_writer_makes_a_checkpoint_the_plan_accepts(tmp_path, monkeypatch):
    """A narrowed E4B config (every released key, small sizes) written on CPU: sharded
    safetensors with an index, the config and the word tokenizer; ray-ple plans it."""
    narrow = {**geometry_model.config("gemma-4-E4B"), "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
              "vocab_size": 512, "vocab_size_per_layer_input": 512, "head_dim": 32,
              "global_head_dim": 64, "hidden_size_per_layer_input": 16,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    monkeypatch.setattr(geometry_model, "config", lambda model: narrow)
    monkeypatch.setattr(geometry_model, "SHARD_BYTES", 64 << 10)
    out = geometry_model.build("gemma-4-E4B", tmp_path / "m", device="cpu")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "sharded"
    assert (out / "tokenizer.json").is_file()
    plan = plan_offload(str(out), PleConfig(), {"max_num_batched_tokens": 64}, "cuda")
    assert plan.geometry.tables[0].rows == 512
    assert geometry_model.build("gemma-4-E4B", tmp_path / "m", device="cpu") == out  # kept
