"""A bad checkpoint is one `PleModelError` before anything starts, never a traceback or rows.

Safetensors files cut short, with oversized or lying lengths, headers that are not JSON or
not an object, entries of the wrong types, offsets that disagree with shape x dtype, overlap
or run past the end, and seeded random byte flips of a valid header: each is refused by the
header check (`read_header`) with the file's name, by the plan (`check_checkpoint`, so
`build_app` and `ray-ple check` give the same one line), and by the offload side's table load,
which publishes nothing and leaves no segment or fd behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from ray_ple.checkpoints.tiny import PRESETS, build
from ray_ple.config import PleConfig
from ray_ple.engine_plan import plan_offload, table_sources
from ray_ple.errors import PleModelError
from ray_ple.offload.table_file import TableFile, read_header
from ray_ple.offload.table_store import acquire_table
from ray_ple.protocol.geometry import geometry_from_config, read_hf_config
from ray_ple.tools.check import main as check
from tests.leftovers import ple_shm_entries
from tests.serving import load_config

TABLE = "model.embed_tokens_per_layer.weight"


def _file(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _valid() -> tuple[dict, bytes]:
    """A table (4 x 6 bf16) and a second tensor after it (2 f32), as safetensors lays them."""
    return ({TABLE: {"dtype": "BF16", "shape": [4, 6], "data_offsets": [0, 48]},
             "other": {"dtype": "F32", "shape": [2], "data_offsets": [48, 56]},
             "__metadata__": {"format": "pt"}}, bytes(range(56)))


def _entry(**change: object) -> Callable[[dict], None]:
    return lambda h: h[TABLE].update(change)


# name -> the file's bytes
def _cases() -> dict[str, bytes]:
    header, data = _valid()
    good = _file(header, data)

    def edited(edit: Callable[[dict], None]) -> bytes:
        h = json.loads(json.dumps(header))
        edit(h)
        return _file(h, data)

    return {
        "empty": b"",
        "length-cut": good[:5],
        "header-cut": good[:20],
        "data-cut": good[:-3],
        "length-huge": _file(header, data, length=1 << 62),
        "length-past-end": _file(header, data, length=len(json.dumps(header)) + 100),
        "length-zero": _file(header, data, length=0),
        "not-utf8": _file(b"\xff\xfe\x00{", data),
        "not-json": _file(b"{\"a\": ", data),
        "json-list": _file(b"[1, 2]", data),
        "json-null": _file(b"null", data),
        "entry-not-object": edited(lambda h: h.update({TABLE: [0, 48]})),
        "dtype-missing": edited(lambda h: h[TABLE].pop("dtype")),
        "dtype-unknown": edited(_entry(dtype="BF17")),
        "shape-string": edited(_entry(shape="4,6")),
        "shape-negative": edited(_entry(shape=[-4, 6])),
        "shape-float": edited(_entry(shape=[4.0, 6])),
        "shape-bool": edited(_entry(shape=[True, 48])),
        "offsets-one": edited(_entry(data_offsets=[0])),
        "offsets-string": edited(_entry(data_offsets=[0, "48"])),
        "offsets-reversed": edited(_entry(data_offsets=[48, 0])),
        "offsets-short-tensor": edited(_entry(data_offsets=[0, 40])),
        "offsets-long-tensor": edited(_entry(shape=[4, 5])),
        "offsets-past-end": edited(lambda h: h["other"].update(data_offsets=[52, 60])),
        "overlap": edited(lambda h: h["other"].update(data_offsets=[40, 48])),
        "metadata-list": edited(lambda h: h.update({"__metadata__": ["pt"]})),
    }


CASES = _cases()


def _open(path: Path) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd, str(path))[0]
    finally:
        os.close(fd)


def test_a_valid_header_reads():
    header, data = _valid()
    assert set(_open_bytes(_file(header, data))) == {TABLE, "other", "__metadata__"}


def _open_bytes(raw: bytes, tmp: Path | None = None) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(tmp or d) / "model.safetensors"
        path.write_bytes(raw)
        return _open(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_header_is_one_error_naming_the_file(case, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(CASES[case])
    with pytest.raises(PleModelError, match=f"^{path} is not a valid safetensors file: "):
        _open(path)


def test_random_flips_of_a_valid_header_are_a_model_error_or_a_valid_header(tmp_path):
    """500 seeded mutations (flipped, inserted and deleted bytes in the header): never another
    exception; what still parses is self-consistent (its entries fit the data)."""
    header, data = _valid()
    raw = json.dumps(header).encode()
    rng = random.Random(38)
    path = tmp_path / "model.safetensors"
    outcomes = {"refused": 0, "valid": 0}
    for _ in range(500):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            op = rng.choice(("flip", "insert", "delete"))
            if op == "flip":
                b[i] = rng.randrange(256)
            elif op == "insert":
                b.insert(i, rng.choice(b"0123456789[]{},:\"-."))
            else:
                del b[i]
        path.write_bytes(_file(bytes(b), data))
        try:
            got = _open(path)
        except PleModelError:
            outcomes["refused"] += 1
            continue
        outcomes["valid"] += 1
        for name, e in got.items():
            if name != "__metadata__":
                assert 0 <= e["data_offsets"][0] <= e["data_offsets"][1] <= len(data)
    assert outcomes["refused"] > 100 and outcomes["valid"] > 0, outcomes


@pytest.fixture
def bad_checkpoint(tmp_path):
    """The tiny Gemma 4 with its safetensors file replaced (the rest linked): (dir, write)."""
    src = build(PRESETS["tiny-gemma4"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != ".complete":
            (ckpt / f.name).symlink_to(f)

    def write(raw: bytes) -> None:
        (ckpt / "model.safetensors").write_bytes(raw)

    return ckpt, write


@pytest.mark.parametrize("case", ["header-cut", "offsets-short-tensor", "overlap", "json-list",
                                  "data-cut"])
def test_the_plan_and_the_offload_side_refuse_it_and_leave_nothing(case, bad_checkpoint):
    """The plan refuses it before anything starts; the offload side's table load (what an
    offload actor runs at setup) refuses it too, with no segment or fd left."""
    ckpt, write = bad_checkpoint
    write(CASES[case])
    with pytest.raises(PleModelError, match="is not a valid safetensors file") as planned:
        plan_offload(str(ckpt), PleConfig(), {}, "cpu")
    geometry = geometry_from_config(read_hf_config(str(ckpt)), max_tokens=64)
    (source,) = table_sources(geometry, str(ckpt), None)
    fds, shm = set(os.listdir("/proc/self/fd")), ple_shm_entries()
    with pytest.raises(PleModelError) as loaded:
        acquire_table(source, shm_dir="/dev/shm", deadline_s=10, huge_pages="off")
    assert str(loaded.value) == str(planned.value)
    with pytest.raises(PleModelError):
        TableFile.open(source)
    assert set(os.listdir("/proc/self/fd")) <= fds and ple_shm_entries() == shm


def test_ray_ple_check_reports_the_same_error(bad_checkpoint, tmp_path, capsys):
    ckpt, write = bad_checkpoint
    write(CASES["offsets-short-tensor"])
    cfg = load_config()
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    llm["model_loading_config"]["model_source"] = str(ckpt)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert check(str(path)) == 1
    out, err = capsys.readouterr()
    with pytest.raises(PleModelError) as planned:
        plan_offload(str(ckpt), PleConfig(), {}, "cpu")
    assert out == "" and err == f"{planned.value}\n", err


def test_an_index_naming_a_missing_shard_is_refused(bad_checkpoint):
    ckpt, write = bad_checkpoint
    header, data = _valid()
    write(_file(header, data))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {TABLE: "model-00002.safetensors"}}))
    with pytest.raises(PleModelError, match="names files that are not in"):
        plan_offload(str(ckpt), PleConfig(), {}, "cpu")
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(PleModelError, match="not a readable JSON index"):
        plan_offload(str(ckpt), PleConfig(), {}, "cpu")
    shutil.rmtree(ckpt)
