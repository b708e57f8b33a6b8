"""A plain (non-editable) ``pip install`` of the checkout gives a working product: from an
empty directory, ``torchrun -m fsdp_fp8 run`` prints the demo digest and ``fsdp-fp8 --help``
lists the subcommands.

Nothing is downloaded: the fresh venv sees this interpreter's site-packages (torch, torchao,
setuptools, ...) through a ``.pth`` file, pip runs with ``--no-index`` and no build
isolation, and the package is built from a copy of the packaged files only (so neither
``launch/`` nor the tests can be what makes it work).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = ("pyproject.toml", "README.md", "constraints.txt", "fsdp_fp8")


def _site_dirs() -> list[str]:
    """This interpreter's site-packages (a venv's own, and the system's when it sees them)."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    return sorted({d for d in dirs if os.path.isdir(d)})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGED:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(
            ROOT / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}),
        )
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "outer-site.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        OMP_NUM_THREADS="1",
        FSDP_FP8_CACHE=str(tmp / "cache"),
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-index",
            "--no-build-isolation",
            "-c",
            str(src / "constraints.txt"),
            f"{src}[hf]",
        ],  # the demo is a diffusers pipeline
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    empty = tmp / "empty"
    empty.mkdir()
    return venv, {"env": env, "cwd": empty}


def test_the_installed_package_is_the_copy_not_the_checkout(installed):
    venv, kw = installed
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import fsdp_fp8; print(fsdp_fp8.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout


def test_console_script_lists_the_subcommands(installed):
    venv, kw = installed
    proc = subprocess.run([str(venv / "bin" / "fsdp-fp8"), "--help"], capture_output=True, text=True, timeout=120, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: fsdp-fp8 ")
    for command in ("run", "inspect", "verify"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.M), proc.stdout


def _digests(obj):
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key.endswith("sha256"):
                yield value
            else:
                yield from _digests(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _digests(value)


def test_torchrun_module_run_prints_the_demo_digest_from_an_empty_directory(installed):
    venv, kw = installed
    # torchrun is torch.distributed.run; --standalone: a free local port, never a fixed one.
    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fsdp_fp8",
            "run",
            "--steps",
            "2",
            "--report",
            "report.json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((kw["cwd"] / "report.json").read_text())
    assert report["world_size"] == 2
    digests = list(_digests(report))  # top level or per output, whatever the demo produces
    assert digests and all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests), report
    assert all(f"sha256 {d}" in proc.stdout for d in digests), proc.stdout
