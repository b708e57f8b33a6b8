"""Section ``preflight``: what the box lacks, by name, before any work (each carried wheel by
file name, each module the sections import, a C compiler and ``Python.h``, a CUDA device of
capability >= 8.9). No torch import at module level: a broken torch is a finding, not a crash."""

from __future__ import annotations

import os
import re
import shutil
import sysconfig
from pathlib import Path

from bench.gpu_smoke.context import Context
from bench.harness import ROOT

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores (Ada, Hopper)

# What each section imports from outside the standard library (preflight names the missing).
NEEDS = {
    "versions": ("torch",),
    "tests": ("torch", "torchao", "safetensors", "numpy", "pytest"),
    "gemm": ("torch", "torchao"),
    "load": ("torch", "torchao", "safetensors", "numpy"),
    "step": ("torch", "torchao"),
    "allgather": ("torch", "torchao"),
    "alltoall": ("torch", "torchao", "diffusers"),
    "demo": ("torch", "torchao", "safetensors", "numpy", "diffusers", "transformers", "tokenizers", "huggingface_hub"),
    "attention": ("torch", "torchao", "diffusers"),
}


def carried_wheels() -> list[str]:
    """The ``name==version`` pins bench/fetch_wheels.sh downloads, in its order."""
    text = (ROOT / "bench" / "fetch_wheels.sh").read_text()
    block = text.split("# --- wheels ---", 1)[1].split("# --- end ---", 1)[0]
    return re.findall(r"([A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+)", block)


def wheel_key(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_wheels(wheels: Path) -> list[str]:
    """Each pinned wheel with no file in ``wheels``, as ``name==version``."""
    have = set()
    for f in wheels.glob("*.whl") if wheels.is_dir() else []:
        name, version = f.name.split("-")[:2]
        have.add((wheel_key(name), version))
    missing = []
    for pin in carried_wheels():
        name, version = pin.split("==")
        if (wheel_key(name), version) not in have:
            missing.append(pin)
    return missing


def wheels_to_install(wheels: Path) -> list[str]:
    """The carried wheel files whose distribution this Python lacks at that version."""
    from importlib import metadata

    chosen = []
    for f in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        name, version = f.name.split("-")[:2]
        try:
            if metadata.version(name) == version:
                continue
        except metadata.PackageNotFoundError:
            pass
        chosen.append(str(f))
    return chosen


def compiler_problems() -> list[str]:
    """What torch.compile's fused kernels need from the box: a C compiler and Python.h."""
    problems = []
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if not any(shutil.which(c) for c in (cc, "cc", "gcc", "clang")):
        problems.append(f"no C compiler on PATH ({cc}, cc, gcc, clang): inductor and triton build with one")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        problems.append(f"{header} is missing (the python3-dev package): inductor and triton compile against it")
    return problems


def section_preflight(ctx: Context) -> None:
    import importlib.util

    wheels = Path(ctx.args.wheels) if ctx.args else ROOT / "bench" / "wheels"
    with ctx.variant("modules") as r:
        needed = sorted({m for mods in NEEDS.values() for m in mods})
        absent = [m for m in needed if importlib.util.find_spec(m) is None]
        r.update(missing=absent, blocks={s: [m for m in mods if m in absent] for s, mods in NEEDS.items()})
        if absent:
            r["status"] = "failed"
    with ctx.variant("wheels") as r:
        # A missing wheel matters where its module is missing too; a box that has them all passes.
        missing = missing_wheels(wheels)
        r.update(directory=str(wheels), missing=missing, carried=len(carried_wheels()) - len(missing))
        if missing and absent:
            r["status"] = "failed"
            r["fix"] = "run bench/fetch_wheels.sh where the package index is reachable, then bench/gpu_smoke.sh"
    with ctx.variant("compiler") as r:
        r["problems"] = compiler_problems()
        r["blocks"] = ["W8A8 fused quant", "W8A16 fused"]
        if r["problems"]:
            r["status"] = "failed"
    with ctx.variant("device") as r:
        if ctx.fake or ctx.dry:
            r.update(status="skipped", reason="--fake-cuda / --dry: no CUDA device is asked for")
            return
        import torch  # inside the variant: a missing or broken torch is this record's error

        if not torch.cuda.is_available():
            r.update(status="failed", problems=["no CUDA device (torch.cuda.is_available() is False)"])
        else:
            caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
            low = [
                f"GPU {i}: capability {c[0]}.{c[1]} < 8.9 (no FP8)" for i, c in enumerate(caps) if c < MIN_CAPABILITY
            ]
            r.update(count=len(caps), capabilities=[list(c) for c in caps], problems=low)
            if low:
                r["status"] = "failed"
