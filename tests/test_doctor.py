"""`ray-ple doctor`, run as a pod runs it: one line per check, exit 1 on any FAIL."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

import pytest

from ray_ple.tools.doctor import DoctorArgs, check_host_memory, check_shm
from ray_ple.tools.quantity import GiB
from tests.leftovers import hugetlb_pool

LINE = re.compile(r"^(PASS|WARN|FAIL) (memlock|shm|cuda|host-memory|huge-pages|table): \S.*$")
pytestmark = pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="CPU machine checks")


def doctor(*args: str, memlock: int | None = None) -> tuple[int, dict[str, str]]:
    """Run `ray-ple doctor` in a fresh process; {check: status} from its lines."""
    def limit() -> None:
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))

    proc = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor", *args], check=False,
                          capture_output=True, text=True, timeout=60, preexec_fn=limit)
    lines = proc.stdout.splitlines()
    assert lines and all(LINE.match(line) for line in lines), proc.stdout + proc.stderr
    statuses = {line.split()[1].rstrip(":"): line.split()[0] for line in lines}
    assert len(statuses) == len(lines), "one line per check"
    return proc.returncode, statuses


def _free_shm() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def test_cpu_pod_passes_with_its_budget():
    rc, got = doctor("--transport", "cpu", "--table-bytes", "20480", "--pair-bytes", "24576",
                     "--object-store-bytes", "64Mi")
    assert rc == 0 and got == {"memlock": "PASS", "shm": "PASS", "cuda": "PASS",
                               "host-memory": "PASS", "huge-pages": "PASS"}


def test_table_larger_than_free_memory_fails():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    rc, got = doctor("--transport", "cpu", "--table-bytes", str(total + GiB))
    assert rc == 1 and got["host-memory"] == "FAIL" and got["shm"] == "FAIL"


def test_shm_smaller_than_table_slots_and_object_store_fails():
    rc, got = doctor("--transport", "cpu", "--table-bytes", "1Mi",
                     "--object-store-bytes", str(_free_shm() + GiB))
    assert rc == 1 and got["shm"] == "FAIL" and got["host-memory"] == "PASS"


def test_missing_shm_dir_fails():
    rc, got = doctor("--transport", "cpu", "--table-bytes", "1Mi",
                     "--shm-dir", "/nonexistent-ray-ple-shm")
    assert rc == 1 and got["shm"] == "FAIL"


def test_cuda_transport_without_a_gpu_fails():
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    rc, got = doctor("--transport", "cuda", "--pair-bytes", "1Mi", memlock=hard)
    assert rc == 1 and got["cuda"] == "FAIL"
    assert got["memlock"] == ("PASS" if hard >= (1 << 20) + 4096 else "FAIL")


def test_cuda_memlock_below_the_pair_segment_without_a_gpu_warns():
    """Below the pair segment the memlock check needs a GPU to try a registration."""
    rc, got = doctor("--transport", "cuda", "--pair-bytes", "176201728", memlock=64 * 1024)
    assert rc == 1 and got["memlock"] == "WARN" and got["cuda"] == "FAIL"


def test_cpu_transport_needs_no_memlock():
    rc, got = doctor("--transport", "cpu", "--pair-bytes", "176201728", memlock=64 * 1024)
    assert rc == 0 and got["memlock"] == "PASS"


def test_checkpoint_table_checked_against_its_budget(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 2, "vocab_size": 256,
        "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16}))
    need = 4096 + 256 * 2 * 16 * 2
    rc, got = doctor("--transport", "cpu", "--table-bytes", str(need),
                     "--checkpoint", str(tmp_path), "--dtype", "bfloat16")
    assert rc == 0 and got["table"] == "PASS"
    rc, got = doctor("--transport", "cpu", "--table-bytes", str(need - 1),
                     "--checkpoint", str(tmp_path), "--dtype", "bfloat16")
    assert rc == 1 and got["table"] == "FAIL"
    rc, got = doctor("--transport", "cpu", "--checkpoint", str(tmp_path / "absent"))
    assert rc == 1 and got["table"] == "FAIL"


def test_doctor_loads_no_cuda_and_no_torch_on_a_cpu_machine():
    code = ("import sys; from ray_ple.tools.cli import main; "
            "rc = main(['doctor', '--table-bytes', '20480']); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('cuda', 'torch', 'vllm', 'ray')); print('LOADED', bad); "
            "print('MAPPED', 'libcuda' in open('/proc/self/maps').read()); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout and "MAPPED False" in proc.stdout


def test_numbers_are_the_machines():
    """The lines carry this machine's real free space, not a constant."""
    args = DoctorArgs(table_bytes=0, object_store_bytes=0)
    shm, mem = check_shm(args), check_host_memory(args)
    assert shm.status == "PASS" and mem.status == "PASS"
    st = os.statvfs("/dev/shm")
    size_gib = st.f_blocks * st.f_frsize / GiB
    assert f"of {size_gib:.2f} GiB" in shm.detail


def test_doctor_says_where_the_table_will_sit_by_the_hugetlb_pool(huge_pool):
    """Never a FAIL: a pool that holds the table segment (header page + rows, rounded up to
    whole huge pages) means huge pages with `auto`; one page short, 4 KiB pages."""
    _, page = hugetlb_pool()
    segment = str(4096 + (64 << 20))  # 33 huge pages of 2 MiB

    def huge_line() -> str:
        out = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor", "--transport",
                              "cpu", "--table-bytes", segment], check=False,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return next(line for line in out.stdout.splitlines() if " huge-pages: " in line)

    need = -(-int(segment) // page)
    huge_pool(0)
    assert huge_line().startswith("PASS") and "the table goes on 4 KiB pages" in huge_line()
    if huge_pool(need) < need:
        pytest.skip("the host gave the pool fewer huge pages than the test needs")
    assert f"the table goes on {page >> 20} MiB pages" in huge_line()
    huge_pool(need - 1)
    assert "the table goes on 4 KiB pages" in huge_line()


def test_nothing_to_check_says_so_and_does_not_pass():
    """No sizes, checkpoint or config: not a PASS against "need 0 B"."""
    proc = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor"], check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "nothing to check" in proc.stderr


def test_the_logged_table_size_is_the_rows_and_the_budget_the_segment(tmp_path):
    """The server logs the rows (`table_bytes` 16384 for the tiny model); the segment holds a
    header page besides: doctor names both, so the FAIL against the rows says why."""
    from ray_ple.checkpoints.tiny import PRESETS, build

    ckpt = str(build(PRESETS["tiny-gemma4"]))
    out = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor", "--transport",
                          "cpu", "--table-bytes", "16384", "--checkpoint", ckpt], check=False,
                         capture_output=True, text=True, timeout=60)
    line = next(x for x in out.stdout.splitlines() if " table: " in x)
    assert out.returncode == 1 and line.startswith("FAIL"), out.stdout
    assert "(20480 B: header page + rows 256 x 64 B = 16384 B) > sized for 16384 B" in line


def test_config_figures_come_from_the_servers_plan(tmp_path):
    """`--config`: the per-layer vocabulary (192 rows, not the 256 of the vocabulary), the
    resident layer (its columns never in a slot) and the parts come from the config, as the
    server takes them; the node checks use those figures."""
    import yaml

    from tests.serving import load_config

    cfg = load_config()
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    llm["model_loading_config"]["model_source"] = "ray-ple://tiny-gemma4-ple192"
    llm["ple"].update(resident_layers=1, parts=2)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, got = doctor("--config", str(path))
    assert rc == 0 and set(got.values()) == {"PASS"}, got
    out = subprocess.run([sys.executable, "-m", "ray_ple.tools.cli", "doctor", "--config",
                          str(path)], check=False, capture_output=True, text=True, timeout=60)
    table = next(x for x in out.stdout.splitlines() if " table: " in x)
    # 192 rows x 3 layers x 16 values (bf16); slots: 2 offloaded layers in parts of 1
    assert "[192, 48] bfloat16 18432 B (segment 24576 B with its header page)" in table
    assert "slots 256 tokens x 64 B in parts [1, 1] after 1 resident of 3 layers" in table
    shm = next(x for x in out.stdout.splitlines() if " shm: " in x)
    assert "table 24.00 KiB + 1 x pair" in shm, shm
