"""GPU smoke check for a bare CUDA box: one JSON of versions, correctness and speed figures.

    PYTHONPATH=. python bench/gpu_smoke.py --out smoke.json [--wheels DIR]   # on the GPU box
    PYTHONPATH=. python bench/gpu_smoke.py --dry --out smoke.json           # CPU (CI runs this)

It uses the box's own python and torch (>= 2.10), imports the package from this checkout
(no install) and needs no network. What a stock CUDA image lacks is carried as wheels in
``--wheels`` (default ``bench/wheels``) and unpacked into a temporary directory on
``sys.path`` (and on the children's PYTHONPATH) - never installed:

    torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
    safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
    numpy-<any>-<the box's python tag>.whl                      (only where the box lacks numpy)

Sections (each ``ok``, ``failed`` or ``skipped`` with the reason; never silently left out):
  versions    python, torch, CUDA, torchao, device name and capability, the all-gather in use
  gemm        every FP8 GEMM against an fp32 reference: M in {0, 1, 7, 16, 77, 4096} rows,
              2-D / 3-D / 4-D inputs, with and without bias, W8A8 (and its options) and W8A16
  scaled_mm   the profiler sees ``aten::_scaled_mm`` (and, on CUDA, its GEMM kernels) under
              W8A8, and none under W8A16
  hooks       the uint8 pre/post all-gather hooks driven directly for meshes of 3 and 8 ranks,
              each with a rank that holds zero rows, against the full codes, ``out=`` reused
  load        GB/s of ``load_model`` onto the device (cold page cache) against the floors of the same
              files: raw read, host-to-device alone (pinned, pageable), read + copy
  step        one layer of the 64B model (hidden 5120, 4096 latent + 256 prompt tokens),
              CFG step (2 forwards): BF16, W8A8, W8A8 fast accumulation, W8A8 fused
              quantization, W8A16
  demo        the demo under torchrun twice: exit 0, one digest, no watchdog/terminate lines

``--dry`` runs on the CPU with shapes scaled down (the ``step`` layer, the ``load`` file); the
CUDA-only measurements are skipped with a reason. The exit code is 1 if any section failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEMM_ROWS = (0, 1, 7, 16, 77, 4096)
GEMM_IN, GEMM_OUT = 256, 384  # multiples of 16, as _scaled_mm on CUDA needs
# The CPU _scaled_mm is an emulation (~4 M multiply-adds/s here): dry runs use the smallest
# shape CUDA would also take, with every row count and input rank kept.
DRY_GEMM_IN, DRY_GEMM_OUT = 16, 32
# Relative Frobenius error against the fp32 reference that rounds activations and weights
# exactly as the FP8 path does: what is left is the BF16 output rounding (2^-8 relative per
# element) and the accumulation order, far below this bound; a wrong scale or layout is O(1).
GEMM_REL_TOL = 1e-2
FAST_ACCUM_REL_TOL = 2e-2
# Lines that mean a rank was killed or a collective timed out, even when the exit code is 0.
BAD_LINES = re.compile(
    r"watchdog|terminate called|Terminating process|SIGTERM|SIGABRT|"
    r"destroy_process_group\(\) was not called",
    re.IGNORECASE,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON results (its directory is created)")
    p.add_argument("--dry", action="store_true", help="CPU only, scaled-down shapes; CUDA parts skipped")
    p.add_argument(
        "--wheels",
        default=str(ROOT / "bench" / "wheels"),
        help="directory of carried wheels, unpacked only for modules the box lacks",
    )
    p.add_argument("--only", help="comma-separated sections to run (default: all)")
    p.add_argument("--demo-ranks", type=int, help="ranks for the demo (default: 2 dry, else 1)")
    p.add_argument("--step-reps", type=int, default=10, help="timed CFG steps per variant")
    return p.parse_args(argv)


# --- carried wheels ----------------------------------------------------------------------

WHEEL_MODULES = {"torchao": "torchao", "safetensors": "safetensors", "numpy": "numpy"}


def unpack_missing_wheels(wheels: Path, into: Path) -> list[str]:
    """Unpack each carried wheel whose module the box cannot import; returns their names."""
    used = []
    for name, module in WHEEL_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            continue
        found = sorted(wheels.glob(f"{name}-*.whl")) if wheels.is_dir() else []
        if not found:
            continue  # the import in the section that needs it says what is missing
        with zipfile.ZipFile(found[-1]) as z:
            z.extractall(into)
        used.append(found[-1].name)
    if used:
        sys.path.insert(0, str(into))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(into), os.environ.get("PYTHONPATH", "")])
        importlib.invalidate_caches()
    return used


# --- helpers -----------------------------------------------------------------------------


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fp8_linear(weight, bias, input_scale, dtype):
    """A Float8StaticLinear holding ``weight`` quantized per tensor, as ModelOpt would."""
    import torch
    from torch import nn

    from fsdp_fp8.fp8.linear import Float8StaticLinear
    from fsdp_fp8.fp8.tensor import E4M3_MAX, make_static_fp8_weight

    out_f, in_f = weight.shape
    scale = weight.float().abs().max().clamp(min=1e-12) / E4M3_MAX
    codes = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    lin = Float8StaticLinear(in_f, out_f, bias is not None, dtype, device=weight.device)
    lin.weight = nn.Parameter(make_static_fp8_weight(codes, scale.reshape(()), input_scale, dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin


def linear_options() -> dict[str, str | None]:
    """The W8A8 options this checkout's FP8 layer offers: name -> None, or why it is absent."""
    from fsdp_fp8.fp8 import linear

    have = {name: None for name in ("fast_accum", "fused") if hasattr(linear.Float8StaticLinear, name)}
    return {
        name: have.get(name, "not in this checkout's Float8StaticLinear (fp8 layer option)")
        for name in ("fast_accum", "fused")
    }


def _reference(x, lin, mode: str):
    """fp32 reference with the FP8 path's own rounding of activations (W8A8) and weights."""

    from fsdp_fp8.fp8.kernels import quantize_activation

    w = lin.weight.qdata.float() * lin.weight.scale.float().reshape(())
    x2d = x.reshape(-1, x.shape[-1])
    if mode == "native":
        s = lin.weight.act_quant_scale.float().reshape(())
        x2d = quantize_activation(x2d, lin.weight.act_quant_scale).float() * s
    y = x2d.float() @ w.t()
    if lin.bias is not None:
        y = y + lin.bias.float()
    return y.reshape(*x.shape[:-1], w.shape[0])


# --- sections ----------------------------------------------------------------------------


def section_versions(device) -> dict:
    import torch

    from fsdp_fp8.load.collectives import all_gather_name

    out = {
        "status": "ok",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "all_gather": all_gather_name(),
    }
    for mod in ("torchao", "safetensors", "numpy"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except ImportError as exc:
            out[mod] = f"missing: {exc}"
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["capability"] = list(torch.cuda.get_device_capability(device))
        out["device_count"] = torch.cuda.device_count()
        out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out["nccl"] = f"unknown: {exc}"
    return out


def section_gemm(device, dry: bool) -> dict:
    import torch

    k, n = (DRY_GEMM_IN, DRY_GEMM_OUT) if dry else (GEMM_IN, GEMM_OUT)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    cases, failures = [], []
    modes = [("native", {}), ("a16", {})]
    opts = linear_options()
    if opts["fast_accum"] is None:
        modes.append(("native", {"fast_accum": True}))
    for bias in (False, True):
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device)
        b = (0.1 * torch.randn(n, generator=gen)).to(device) if bias else None
        lin = _fp8_linear(w, b, torch.tensor(4.0 / 448), dtype).to(device)
        for rows in GEMM_ROWS:
            for shape in ((rows, k), (1, rows, k), (2, 1, rows, k)):
                x = torch.randn(*shape, generator=gen).to(device, dtype)
                for mode, extra in modes:
                    lin.mode = mode
                    for option, v in extra.items():
                        setattr(lin, option, v)
                    with torch.no_grad():
                        y = lin(x)
                    for option in extra:
                        setattr(lin, option, False)
                    ref = _reference(x, lin, mode)
                    name = f"{mode}{'+' + '+'.join(extra) if extra else ''} bias={bias} x{tuple(shape)}"
                    if tuple(y.shape) != tuple(ref.shape):
                        failures.append(f"{name}: shape {tuple(y.shape)} != {tuple(ref.shape)}")
                        continue
                    err = 0.0
                    if ref.numel():
                        err = float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))
                    tol = FAST_ACCUM_REL_TOL if extra else GEMM_REL_TOL
                    cases.append({"case": name, "rel_err": err})
                    if not err <= tol:
                        failures.append(f"{name}: relative error {err:.3e} > {tol}")
    lin.mode = "native"
    out = {
        "status": "failed" if failures else "ok",
        "cases": len(cases),
        "in_features": k,
        "out_features": n,
        "max_rel_err": max(c["rel_err"] for c in cases),
        "failures": failures,
        "worst": sorted(cases, key=lambda c: -c["rel_err"])[:5],
    }
    if opts["fast_accum"] is not None:
        out["fast_accum"] = skipped(opts["fast_accum"])
    return out


def section_scaled_mm(device, dry: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    k, n = (DRY_GEMM_IN, DRY_GEMM_OUT) if dry else (GEMM_IN, GEMM_OUT)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device)
    lin = _fp8_linear(w, None, torch.tensor(4.0 / 448), torch.bfloat16).to(device)
    x = torch.randn(77, k, generator=gen).to(device, torch.bfloat16)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    seen = {}
    for mode in ("native", "a16"):
        lin.mode = mode
        with torch.no_grad():
            lin(x)  # warm-up outside the profile
            _sync(device)
            with profile(activities=activities) as prof:
                lin(x)
                _sync(device)
        events = prof.events()
        ops = sorted({e.name for e in events if e.device_type.name == "CPU"})
        kernels = sorted({e.name for e in events if e.device_type.name == "CUDA"})
        seen[mode] = {"scaled_mm_op": "aten::_scaled_mm" in ops, "kernels": kernels}
    lin.mode = "native"
    problems = []
    if not seen["native"]["scaled_mm_op"]:
        problems.append("W8A8 forward did not call aten::_scaled_mm")
    if seen["a16"]["scaled_mm_op"]:
        problems.append("W8A16 forward called aten::_scaled_mm")
    out = {
        "status": "failed" if problems else "ok",
        "problems": problems,
        "w8a8_kernels": seen["native"]["kernels"],
        "w8a16_kernels": seen["a16"]["kernels"],
    }
    if device.type == "cuda":
        gemms = [k for k in seen["native"]["kernels"] if re.search(r"gemm|nvjet|xmma|cutlass|sm\d\d", k, re.I)]
        out["w8a8_gemm_kernels"] = gemms
        if not gemms:
            out["status"] = "failed"
            problems.append("no GEMM kernel ran under W8A8 (profiler kernel names above)")
    else:
        out["cuda_kernels"] = skipped("no CUDA device: only the CPU op is checked")
    return out


class _Mesh:
    """What the hooks read from FSDP2's mesh: the size of its last (shard) dimension."""

    ndim = 1

    def __init__(self, n: int):
        self.n = n

    def size(self, dim: int = 0) -> int:
        assert dim == 0, dim
        return self.n


def section_hooks(device) -> dict:
    import torch

    from fsdp_fp8.format.sharding import padded_rows
    from fsdp_fp8.fp8.tensor import E4M3, make_static_fp8_weight, rebuild

    gen = torch.Generator().manual_seed(2)
    checks, failures = [], []
    # rows: 4 over 3 ranks -> 2, 2, 0; 7 over 8 ranks -> 1 x 7, 0
    for world, rows in ((3, 4), (8, 7), (3, 5), (8, 17)):
        full_codes = (torch.randn(rows, 48, generator=gen) * 50).clamp(-448, 448).to(E4M3).to(device)
        full = make_static_fp8_weight(
            full_codes, torch.tensor(0.01, device=device), torch.tensor(0.02, device=device), torch.bfloat16
        )
        pad = padded_rows(rows, world)
        chunks = list(torch.chunk(full_codes, world)) if rows else []
        chunks += [full_codes[:0]] * (world - len(chunks))  # torch.chunk yields fewer pieces
        payloads = []
        for codes in chunks:
            local = rebuild(full, codes.contiguous())
            (payload,), meta = local.fsdp_pre_all_gather(_Mesh(world), full.shape, full.stride(), None, None)
            if payload.dtype != torch.uint8 or tuple(payload.shape) != (pad, 48):
                failures.append(f"world {world}, {rows} rows: payload {payload.dtype} {tuple(payload.shape)}")
            payloads.append(payload)
        gathered = torch.cat(payloads)  # what all_gather_single writes, rank after rank
        unsharded, _ = local.fsdp_post_all_gather((gathered,), meta, torch.bfloat16)
        same = torch.equal(unsharded.qdata.view(torch.uint8), full_codes.view(torch.uint8))
        # out=: FSDP2's buffer reuse after the first all-gather
        gathered2 = torch.cat(payloads)
        local.fsdp_post_all_gather((gathered2,), meta, torch.bfloat16, out=unsharded)
        reused = torch.equal(unsharded.qdata.view(torch.uint8), full_codes.view(torch.uint8))
        zero_rank = any(c.shape[0] == 0 for c in chunks)
        checks.append(
            {
                "world": world,
                "rows": rows,
                "padded_rows": pad,
                "zero_row_rank": zero_rank,
                "bytes_equal": same,
                "out_reused_equal": reused,
            }
        )
        if not (same and reused):
            failures.append(f"world {world}, {rows} rows: gathered codes differ from the full codes")
    if not any(c["zero_row_rank"] for c in checks if c["world"] == 3) or not any(
        c["zero_row_rank"] for c in checks if c["world"] == 8
    ):
        failures.append("no zero-row rank was exercised")  # internal: the cases above are wrong
    return {"status": "failed" if failures else "ok", "checks": checks, "failures": failures}


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


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


def _load_model_fn(rows: int, cols: int):
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16) for _ in range(config["layers"])
            )

    return Stack


def section_load(device, size: int) -> dict:
    """GB/s of fsdp_fp8's ``load_model`` (one process, onto ``device``) against the floors of the same
    files: a raw single-thread read, pinned and pageable host-to-device copies, read + copy."""
    import torch

    from fsdp_fp8 import load_model

    chunk = 64 << 20
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        directory = Path(tmp) / "ckpt"
        linears = write_load_checkpoint(directory, size)
        files = sorted(directory.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:

            def evict() -> None:
                for fd in fds:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def read_all(buf: torch.Tensor, sink=None) -> float:
                view = memoryview(buf.numpy())
                evict()
                t0 = time.perf_counter()
                for fd in fds:
                    off = 0
                    while n := os.preadv(fd, [view], off):
                        off += n
                        if sink is not None:
                            sink(buf)
                _sync(device)
                return time.perf_counter() - t0

            def load() -> dict:
                evict()
                t0 = time.perf_counter()
                loaded = load_model(_load_model_fn(LOAD_ROWS, LOAD_COLS), directory, device=device)
                _sync(device)
                seconds = time.perf_counter() - t0
                report = loaded.report
                loaded.checkpoint.close()
                del loaded
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                return {"seconds": seconds, "read_seconds": report.read_seconds, "bytes_read": report.bytes_read}

            pageable = torch.empty(chunk, dtype=torch.uint8)
            out = {
                "status": "ok",
                "file_bytes": size,
                "files": len(files),
                "fp8_linears": linears,
                "chunk_bytes": chunk,
                "note": "page cache evicted (POSIX_FADV_DONTNEED) before each read and each load",
            }
            out["raw_read_gbps"] = _gbps(size, min(read_all(pageable) for _ in range(3)))
            loads = [load() for _ in range(3)]
            best = min(loads, key=lambda r: r["read_seconds"])
            out["load_model_read_gbps"] = _gbps(best["bytes_read"], best["read_seconds"])
            out["load_model_whole_gbps"] = _gbps(best["bytes_read"], min(r["seconds"] for r in loads))
            out["load_model_bytes_read"] = best["bytes_read"]
            floors = {"raw read": out["raw_read_gbps"]}
            if device.type != "cuda":
                out["h2d"] = skipped("no CUDA device: host-to-device copies not measured")
            else:
                dest = torch.empty(chunk, dtype=torch.uint8, device=device)
                pinned = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)

                def h2d(src: torch.Tensor, reps: int = 20) -> float:
                    dest.copy_(src, non_blocking=src.is_pinned())
                    _sync(device)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        dest.copy_(src, non_blocking=src.is_pinned())
                    _sync(device)
                    return _gbps(reps * chunk, time.perf_counter() - t0)

                out["h2d_pinned_gbps"] = h2d(pinned)
                out["h2d_pageable_gbps"] = h2d(pageable)
                floors["pinned host-to-device"] = out["h2d_pinned_gbps"]

                def copy_out(buf):
                    dest.copy_(buf, non_blocking=buf.is_pinned())
                    if buf.is_pinned():
                        _sync(device)  # the staging buffer is reused by the next read

                out["read_h2d_pageable_gbps"] = _gbps(size, min(read_all(pageable, copy_out) for _ in range(3)))
                out["read_h2d_pinned_gbps"] = _gbps(size, min(read_all(pinned, copy_out) for _ in range(3)))
            limit = min(floors, key=floors.get)
            out["floor"] = {"name": limit, "gbps": floors[limit]}
            # The target: load GB/s per rank >= 80% of min(storage read, pinned H2D).
            out["load_vs_floor"] = round(out["load_model_read_gbps"] / floors[limit], 3)
            return out
        finally:
            for fd in fds:
                os.close(fd)


def _layer_config(dry: bool):
    from fsdp_fp8.models import PRESETS, MoTConfig

    if dry:
        return PRESETS["tiny"], 16, 8
    s = PRESETS["super"]
    return (
        MoTConfig(
            hidden_size=s.hidden_size,
            num_layers=1,
            num_heads=s.num_heads,
            head_dim=s.head_dim,
            intermediate_size=s.intermediate_size,
            vocab_size=16,
            latent_channels=16,
        ),
        4096,
        256,
    )


def _to_fp8(layer, dtype):
    """The layer with every linear of its towers swapped for a per-tensor FP8 one."""
    import torch
    from torch import nn

    for name, module in list(layer.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(
                    module,
                    child_name,
                    _fp8_linear(child.weight.detach(), child.bias, torch.tensor(4.0 / 448), dtype).to(
                        child.weight.device
                    ),
                )
    return layer


def section_step(device, dry: bool, reps: int) -> dict:
    import copy

    import torch

    from fsdp_fp8.fp8.linear import Float8StaticLinear
    from fsdp_fp8.models.mot import MoTLayer

    cfg, latent, prompt = _layer_config(dry)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    bf16 = MoTLayer(cfg).to(device, dtype).eval()
    for p in bf16.parameters():
        p.requires_grad_(False)
        p.normal_(0, cfg.hidden_size**-0.5)
    fp8 = _to_fp8(copy.deepcopy(bf16), dtype)
    from fsdp_fp8.models.ops import RotaryEmbedding

    rope_mod = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)
    h_prompt = torch.randn(1, prompt, cfg.hidden_size, device=device, dtype=dtype)
    h = torch.randn(1, latent, cfg.hidden_size, device=device, dtype=dtype)
    rope_p = rope_mod(torch.arange(prompt, device=device))
    rope_l = rope_mod(torch.arange(prompt, prompt + latent, device=device))
    with torch.no_grad():
        _, kv = bf16(h_prompt, rope_p, phase="reason")

    def cfg_step(layer) -> None:
        layer(h, rope_l, kv, phase="generate")
        layer(h, rope_l, None, phase="generate")

    opts = linear_options()
    variants = {
        "BF16": (bf16, "native", {}),
        "W8A8": (fp8, "native", {}),
        "W8A8 fast accum": (fp8, "native", {"fast_accum": True}),
        "W8A8 fused quant": (fp8, "native", {"fused": True}),
        "W8A16": (fp8, "a16", {}),
    }
    times, out = (
        {},
        {
            "status": "ok",
            "shape": {
                "hidden": cfg.hidden_size,
                "heads": cfg.num_heads,
                "head_dim": cfg.head_dim,
                "intermediate": cfg.intermediate_size,
                "latent_tokens": latent,
                "prompt_tokens": prompt,
            },
            "dry_shape": dry,
        },
    )
    for name, (layer, mode, extra) in variants.items():
        missing = [opts[k] for k in extra if opts[k] is not None]
        if missing:
            out[name] = skipped(missing[0])
            continue
        for m in layer.modules():
            if isinstance(m, Float8StaticLinear):
                m.mode = mode
                for k, v in extra.items():
                    setattr(m, k, v)
        with torch.no_grad():
            cfg_step(layer)  # warm-up (and any compilation) outside the timing
            samples = []
            for _ in range(reps):
                _sync(device)
                t0 = time.perf_counter()
                cfg_step(layer)
                _sync(device)
                samples.append(time.perf_counter() - t0)
        for m in layer.modules():
            if isinstance(m, Float8StaticLinear):
                m.mode = "native"
                for k in extra:
                    setattr(m, k, False)
        times[name] = statistics.median(samples)
        out[name] = {
            "status": "ok",
            "median_ms": round(times[name] * 1e3, 3),
            "all_ms": [round(s * 1e3, 3) for s in samples],
        }
    for name, t in times.items():
        out[name]["vs_bf16"] = round(t / times["BF16"], 3)
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def section_demo(dry: bool, ranks: int, workdir: Path) -> dict:
    # The demo checkpoint is built once into the usual cache ($FSDP_FP8_CACHE, else
    # ~/.cache/fsdp_fp8) and reused by the second run and by later smoke checks.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    steps = ["--steps", "8"]
    if dry:  # the CPU's emulated FP8 GEMM is slow: fewer steps and tokens, same checks
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        steps = ["--steps", "2", "--latent-tokens", "16"]
    runs, problems = [], []
    for i in range(2):
        report = workdir / "reports" / f"demo-{i}.json"  # a directory the runner must create
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            str(ROOT / "launch" / "infer.py"),
            *steps,
            "--report",
            str(report),
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, text = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
        bad = [line for line in text.splitlines() if BAD_LINES.search(line)]
        digest = json.loads(report.read_text())["latent_sha256"] if report.exists() else None
        runs.append(
            {"exit": rc, "seconds": round(time.perf_counter() - t0, 2), "latent_sha256": digest, "bad_lines": bad[:10]}
        )
        if rc != 0:
            problems.append(f"run {i}: exit {rc}: {text[-2000:]}")
        if bad:
            problems.append(f"run {i}: {len(bad)} watchdog/terminate lines")
        if digest is None:
            problems.append(f"run {i}: no report at {report}")
    if runs[0]["latent_sha256"] != runs[1]["latent_sha256"]:
        problems.append("the two runs sampled different latents")
    return {"status": "failed" if problems else "ok", "ranks": ranks, "runs": runs, "problems": problems}


# --- driver ------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"mode": "dry" if args.dry else "cuda", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        results["carried_wheels"] = unpack_missing_wheels(Path(args.wheels), Path(tmp) / "wheels")
        import torch

        sys.path.insert(0, str(ROOT))
        cuda = torch.cuda.is_available() and not args.dry
        if not args.dry and not torch.cuda.is_available():
            results["sections"] = {"versions": {"status": "failed", "reason": "no CUDA device (use --dry on CPU)"}}
            out_path.write_text(json.dumps(results, indent=2))
            return 1
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        sections = {
            "versions": lambda: section_versions(device),
            "gemm": lambda: section_gemm(device, args.dry),
            "scaled_mm": lambda: section_scaled_mm(device, args.dry),
            "hooks": lambda: section_hooks(device),
            "load": lambda: section_load(device, (64 << 20) if args.dry else (4 << 30)),
            "step": lambda: section_step(device, args.dry, 2 if args.dry else args.step_reps),
            "demo": lambda: section_demo(args.dry, args.demo_ranks or (2 if args.dry else 1), Path(tmp)),
        }
        only = set(args.only.split(",")) if args.only else set(sections)
        unknown = only - set(sections)
        if unknown:
            raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}; known: {', '.join(sections)}")
        results["sections"] = {}
        for name, fn in sections.items():
            if name not in only:
                results["sections"][name] = skipped("not selected (--only)")
                continue
            t0 = time.perf_counter()
            try:
                res = fn()
            except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
                res = {
                    "status": "failed",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:],
                }
            res["seconds"] = round(time.perf_counter() - t0, 2)
            results["sections"][name] = res
            print(f"[gpu_smoke] {name:<10} {res['status']:<8} {res['seconds']:7.1f} s", flush=True)
    results["seconds"] = round(time.perf_counter() - started, 1)
    results["ok"] = all(s["status"] != "failed" for s in results["sections"].values())
    out_path.write_text(json.dumps(results, indent=2))
    print(f"[gpu_smoke] {'ok' if results['ok'] else 'FAILED'} in {results['seconds']} s -> {out_path}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
