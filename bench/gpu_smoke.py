"""GPU smoke check for a bare CUDA box: figures per section, written as they are measured.

    bash bench/gpu_smoke.sh smoke.jsonl                                    # on the GPU box (installs the wheels)
    python -m bench.gpu_smoke --out smoke.jsonl [--quick]     # the same, wheels already importable
    python -m bench.gpu_smoke --dry --out smoke.jsonl         # CPU, scaled-down shapes
    python -m bench.gpu_smoke --fake-cuda --out smoke.jsonl   # CPU build, fake CUDA tensors

It measures; it does not judge correctness. The correctness checks (FP8 GEMMs against an fp32
reference, ``_scaled_mm`` in the profiler, the all-gather hooks' bytes, NCCL loads and the demo
at one and many GPUs) are the tests in ``tests/gpu``, which the ``tests`` section runs with
pytest and reports test by test.

Each section runs in a child process under its own time budget (``BUDGETS``; ``--quick`` fits
all of them in 6 minutes on one H200), and every variant of a section in its own ``try``. The
results file is JSON lines, appended and flushed as each variant finishes: a record per
variant ``{"section", "variant", "status", ...figures}``, a record closing each section
(``"variant": null``: ``ok``, ``failed``, ``timeout``, ``crashed`` or ``skipped``, with its
seconds and the end of its stderr), and a last ``summary``. A timeout or a crash keeps what
finished; ``load_results`` folds the file back into one dict.

Sections:
  preflight  what is missing, by name, before any work: each carried wheel (bench/fetch_wheels.sh
             lists them) by file name, each module the sections import, a C compiler and
             ``Python.h`` (torch.compile's fused kernels), a CUDA device of capability >= 8.9
  versions   python, torch, CUDA, NCCL, torchao, device name, capability and count
  tests      pytest on tests/gpu, one record per test (--quick leaves out the two-world demo test)
  gemm       ms and TFLOP/s of each FP8 linear mode (BF16, W8A8, W8A8 fast accumulation, W8A8
             fused quantization, W8A16, W8A16 fused) at the 64B model's shapes, and each one's
             relative error against fp32 as a figure
  load       GB/s of ``load_model`` onto the device (cold page cache) against the floors of the
             same files: raw read, host-to-device (pinned, pageable), read + copy; load / floor in
             time and CPU seconds per GB (user and sys) of the load and the raw read; then load and
             ``LoadedModel.close()`` five times: ``torch.cuda.memory_allocated`` (RSS on the CPU)
             after each close against before the first load
  step       one layer of the 64B model (hidden 5120, 4096 latent + 256 prompt tokens), CFG step
             (2 forwards) per precision and kernel option
  allgather  the uint8 all-gather of uneven shards (zero-row ranks included) under torchrun at
             the largest world the box allows (one GPU per rank), ms and GB/s per weight shape
  alltoall   Ulysses attention's all-to-alls (q/k/v to heads, the output back) under torchrun at
             the largest world the box allows, the 64B model's 720p video among the shapes: the
             rows and heads every rank gets back, ms and GB/s (needs 2 GPUs; --dry: gloo, 3 ranks)
  demo       ``torchrun launch/infer.py`` at min(8, GPU count) ranks under NCCL: seconds, load,
             digest, watchdog/terminate lines; then once with ``--cache seacache``: the steps
             computed and reused, the wall ratio to the uncached run, whether the latent differs
  attention  one 720p-sized attention call (44,160 rows, Super-sized GQA heads, bf16) per attention
             backend this GPU can run (--attention-backend's names), ms and TFLOP/s; the others
             skipped with the reason the launcher would give
  decode     a Wan 2.2-shaped VAE (random weights, BF16) at 720p: one rank's tiled decode against
             the split over every GPU (bench/vae_decode_ranks.py under torchrun): seconds and each
             rank's peak allocated, the frames compared byte for byte; on fake CUDA the gather's
             packing (tests/unit/test_fake_cuda_vae_decode.py's check)

``--dry`` runs every section on the CPU with small shapes (what CI can run); ``--fake-cuda``
runs the CUDA code paths of ``gemm``, ``step`` and ``allgather`` on fake CUDA tensors
(bench/smoke_fake_cuda.py; torch's fake process group for the all-gather), so CUDA's layout,
alignment and device rules are checked on a CPU build; there nothing is timed, and the
sections fake CUDA cannot run say why. The exit code is 1 if any section failed or timed out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness

ROOT = harness.ROOT

# Seconds per section: (--quick on one H200, full run). The quick ones sum to 360 s, at the
# 6-minute goal with room for the driver; bench/gpu_smoke.sh's own timeout (--outer-timeout)
# is their sum plus TIMEOUT_MARGIN_S, so a section's budget always ends first.
BUDGETS = {
    "preflight": (10, 30),
    "versions": (15, 30),
    "tests": (80, 600),  # 100 before the decode section took 30 of the quick 6 minutes
    "gemm": (45, 120),  # the two fused variants compile on first use (inductor, triton)
    "load": (25, 180),
    "step": (40, 240),
    "allgather": (25, 90),
    "alltoall": (15, 60),
    "demo": (75, 600),  # the first run also builds the demo checkpoint into the cache
    "attention": (10, 60),
    "decode": (20, 240),
}
TIMEOUT_MARGIN_S = 60
# After a section's budget: SIGTERM, this long for torchrun to stop its ranks, then SIGKILL. The
# margin above covers it for all eight sections and the driver's own seconds.
KILL_GRACE_S = 5
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores (Ada, Hopper)
# The 64B model's projection shapes (M tokens, K in, N out): attention (5120 -> 5120) and the
# MLP's up (5120 -> 20480) and down (20480 -> 5120), 4096 latent tokens.
GEMM_SHAPES = [(4096, 5120, 5120), (4096, 5120, 20480), (4096, 20480, 5120)]
DRY_GEMM_SHAPES = [(77, 64, 96)]
# Under fake CUDA nothing is timed: every input layout a linear meets, at the smallest shapes
# CUDA takes (K and N multiples of 16), is run once per mode instead.
FAKE_GEMM_ROWS = (0, 1, 7, 16, 77)
FAKE_GEMM_IN, FAKE_GEMM_OUT = 64, 96
MODES = {  # variant -> (Float8StaticLinear.mode, fused, fast_accum); None: the BF16 nn.Linear
    "BF16": None,
    "W8A8": ("native", False, False),
    "W8A8 fast accum": ("native", False, True),
    "W8A8 fused quant": ("native", True, False),
    "W8A16": ("a16", False, False),
    "W8A16 fused": ("a16", True, False),
}
FAKE_REFUSES_COMPILE = (
    "torch.compile for CUDA cannot be faked on a CPU build: inductor generates triton kernels, "
    "which need triton and a device"
)
# Lines that mean a rank was killed or a collective timed out, even when the exit code is 0.
BAD_LINES = re.compile(
    r"watchdog|terminate called|Terminating process|SIGTERM|SIGABRT|"
    r"destroy_process_group\(\) was not called",
    re.IGNORECASE,
)
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON-lines results file (appended; its directory is created)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry", action="store_true", help="CPU only, scaled-down shapes")
    mode.add_argument("--fake-cuda", action="store_true", help="CUDA code paths on fake tensors (CPU build)")
    p.add_argument("--quick", action="store_true", help="the quick budgets and sizes (6 minutes on one H200)")
    p.add_argument(
        "--wheels", default=str(ROOT / "bench" / "wheels"), help="the carried wheels (preflight names the missing)"
    )
    p.add_argument("--only", help="comma-separated sections to run (default: all)")
    p.add_argument("--budget", action="append", default=[], metavar="SECTION=SECONDS", help="override a budget")
    p.add_argument("--demo-ranks", type=int, help="ranks for the demo (default: min(8, GPUs); 2 dry)")
    p.add_argument(
        "--outer-timeout", action="store_true", help="print the budgets' sum plus a margin (seconds) and exit"
    )
    p.add_argument("--wheels-to-install", action="store_true", help="print the carried wheels this Python lacks")
    p.add_argument("--section", help=argparse.SUPPRESS)  # the child process of one section
    return p.parse_args(argv)


# --- results -------------------------------------------------------------------------------


class Results:
    """Append-only JSON lines, flushed and synced per record: a kill loses nothing written."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def load_results(path: Path) -> dict:
    """``{"sections": {name: {"status", "variants": {variant: record}, ...}}, "summary": ...}``."""
    out: dict = {"sections": {}, "summary": None}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line of a process killed while writing it
            out["unreadable_lines"] = out.get("unreadable_lines", 0) + 1
            continue
        if record.get("section") == "summary":
            out["summary"] = record
            continue
        section = out["sections"].setdefault(record["section"], {"variants": {}})
        if record.get("variant") is None:
            section.update(record)
        else:
            section["variants"][record["variant"]] = record
    return out


@dataclass
class Context:
    """What a section needs: its device and mode, and where its records go."""

    section: str
    device: object  # torch.device
    dry: bool
    fake: bool
    quick: bool
    emit: object  # callable(record)
    args: argparse.Namespace | None = None
    records: list = field(default_factory=list)

    def record(self, variant: str, status: str, **figures) -> None:
        rec = {"section": self.section, "variant": variant, "status": status, **figures}
        self.records.append(rec)
        self.emit(rec)

    def skip(self, variant: str, reason: str) -> None:
        self.record(variant, "skipped", reason=reason)

    @contextlib.contextmanager
    def variant(self, name: str):
        """One variant in its own try: a failure is recorded and the section goes on."""
        figures: dict = {}
        t0 = time.perf_counter()
        try:
            yield figures
        except Exception as exc:  # noqa: BLE001 - recorded; the next variant still runs
            self.record(
                name,
                "failed",
                error=f"{type(exc).__name__}: {exc}"[:2000],
                traceback=traceback.format_exc()[-3000:],
                seconds=round(time.perf_counter() - t0, 3),
                **figures,
            )
        else:
            status = figures.pop("status", "ok")
            self.record(name, status, seconds=round(time.perf_counter() - t0, 3), **figures)

    def place(self, t):
        """A CPU tensor on this context's device (a fake of the same layout under fake CUDA)."""
        if self.fake:
            from bench.smoke_fake_cuda import placed

            return placed(t, self.device)
        return t.to(self.device)

    def sync(self) -> None:
        if self.device.type == "cuda" and not self.fake:
            import torch

            torch.cuda.synchronize(self.device)


# --- preflight (no torch import in the driver: a broken torch is a finding, not a crash) ----


def carried_wheels() -> list[str]:
    """The ``name==version`` pins bench/fetch_wheels.sh downloads, in its order."""
    text = (ROOT / "bench" / "fetch_wheels.sh").read_text()
    block = text.split("# --- wheels ---", 1)[1].split("# --- end ---", 1)[0]
    return re.findall(r"([A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+)", block)


def _wheel_key(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_wheels(wheels: Path) -> list[str]:
    """Each pinned wheel with no file in ``wheels``, as ``name==version``."""
    have = set()
    for f in wheels.glob("*.whl") if wheels.is_dir() else []:
        name, version = f.name.split("-")[:2]
        have.add((_wheel_key(name), version))
    missing = []
    for pin in carried_wheels():
        name, version = pin.split("==")
        if (_wheel_key(name), version) not in have:
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


# --- measuring sections ---------------------------------------------------------------------


def section_versions(ctx: Context) -> None:
    import importlib

    import torch

    with ctx.variant("software") as r:
        r.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
        for mod in ("torchao", "safetensors", "numpy", "diffusers", "transformers", "triton"):
            try:
                r[mod] = importlib.import_module(mod).__version__
            except ImportError as exc:
                r[mod] = f"missing: {exc}"
    if ctx.device.type != "cuda" or ctx.fake:
        ctx.skip("device", "no real CUDA device: name, capability and NCCL not read")
        return
    with ctx.variant("device") as r:
        r.update(
            name=torch.cuda.get_device_name(ctx.device),
            capability=list(torch.cuda.get_device_capability(ctx.device)),
            count=torch.cuda.device_count(),
            memory_bytes=torch.cuda.get_device_properties(ctx.device).total_memory,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )


PYTEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def section_tests(ctx: Context) -> None:
    """pytest on tests/gpu, one record per test as pytest reports it (a timeout keeps those),
    then the same records again with their messages from the junit file."""
    import xml.etree.ElementTree as ET

    if ctx.fake:
        ctx.skip("pytest", "tests/gpu compare values on a real GPU; fake tensors hold none")
        return
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu")]
        cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        if ctx.quick:
            cmd += ["-k", "not demo_on_every_gpu"]  # the demo at two worlds: the demo section runs it once
        with ctx.variant("pytest") as r:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tail: list[str] = []
            for line in proc.stdout:
                tail = (tail + [line])[-60:]
                hit = PYTEST_LINE.match(line)
                if hit:
                    outcome = hit[2]
                    status = "failed" if outcome in ("FAILED", "ERROR") else "skipped" if outcome == "SKIPPED" else "ok"
                    ctx.record(hit[1], status, outcome=outcome)
            rc = proc.wait()
            r.update(exit=rc, tail="".join(tail)[-3000:])
            if rc not in (0, 5):  # 5: nothing collected
                r["status"] = "failed"
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
                name = f"{path}::{case.get('name')}"
                outcome = {c.tag: (c.get("message") or "")[:1500] for c in case}
                status = "failed" if {"failure", "error"} & set(outcome) else "ok"
                status = "skipped" if "skipped" in outcome else status
                ctx.record(name, status, seconds=float(case.get("time", 0)), **outcome)


def _fp8_linear(weight, bias, dtype):
    """A Float8StaticLinear holding ``weight`` quantized per tensor, as ModelOpt would: both
    scales are made on the codes' device (a CPU scale beside CUDA codes is a device mix)."""
    import torch
    from torch import nn

    from fsdp_fp8 import Float8StaticLinear
    from fsdp_fp8.fp8.tensor import E4M3_MAX, make_static_fp8_weight

    out_f, in_f = weight.shape
    scale = weight.float().abs().amax().clamp(min=1e-12) / E4M3_MAX
    codes = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    input_scale = torch.full((), 4.0 / E4M3_MAX, dtype=torch.float32, device=codes.device)
    lin = Float8StaticLinear(in_f, out_f, bias is not None, dtype, device=weight.device)
    fp8 = make_static_fp8_weight(codes, scale.reshape(()), input_scale, dtype)
    lin.weight = nn.Parameter(fp8, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin.eval()


def _fused_problems(ctx: Context) -> str | None:
    """Why the fused (compiled) variants cannot run here (None: they can)."""
    if ctx.fake:
        return FAKE_REFUSES_COMPILE
    problems = compiler_problems()
    return f"preflight: {'; '.join(problems)}" if problems else None


def _set_mode(module, spec) -> None:
    from fsdp_fp8 import Float8StaticLinear
    from fsdp_fp8.fp8.kernels import KernelOptions

    mode, fused, fast_accum = spec
    for m in module.modules():  # a bench's switch between variants; a load fixes them (LoadOptions.kernels)
        if isinstance(m, Float8StaticLinear):
            m.mode, m.kernels = mode, KernelOptions(fused=bool(fused), fast_accum=bool(fast_accum))


def _timed(ctx: Context, fn, reps: int) -> list[float]:
    fn()  # warm-up (and any compilation) outside the timing
    return harness.sample_seconds(fn, reps, before=ctx.sync, after=ctx.sync)


def section_gemm(ctx: Context) -> None:
    import torch
    from torch import nn

    dtype = torch.bfloat16
    if ctx.fake:
        shapes = [(rows, FAKE_GEMM_IN, FAKE_GEMM_OUT) for rows in FAKE_GEMM_ROWS]
        inputs = [lambda m, k: (m, k), lambda m, k: (1, m, k), lambda m, k: (2, 1, m, k)]
    else:
        shapes = DRY_GEMM_SHAPES if ctx.dry else GEMM_SHAPES
        inputs = [lambda m, k: (m, k)]
    reps = 0 if ctx.fake else (2 if ctx.dry else (10 if ctx.quick else 50))
    fused_problems = _fused_problems(ctx)
    for m, k, n in shapes:
        gen = torch.Generator().manual_seed(m * 31 + k + n)
        weight = ctx.place((torch.randn(n, k, generator=gen) / k**0.5).to(dtype))
        bias = ctx.place((0.1 * torch.randn(n, generator=gen)).to(dtype))
        bf16 = nn.Linear(k, n, dtype=dtype, device="meta")
        bf16.weight, bf16.bias = nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)
        fp8 = _fp8_linear(weight, bias, dtype)
        for shape_of in inputs:
            x = ctx.place(torch.randn(shape_of(m, k), generator=gen).to(dtype))
            ref = None
            for name, spec in MODES.items():
                variant = f"{name} x{tuple(x.shape)}->{n}"
                if spec is not None and spec[1] and fused_problems:
                    ctx.skip(variant, fused_problems)
                    continue
                with ctx.variant(variant) as r, torch.no_grad():
                    layer = bf16 if spec is None else fp8
                    if spec is not None:
                        _set_mode(fp8, spec)
                    y = layer(x)
                    r.update(out_shape=list(y.shape), out_device=str(y.device), out_dtype=str(y.dtype))
                    if ctx.fake:
                        continue
                    if ref is None:  # fp32 of the same values: what every mode approximates
                        ref = x.float().reshape(-1, k) @ weight.float().t() + bias.float()
                    r["rel_err_vs_fp32"] = float((y.float().reshape(ref.shape) - ref).norm() / ref.norm())
                    samples = _timed(ctx, lambda: layer(x), reps)
                    t = statistics.median(samples)
                    r.update(median_ms=round(t * 1e3, 4), tflops=round(2 * m * k * n / t / 1e12, 2))


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _cpu_s() -> tuple[float, float]:
    """(user, sys) CPU seconds of this process so far, every thread (the reader's workers too)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _per_gb(cpu0: tuple[float, float], nbytes: int) -> dict:
    """CPU seconds per GB of ``nbytes`` since ``cpu0`` (``_cpu_s``), user and sys."""
    user, sys_s = (b - a for a, b in zip(cpu0, _cpu_s()))
    return {"cpu_user_s_per_gb": round(user / (nbytes / 1e9), 3), "cpu_sys_s_per_gb": round(sys_s / (nbytes / 1e9), 3)}


LOAD_ROWS, LOAD_COLS = 4096, 4096  # one FP8 linear of the load checkpoint: 16 MiB of codes


def write_load_checkpoint(directory: Path, size: int, rows: int = LOAD_ROWS, cols: int = LOAD_COLS) -> int:
    """A static-FP8 checkpoint of ``size`` bytes of codes in 1 GiB shards: ``layers.<i>`` linears of
    (rows, cols), random codes (no E4M3 NaN pattern), one weight and one input scale each.
    Returns the number of linears."""
    import torch

    from fsdp_fp8.format.writer import TensorSpec, plan_checkpoint, quantization_configs, write_checkpoint

    count = max(1, size // (rows * cols))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(count):
        codes = torch.randint(0, 0x7F, (rows, cols), dtype=torch.uint8, generator=generator)  # < 0x7F: no NaN
        tensors[f"layers.{i}.weight"] = codes.view(torch.float8_e4m3fn)
        tensors[f"layers.{i}.weight_scale"] = torch.tensor(0.01)
        tensors[f"layers.{i}.input_scale"] = torch.tensor(0.02)
    layout = plan_checkpoint((TensorSpec.of(k, t) for k, t in tensors.items()), max_shard_size=1 << 30)
    quant, hf_quant = quantization_configs([])
    directory.mkdir(parents=True)
    write_checkpoint(directory, tensors, layout, {"layers": count, "quantization_config": quant}, hf_quant)
    return count


def _stack_fn(rows: int, cols: int):
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16) for _ in range(config["layers"])
            )

    return Stack


def section_load(ctx: Context) -> None:
    """GB/s of ``load_model`` onto the device against the floors of the same files."""
    import torch

    from fsdp_fp8 import load_model

    if ctx.fake:
        ctx.skip("load_model", "file bytes into device memory cannot be faked: fake tensors hold no data")
        return
    size = (64 << 20) if ctx.dry else ((1 << 30) if ctx.quick else (4 << 30))
    runs = 2 if ctx.quick or ctx.dry else 3
    chunk = 64 << 20
    cuda = ctx.device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        directory = Path(tmp) / "ckpt"
        linears = write_load_checkpoint(directory, size)
        files = sorted(directory.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        fds = [os.open(f, os.O_RDONLY) for f in files]
        floors = {}
        try:

            def evict() -> None:
                for fd in fds:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def read_all(buf, sink=None) -> float:
                view = memoryview(buf.numpy())
                evict()
                cpu[0] = _cpu_s()
                t0 = time.perf_counter()
                for fd in fds:
                    off = 0
                    while n := os.preadv(fd, [view], off):
                        off += n
                        if sink is not None:
                            sink(buf)
                ctx.sync()
                return time.perf_counter() - t0

            cpu = [_cpu_s()]
            pageable = torch.empty(chunk, dtype=torch.uint8)
            with ctx.variant("raw read") as r:
                r.update(file_bytes=size, gbps=_gbps(size, min(read_all(pageable) for _ in range(runs))))
                r.update(_per_gb(cpu[0], size))  # (the last run's)
                floors["raw read"] = r["gbps"]
            with ctx.variant("load_model") as r:
                best = None
                for _ in range(runs):
                    evict()
                    cpu0, t0 = _cpu_s(), time.perf_counter()
                    loaded = load_model(_stack_fn(LOAD_ROWS, LOAD_COLS), directory, device=ctx.device)
                    ctx.sync()
                    seconds = time.perf_counter() - t0
                    per_gb = _per_gb(cpu0, loaded.report.bytes_read)
                    rep = loaded.report
                    loaded.close()  # the device memory and the descriptors, now
                    del loaded
                    if cuda:
                        torch.cuda.empty_cache()
                    if best is None or rep.read_seconds < best[1].read_seconds:
                        best = (seconds, rep, per_gb)
                seconds, rep, per_gb = best
                r.update(
                    fp8_linears=linears,
                    bytes_read=rep.bytes_read,
                    read_gbps=_gbps(rep.bytes_read, rep.read_seconds),
                    whole_gbps=_gbps(rep.bytes_read, seconds),
                    reads=rep.reads,
                    **per_gb,
                    note="page cache evicted (POSIX_FADV_DONTNEED) before each read and each load",
                )
            _load_close_cycles(ctx, directory)
            if not cuda:
                ctx.skip("h2d", "no CUDA device: host-to-device copies not measured")
            else:
                dest = torch.empty(chunk, dtype=torch.uint8, device=ctx.device)
                pinned = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)

                def h2d(src, reps: int = 20) -> float:
                    dest.copy_(src, non_blocking=src.is_pinned())
                    ctx.sync()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        dest.copy_(src, non_blocking=src.is_pinned())
                    ctx.sync()
                    return _gbps(reps * chunk, time.perf_counter() - t0)

                def copy_out(buf):
                    dest.copy_(buf, non_blocking=buf.is_pinned())
                    if buf.is_pinned():
                        ctx.sync()  # the staging buffer is reused by the next read

                for name, buf in (("pinned", pinned), ("pageable", pageable)):
                    with ctx.variant(f"h2d {name}") as r:
                        r["gbps"] = h2d(buf)
                        floors[f"{name} host-to-device"] = r["gbps"]
                    with ctx.variant(f"read + h2d {name}") as r:
                        r["gbps"] = _gbps(size, min(read_all(buf, copy_out) for _ in range(runs)))
            with ctx.variant("vs floor") as r:
                load = next(x for x in ctx.records if x["variant"] == "load_model")
                raw = next(x for x in ctx.records if x["variant"] == "raw read")
                usable = {k: v for k, v in floors.items() if "pageable" not in k}
                limit = min(usable, key=usable.get)
                # The target: load GB/s per rank >= 80% of min(storage read, pinned H2D). In time,
                # load / floor (issue 40's <= 1.15); CPU per GB of the load beside the raw read's.
                r.update(
                    floor=limit,
                    floor_gbps=usable[limit],
                    load_vs_floor=round(load["read_gbps"] / usable[limit], 3),
                    load_time_over_floor=round(usable[limit] / load["read_gbps"], 3),
                    load_cpu_s_per_gb=round(load["cpu_user_s_per_gb"] + load["cpu_sys_s_per_gb"], 3),
                    raw_read_cpu_s_per_gb=round(raw["cpu_user_s_per_gb"] + raw["cpu_sys_s_per_gb"], 3),
                )
        finally:
            for fd in fds:
                os.close(fd)


CLOSE_CYCLES = 5


def _memory_in_use(device) -> int:
    """Bytes in use where the loads put their tensors: CUDA's allocated bytes, else this process's RSS."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _load_close_cycles(ctx: Context, directory: Path) -> None:
    """``load_model`` then ``LoadedModel.close()``, CLOSE_CYCLES times: the memory in use after
    each close against before the first load (the bar: within 5% of one load's bytes)."""
    import torch

    from fsdp_fp8 import load_model

    unit = "cuda memory_allocated" if ctx.device.type == "cuda" else "RSS"
    with ctx.variant(f"load/close x{CLOSE_CYCLES}") as r:
        start = _memory_in_use(ctx.device)
        loaded_bytes, after_close = [], []
        for _ in range(CLOSE_CYCLES):
            with load_model(_stack_fn(LOAD_ROWS, LOAD_COLS), directory, device=ctx.device):
                loaded_bytes.append(_memory_in_use(ctx.device) - start)
            after_close.append(_memory_in_use(ctx.device) - start)
        one_load = min(loaded_bytes)
        r.update(
            measure=unit,
            start_bytes=start,
            one_load_bytes=one_load,
            after_close_bytes=after_close,
            within_5pct_of_one_load=max(after_close) <= 0.05 * one_load,
        )
        if ctx.device.type == "cuda":
            r["reserved_bytes"] = torch.cuda.memory_reserved(ctx.device)  # the caching allocator keeps them


def _outside_fake(ctx: Context):
    if not ctx.fake:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _layer_config(ctx: Context):
    import dataclasses

    from fsdp_fp8.models import PRESETS, MoTConfig

    if ctx.dry or ctx.fake:
        # tiny, with an FFN width CUDA's _scaled_mm takes (multiples of 16; tiny's is 88)
        return dataclasses.replace(PRESETS["tiny"], intermediate_size=96), 16, 8
    s = PRESETS["super"]
    cfg = MoTConfig(
        hidden_size=s.hidden_size,
        num_layers=1,
        num_heads=s.num_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate_size,
        vocab_size=16,
        latent_channels=16,
    )
    return cfg, 4096, 256


def _to_fp8(layer, dtype):
    """The layer with every linear of its towers swapped for a per-tensor FP8 one."""
    from torch import nn

    for module in list(layer.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, _fp8_linear(child.weight.detach(), child.bias, dtype))
    return layer


def section_step(ctx: Context) -> None:
    import copy

    import torch

    from fsdp_fp8.models.mot import MoTLayer
    from fsdp_fp8.models.ops import RotaryEmbedding

    cfg, latent, prompt = _layer_config(ctx)
    dtype = torch.bfloat16
    reps = 0 if ctx.fake else (2 if ctx.dry else (5 if ctx.quick else 10))
    torch.manual_seed(0)
    # Built on the (real) meta device, then materialized on ctx's: nn.init's CUDA generator has
    # no fake, and modules made inside the fake mode hold fakes that ``.to`` cannot swap.
    with _outside_fake(ctx), torch.device("meta"):
        bf16 = MoTLayer(cfg).to(dtype).eval()
    bf16.to_empty(device=ctx.device)
    for p in bf16.parameters():
        p.requires_grad_(False)
        p.normal_(0, cfg.hidden_size**-0.5)
    fp8 = _to_fp8(copy.deepcopy(bf16), dtype)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)  # CPU tables, placed like any input
    rope_p = tuple(ctx.place(t) for t in rope(torch.arange(prompt)))
    rope_l = tuple(ctx.place(t) for t in rope(torch.arange(prompt, prompt + latent)))
    h_prompt = ctx.place(torch.randn(1, prompt, cfg.hidden_size, dtype=dtype))
    h = ctx.place(torch.randn(1, latent, cfg.hidden_size, dtype=dtype))
    shape = {"hidden": cfg.hidden_size, "heads": cfg.num_heads, "head_dim": cfg.head_dim}
    shape.update(intermediate=cfg.intermediate_size, latent_tokens=latent, prompt_tokens=prompt)
    ctx.record("shape", "ok", **shape)
    with torch.no_grad():
        _, kv = bf16(h_prompt, rope_p, phase="reason")

    def cfg_step(layer) -> None:
        layer(h, rope_l, kv, phase="generate")
        layer(h, rope_l, None, phase="generate")

    times = {}
    fused_problems = _fused_problems(ctx)
    for name, spec in MODES.items():
        if spec is not None and spec[1] and fused_problems:
            ctx.skip(name, fused_problems)
            continue
        layer = bf16 if spec is None else fp8
        with ctx.variant(name) as r, torch.no_grad():
            if spec is not None:
                _set_mode(fp8, spec)
            if ctx.device.type == "cuda" and not ctx.fake:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            if ctx.fake:
                cfg_step(layer)
                continue
            samples = _timed(ctx, lambda: cfg_step(layer), reps)
            times[name] = statistics.median(samples)
            r.update(median_ms=round(times[name] * 1e3, 3), all_ms=[round(s * 1e3, 3) for s in samples])
            if "BF16" in times:
                r["vs_bf16"] = round(times[name] / times["BF16"], 3)
            if ctx.device.type == "cuda":
                r["peak_device_bytes"] = torch.cuda.max_memory_allocated(ctx.device)


def _allgather_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("uneven_allgather", ROOT / "tests" / "gpu" / "uneven_allgather.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_allgather(ctx: Context) -> None:
    import torch

    worker = _allgather_module()
    if ctx.fake:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        world = 8
        for rank in (0, world - 1):  # a rank with rows and one with none
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                for rows, cols in worker.cases(world, large=False):
                    with ctx.variant(f"fake world {world} rank {rank} rows {rows}") as r:
                        r.update(worker.gather_case(rows, cols, world, rank, ctx.device, fake=True, place=ctx.place))
            finally:
                dist.destroy_process_group()
        ctx.skip("torchrun", "the collective's bytes and time need real ranks (--dry: gloo, CUDA: NCCL)")
        return
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 3
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp, ctx.variant(f"world {world}") as r:
        report = Path(tmp) / "allgather.json"
        args = ["--report", str(report), "--reps", "2" if ctx.dry else "20"] + ([] if ctx.dry else ["--large"])
        env = dict(os.environ, OMP_NUM_THREADS="1") if ctx.dry else None
        rc, text = harness.torchrun(world, "tests/gpu/uneven_allgather.py", *args, env=env)
        r.update(exit=rc, bad_lines=[x for x in text.splitlines() if BAD_LINES.search(x)][:10])
        if rc != 0 or not report.exists():
            r.update(status="failed", tail=text[-3000:])
            return
        got = json.loads(report.read_text())
        rank0 = [x for x in got["records"] if x["rank"] == 0]
        r.update(backend=got["backend"], world=got["world"])
        r["cases"] = [{k: x.get(k) for k in ("rows", "cols", "padded_rows", "ms", "gbps")} for x in rank0]
        r["zero_row_ranks"] = sorted({x["rank"] for x in got["records"] if x["local_rows"] == 0})
        # reported, not judged: tests/gpu/test_gpu_nccl.py asserts the bytes
        r["bytes_equal_everywhere"] = all(x["bytes_equal"] and x["out_reused_equal"] for x in got["records"])


def section_alltoall(ctx: Context) -> None:
    import torch

    if ctx.fake:
        ctx.skip("torchrun", "a real collective between ranks; the local packing runs on fake CUDA in the CPU suite")
        return
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 3
    if world < 2:
        ctx.skip("torchrun", f"{world} GPU: a Ulysses group needs two (NCCL refuses two ranks on one GPU)")
        return
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp, ctx.variant(f"world {world}") as r:
        report = Path(tmp) / "alltoall.json"
        args = ["--report", str(report), "--reps", "2" if ctx.dry else "10"] + ([] if ctx.dry else ["--large"])
        env = dict(os.environ, OMP_NUM_THREADS="1") if ctx.dry else None
        rc, text = harness.torchrun(world, "tests/gpu/ulysses_all_to_all.py", *args, env=env)
        r.update(exit=rc, bad_lines=[x for x in text.splitlines() if BAD_LINES.search(x)][:10])
        if rc != 0 or not report.exists():
            r.update(status="failed", tail=text[-3000:])
            return
        got = json.loads(report.read_text())
        r.update(backend=got["backend"], world=got["world"])
        rank0 = [x for x in got["records"] if x["rank"] == 0]
        r["cases"] = [{k: x.get(k) for k in ("rows", "heads", "chunk", "ms", "gbps")} for x in rank0]
        # reported, not judged: tests/gpu/test_gpu_nccl.py asserts the rows and heads
        r["rows_equal_everywhere"] = all(x["heads_equal"] and x["round_trip_equal"] for x in got["records"])


def section_demo(ctx: Context) -> None:
    import torch

    if ctx.fake:
        ctx.skip("torchrun", "a whole pipeline in subprocesses, with data-dependent indexing; --dry runs it on CPU")
        return
    args = ctx.args
    env = dict(os.environ)
    steps = ["--steps", "4" if ctx.quick else "8"]
    if ctx.dry:  # the CPU's emulated FP8 GEMM is slow: fewer steps and tokens
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        steps = ["--steps", "2", "--latent-tokens", "16"]
    default = 2 if ctx.dry else min(8, torch.cuda.device_count())
    ranks = (args.demo_ranks if args else None) or default
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        for i in range(1 if ctx.quick else 2):
            with ctx.variant(f"run {i} at {ranks} ranks") as r:
                report = Path(tmp) / "reports" / f"demo-{i}.json"  # a directory the runner must create
                t0 = time.perf_counter()
                rc, text = harness.torchrun(ranks, "launch/infer.py", *steps, "--report", str(report), env=env)
                bad = [line for line in text.splitlines() if BAD_LINES.search(line)]
                r.update(exit=rc, seconds_wall=round(time.perf_counter() - t0, 2), bad_lines=bad[:10])
                if report.exists():
                    rep = json.loads(report.read_text())
                    keep = ("world_size", "device", "fp8_linears", "load_seconds", "sample_seconds", "latent_sha256")
                    r.update({k: rep.get(k) for k in keep}, precision_trace=rep.get("precision_trace"))
                if rc != 0 or bad or not report.exists():
                    r.update(status="failed", tail=text[-3000:])
        _cached_demo(ctx, Path(tmp), ranks, steps, env)


def _cached_demo(ctx: Context, tmp: Path, ranks: int, steps: list[str], env: dict) -> None:
    """The demo again with ``--cache seacache`` (docs/usage.md, "Step caching"): its computed and
    reused steps, its denoising seconds against the uncached run 0's, and whether its latent
    differs (it should, when a step was reused). A real checkpoint's passes and PSNR: bench/cache.py."""
    with ctx.variant(f"cached at {ranks} ranks") as r:
        report = tmp / "reports" / "demo-cached.json"
        rc, text = harness.torchrun(ranks, "launch/infer.py", *steps, "--cache", "seacache", "--report",
                                    str(report), env=env)  # fmt: skip
        if rc != 0 or not report.exists():
            r.update(status="failed", exit=rc, tail=text[-3000:])
            return
        cached, plain = json.loads(report.read_text()), tmp / "reports" / "demo-0.json"
        r.update(step_cache=cached["outputs"][0].get("step_cache"), sample_seconds=cached.get("sample_seconds"))
        if plain.exists():
            plain = json.loads(plain.read_text())
            r.update(
                wall_ratio=round(cached["sample_seconds"] / plain["sample_seconds"], 3),
                latent_differs=cached["latent_sha256"] != plain["latent_sha256"],
            )


# One attention call of a 720p, 189-frame Cosmos 3 pass (44,160 generation tokens), Super-sized heads:
# (rows, query heads, key/value heads, head dim); under fake CUDA (and --dry) a small one.
ATTENTION_SHAPE = (44_160, 40, 8, 128)
SMALL_ATTENTION_SHAPE = (64, 4, 2, 64)


def section_attention(ctx: Context) -> None:
    """One attention call per attention backend this device can run (diffusers' registry names,
    ``fsdp_fp8.interop.attention_backend``), timed as the processors call it; the others skipped
    with the reason ``--attention-backend`` would give."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from fsdp_fp8.interop.attention_backend import backend_names, unusable_reason

    rows, heads, kv_heads, dim = SMALL_ATTENTION_SHAPE if ctx.fake or ctx.dry else ATTENTION_SHAPE
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        ctx.place(torch.randn(1, rows, h, dim, generator=gen).to(torch.bfloat16)) for h in (heads, kv_heads, kv_heads)
    )
    reps = 0 if ctx.fake else (2 if ctx.dry else (3 if ctx.quick else 10))
    for name in backend_names():
        reason = unusable_reason(name, ctx.device)
        if reason is not None:
            ctx.skip(name, reason)
            continue
        with ctx.variant(name) as r, torch.no_grad():
            call = lambda name=name: dispatch_attention_fn(q, k, v, is_causal=False, enable_gqa=True, backend=name)  # noqa: E731
            out = call()
            r.update(out_shape=list(out.shape), out_device=str(out.device), out_dtype=str(out.dtype))
            if ctx.fake:
                continue
            t = statistics.median(_timed(ctx, call, reps))
            r.update(median_ms=round(t * 1e3, 3), tflops=round(4 * rows * rows * heads * dim / t / 1e12, 2))


def section_decode(ctx: Context) -> None:
    import torch

    if ctx.fake:
        from fsdp_fp8.interop.vae_decode import pack, packed_bytes, unpack

        with ctx.variant("gather packing") as r:  # what a rank sends and the writer views back
            shapes = [(1, 12, 65, 128, 128), (1, 12, 65, 128, 32)]
            tiles = [torch.empty(s, dtype=torch.bfloat16, device=ctx.device) for s in shapes]
            sent = pack(tiles, ctx.device)
            got = unpack(
                torch.empty(packed_bytes(shapes, torch.bfloat16), dtype=torch.uint8, device=ctx.device),
                shapes,
                torch.bfloat16,
            )
            r.update(bytes=sent.numel(), shapes_back=[list(t.shape) for t in got] == [list(s) for s in shapes])
        ctx.skip("torchrun", "the decode's time and peak need real ranks (--dry: gloo on CPU)")
        return
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 2
    frames = "9" if ctx.quick else "17"
    with (
        tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp,
        ctx.variant(f"720p x {frames}, world {world}") as r,
    ):
        report = Path(tmp) / "decode.json"
        args = ["--report", str(report), "--frames", frames] + (["--dry"] if ctx.dry else [])
        env = dict(os.environ, OMP_NUM_THREADS="1") if ctx.dry else None
        rc, text = harness.torchrun(world, "-m", "bench.vae_decode_ranks", *args, env=env)
        r.update(exit=rc, bad_lines=[x for x in text.splitlines() if BAD_LINES.search(x)][:10])
        if rc != 0 or not report.exists():
            r.update(status="failed", tail=text[-3000:])
            return
        got = json.loads(report.read_text())
        r.update({k: got[k] for k in ("height", "width", "frames", "dtype", "backend", "world")}, ranks=got["ranks"])
        first = got["ranks"][0]
        r["split_over_tiled"] = round(first["split_seconds"] / first["tiled_seconds"], 3)
        # reported, not judged here: tests/distributed/test_vae_decode.py asserts it
        r["frames_equal"] = first.get("equal")


SECTIONS = {
    "preflight": section_preflight,
    "versions": section_versions,
    "tests": section_tests,
    "gemm": section_gemm,
    "load": section_load,
    "step": section_step,
    "allgather": section_allgather,
    "alltoall": section_alltoall,
    "demo": section_demo,
    "attention": section_attention,
    "decode": section_decode,
}


def run_section(name: str, ctx: Context) -> None:
    """Run one section in this process (under fake CUDA when ``ctx.fake``)."""
    if ctx.fake:
        from bench.smoke_fake_cuda import fake_cuda

        with fake_cuda():
            SECTIONS[name](ctx)
    else:
        SECTIONS[name](ctx)


def _child(args: argparse.Namespace) -> int:
    results = Results(Path(args.out))
    if args.section == "preflight":  # before torch: a box without a working torch is told so
        section_preflight(Context("preflight", None, args.dry, args.fake_cuda, args.quick, results.write, args))
        return 0
    import torch

    if args.fake_cuda:
        device = torch.device("cuda", 0)
    elif args.dry:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            results.write({"section": args.section, "variant": "device", "status": "failed", "error": "no CUDA"})
            return 1
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    ctx = Context(args.section, device, args.dry, args.fake_cuda, args.quick, results.write, args)
    run_section(args.section, ctx)
    return 0


# --- driver ---------------------------------------------------------------------------------


def budgets(args: argparse.Namespace) -> dict[str, float]:
    chosen = {name: float(b[0] if args.quick else b[1]) for name, b in BUDGETS.items()}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in chosen or not seconds:
            raise SystemExit(f"--budget {item}: expected SECTION=SECONDS with SECTION one of {', '.join(chosen)}")
        chosen[name] = float(seconds)
    return chosen


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, wait until every member is gone (a torchrun agent
    leaves once it has stopped its ranks), SIGKILL what is left after ``KILL_GRACE_S``."""
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or it stays in the group as a zombie
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_child(name: str, args: argparse.Namespace, budget: float) -> tuple[str, int | None, str]:
    """The section in its own process group, killed (with its torchrun ranks) at its budget."""
    cmd = [sys.executable, "-m", "bench.gpu_smoke", "--section", name, "--out", args.out, "--wheels", args.wheels]
    cmd += [flag for flag, on in (("--dry", args.dry), ("--fake-cuda", args.fake_cuda), ("--quick", args.quick)) if on]
    if args.demo_ranks:
        cmd += ["--demo-ranks", str(args.demo_ranks)]
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(
            cmd, env=harness.repo_env(), cwd=ROOT, stdout=err, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=budget)
            status = "ok" if rc == 0 else "crashed"
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun starts its ranks in sessions of their own, out of this
            # group's reach, and stops them itself on SIGTERM; a SIGKILL would leave them
            # holding the GPUs for the next section.
            _stop_group(proc)
            rc, status = None, "timeout"
        err.seek(0)
        return status, rc, err.read()[-3000:]


def _blocked(name: str, pre: dict, cuda: bool) -> str | None:
    """Why preflight says ``name`` cannot run (None: it can)."""
    modules = pre.get("variants", {}).get("modules", {})
    missing = modules.get("blocks", {}).get(name)
    if missing:
        return f"preflight: missing modules {', '.join(missing)}"
    device = pre.get("variants", {}).get("device", {})
    if cuda and name != "versions" and device.get("status") == "failed":
        return f"preflight: {'; '.join(device.get('problems') or [device.get('error', 'no device')])}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = str(Path(args.out).absolute())  # the children run in the checkout's root
    chosen = budgets(args)
    if args.outer_timeout:
        print(int(sum(chosen.values()) + TIMEOUT_MARGIN_S))
        return 0
    if args.wheels_to_install:
        for wheel in wheels_to_install(Path(args.wheels)):
            print(wheel)
        return 0
    if args.section:
        return _child(args)
    started = time.perf_counter()
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    results = Results(Path(args.out))
    mode = "fake-cuda" if args.fake_cuda else "dry" if args.dry else "cuda"
    results.write({"section": "run", "variant": None, "status": "ok", "mode": mode, "quick": args.quick,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "budgets_s": chosen})  # fmt: skip
    statuses = {}
    for name in ["preflight", *[s for s in SECTIONS if s != "preflight"]]:  # preflight always
        t0 = time.perf_counter()
        why = None if name == "preflight" or name in only else "not selected (--only)"
        if why is None and name != "preflight":
            preflight = load_results(Path(args.out))["sections"].get("preflight", {})
            why = _blocked(name, preflight, cuda=not (args.dry or args.fake_cuda))
        if why:
            status, rc, tail = "skipped", None, ""
        else:
            status, rc, tail = _run_child(name, args, chosen[name])
        section = load_results(Path(args.out))["sections"].get(name, {"variants": {}})
        if status == "ok" and any(v["status"] == "failed" for v in section["variants"].values()):
            status = "failed"
        if status == "ok" and not section["variants"]:
            status, tail = "failed", f"the section wrote no records to {args.out}\n{tail}"
        statuses[name] = status
        seconds = round(time.perf_counter() - t0, 2)
        end = {"section": name, "variant": None, "status": status, "seconds": seconds, "budget_s": chosen[name]}
        end.update({"reason": why} if why else {"exit": rc, "stderr_tail": tail})
        results.write(end)
        print(f"[gpu_smoke] {name:<10} {status:<8} {seconds:7.1f} s (budget {chosen[name]:.0f} s)", flush=True)
    ok = all(s in ("ok", "skipped") for s in statuses.values())
    total = round(time.perf_counter() - started, 1)
    results.write({"section": "summary", "variant": None, "ok": ok, "seconds": total, "statuses": statuses})
    print(f"[gpu_smoke] {'ok' if ok else 'FAILED'} in {total} s -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
