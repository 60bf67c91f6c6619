"""Every bad input is one clear error before anything is published (and nothing is left)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from ray_ple.config import PleConfig, PleDeadlines
from ray_ple.errors import (
    PleConfigError,
    PleHandleError,
    PleModelError,
    PleShmError,
    PleTokenCountError,
)
from ray_ple.protocol.geometry import geometry_from_config, read_hf_config
from ray_ple.protocol.handles import PairHandle
from ray_ple.protocol.layout import ControlBlock, State
from ray_ple.protocol.shm import SharedSegment, free_bytes
from ray_ple.protocol.transaction import Phase
from ray_ple.worker.pair import WorkerPair
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, start_offload, write_checkpoint


def test_unknown_ple_keys_rejected():
    with pytest.raises(ValidationError, match="enabeld"):
        PleConfig.model_validate({"enabeld": True})
    with pytest.raises(ValidationError, match="step_seconds"):
        PleConfig.model_validate({"deadlines": {"step_seconds": 3}})


def test_unknown_ple_keys_rejected_by_the_builder():
    from ray_ple.serve.builder import offload_llm_config

    with pytest.raises(PleConfigError, match=r"llm_configs\[0\]\.ple\.offload_cpus"):
        offload_llm_config({"model_loading_config": {"model_id": "x", "model_source": "/nope"},
                            "ple": {"offload_cpus": 2}})


def test_model_without_ple_table(tmp_path):
    cfg = {"architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 2,
           "hidden_size_per_layer_input": 0, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PleModelError, match="no PLE table"):
        geometry_from_config(read_hf_config(tmp_path), max_tokens=16)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PleModelError, match="no PLE table ray-ple can offload"):
        geometry_from_config(read_hf_config(tmp_path), max_tokens=16)


def _gemma(tmp_path, arch: str, layers: int):
    cfg = {"architectures": [arch], "num_hidden_layers": layers,
           "hidden_size_per_layer_input": 8, "vocab_size": 256, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_hf_config(tmp_path)


@pytest.mark.parametrize(("layers", "parts", "split"), [
    (42, "auto", (1, 2, 4, 8, 27)), (35, "auto", (1, 2, 4, 8, 20)), (8, "auto", (1, 2, 5)),
    (7, "auto", (1, 2, 4)), (6, "auto", ()), (2, "auto", ()), (42, 7, (6,) * 7),
    (8, 3, (2, 3, 3)), (42, 1, ()), (42, [3, 39], (3, 39)), (4, [1, 1, 1, 1], (1, 1, 1, 1)),
])
def test_parts_split_the_row_as_configured(tmp_path, layers, parts, split):
    ple = PleConfig.model_validate({"parts": parts})
    geo = geometry_from_config(_gemma(tmp_path, "Gemma4ForCausalLM", layers), max_tokens=8,
                               parts=ple.parts)
    assert geo.parts == split
    assert sum(geo.part_layers) == layers


@pytest.mark.parametrize(("arch", "layers", "parts", "match"), [
    ("Gemma4ForCausalLM", 42, [1, 2, 4], r"ple.parts=\[1, 2, 4\]: .* add up to 42"),
    ("Gemma4ForCausalLM", 8, 9, r"ple.parts=9: .* so 1..8 parts"),
    ("Gemma3nForCausalLM", 8, [4, 4], r"ple.parts=\[4, 4\]: .* pulls the whole row before"),
    ("Gemma3nForCausalLM", 8, 2, r"ple.parts=2: .* pulls the whole row before"),
    ("Gemma3nForCausalLM", 42, [5], r"ple.parts=\[5\]: .* add up to 42"),
])
def test_parts_that_do_not_fit_the_model_are_one_clear_error(tmp_path, arch, layers, parts,
                                                             match):
    ple = PleConfig.model_validate({"parts": parts})
    with pytest.raises(PleConfigError, match=match):
        geometry_from_config(_gemma(tmp_path, arch, layers), max_tokens=8, parts=ple.parts)


@pytest.mark.parametrize(("resident", "parts", "split", "first"), [
    (1, "auto", (1, 2, 4, 8, 26), 1), (2, [40], (), 2), (1, 2, (20, 21), 1), (41, "auto", (), 41),
])
def test_resident_layers_are_left_out_of_the_slots(tmp_path, resident, parts, split, first):
    ple = PleConfig.model_validate({"parts": parts, "resident_layers": resident})
    geo = geometry_from_config(_gemma(tmp_path, "Gemma4ForCausalLM", 42), max_tokens=8,
                               parts=ple.parts, resident_layers=ple.resident_layers)
    assert geo.parts == split and geo.resident_layers == resident
    slots = geo.slots()
    assert slots[0].first_layer == first and slots[0].col_offset == first * 8 * 2
    assert sum(s.num_layers for s in slots) == 42 - resident


@pytest.mark.parametrize(("arch", "layers", "transport", "resident"), [
    ("Gemma4ForCausalLM", 42, "cuda", 1), ("Gemma4ForCausalLM", 42, "cpu", 0),
    ("Gemma4ForCausalLM", 1, "cuda", 0), ("Gemma3nForCausalLM", 35, "cuda", 0),
])
def test_auto_keeps_layer_0_resident_on_the_cuda_transport_only(tmp_path, arch, layers,
                                                                 transport, resident):
    ple = PleConfig()
    assert ple.resident_layers == "auto"
    geo = geometry_from_config(_gemma(tmp_path, arch, layers), max_tokens=8, parts=ple.parts,
                               resident_layers=ple.resident_layers, transport=transport)
    assert geo.resident_layers == resident
    assert geo.slots()[0].first_layer == resident


@pytest.mark.parametrize("resident", [-1, 129, "1", True, 1.0, "all"])
def test_malformed_resident_layers_are_rejected_by_the_config_in_one_message(resident):
    with pytest.raises(ValidationError, match="ple.resident_layers=") as exc:
        PleConfig.model_validate({"resident_layers": resident})
    assert exc.value.error_count() == 1


@pytest.mark.parametrize(("arch", "resident", "parts", "match"), [
    ("Gemma4ForCausalLM", 42, "auto", r"ple.resident_layers=42: .* so 0..41"),
    ("Gemma4ForCausalLM", 2, [42],
     r"ple.parts=\[42\]: .* offloads 40 layers \(after ple.resident_layers=2\), .* add up to 40"),
    ("Gemma4ForCausalLM", 1, 42,
     r"ple.parts=42: .* offloads 41 layers \(after ple.resident_layers=1\), so 1..41"),
    ("Gemma3nForCausalLM", 1, "auto", r"ple.resident_layers=1: .* pulls the whole row .* so 0"),
])
def test_resident_layers_that_do_not_fit_are_one_clear_error(tmp_path, arch, resident, parts,
                                                            match):
    ple = PleConfig.model_validate({"parts": parts, "resident_layers": resident})
    with pytest.raises(PleConfigError, match=match):
        geometry_from_config(_gemma(tmp_path, arch, 42), max_tokens=8, parts=ple.parts,
                             resident_layers=ple.resident_layers)


@pytest.mark.parametrize("parts", [[], [0, 2], [2, -1], 0, 129, "half", "3", True, [True, 41],
                                   [2.0, 2]])
def test_malformed_parts_are_rejected_by_the_config_in_one_message(parts):
    with pytest.raises(ValidationError, match="ple.parts=") as exc:
        PleConfig.model_validate({"parts": parts})
    assert exc.value.error_count() == 1


def test_one_part_as_a_list_is_the_whole_row_for_gemma3n(tmp_path):
    geo = geometry_from_config(_gemma(tmp_path, "Gemma3nForCausalLM", 8), max_tokens=8,
                               parts=PleConfig.model_validate({"parts": [8]}).parts)
    assert geo.parts == () and geo.part_layers == (8,)


@pytest.fixture()
def live_pair(tmp_path):
    path = tmp_path / "ckpt"
    write_checkpoint(path, rows=100)
    spec = spec_for(path, max_tokens=16)
    proc, handle, conn = start_offload(spec)
    yield spec, handle
    conn.send("stop")
    proc.join(10)


@pytest.mark.parametrize("mutate, match", [
    (lambda h: h["slots"][0].update(name="model.other_table"), "slot names"),
    (lambda h: h.update(layout_version=2), "layout version 2, this side speaks 3"),
    (lambda h: h["slots"][0].update(stamp_offset=h["slots"][0]["stamp_offset"] + 64),
     "stamp_offset"),
    (lambda h: h["slots"][0].update(col_offset=8), "col_offset"),
    (lambda h: h["slots"][0].update(num_layers=1), "num_layers"),
    (lambda h: h["control"].update(sleeping_offset=0), "control offsets"),
    (lambda h: h["control"].update(announced_offset=640), "control offsets"),
    (lambda h: h["slots"][0].update(row_elems=h["slots"][0]["row_elems"] * 2), "row_elems"),
    (lambda h: h["slots"][0].update(dtype="float16"), "dtype"),
    (lambda h: h["slots"][0].update(slot_offset=h["slots"][0]["slot_offset"] + 4096),
     "slot_offset"),
    (lambda h: h["control"].update(max_tokens=32), "max_tokens"),
    (lambda h: h.update(rank=1), "rank 1"),
    (lambda h: h["segment"].update(token="0" * 32), "token"),
    (lambda h: h["segment"].update(inode=h["segment"]["inode"] + 1), "inode"),
    (lambda h: h.update(table_fingerprint="f" * 64), "fingerprint"),
])
def test_bad_handle_rejected_before_anything_is_published(live_pair, mutate, match):
    spec, handle = live_pair
    bad = json.loads(json.dumps(handle))
    mutate(bad)
    with pytest.raises(PleHandleError, match=match):
        WorkerPair.attach(PairHandle.model_validate(bad), spec.geometry, rank=0, transport="cpu",
                          deadlines=PleDeadlines(), heartbeat_s=1.0)
    good = PairHandle.model_validate(handle)
    block = ControlBlock(SharedSegment.attach(good.segment), good.layout())
    assert block.state is State.INIT and block.counters() == (0, (0,), 0)


def test_too_many_tokens_rejected_before_posting(live_pair):
    spec, handle = live_pair
    pair = WorkerPair.attach(PairHandle.model_validate(handle), spec.geometry, rank=0,
                             transport="cpu", deadlines=PleDeadlines(), heartbeat_s=1.0)
    with pytest.raises(PleTokenCountError, match="17 tokens"):
        pair.worker.begin(np.arange(17, dtype=np.int32))
    assert pair.block.counters() == (0, (0,), 0) and pair.worker.phase is Phase.IDLE
    pair.close()


def test_shm_too_small_for_the_slots(tmp_path):
    too_big = free_bytes("/dev/shm") + (1 << 30)
    with pytest.raises(PleShmError, match="too small"):
        SharedSegment.create("pair", too_big)
    path = tmp_path / "ckpt"
    write_checkpoint(path, rows=100)
    # slots for 2**40 tokens: the offload side refuses at setup, before any handle exists
    with pytest.raises(RuntimeError, match="PleShmError.*too small"):
        start_offload(spec_for(path, max_tokens=1 << 40))
    assert ple_shm_entries() == []

