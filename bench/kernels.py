"""W8A8 / W8A16 kernel variants: error against an F32 reference, and time per call.

    python -m bench.kernels [--device cpu|cuda] [--m 4352] [--k 5120] [--n 5120] [--reps 20]

The weight and activation are random, quantized to E4M3 with per-tensor scales. The
reference is F32 arithmetic on the same dequantized operands, ``(x_q * s_x) @ (w * s_w).T``,
so what is measured is the GEMM's accumulation and output rounding alone, not the FP8
quantization. Variants: W8A8 (``use_fast_accum`` off / on), W8A8 with the fused (compiled)
activation quantization, W8A16 eager and fused. ``fused`` variants must give the default's
bits; that is checked and printed. Defaults: one layer of the 64B-class shape (hidden 5120,
4096 latent + 256 prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from bench import common
from fsdp_fp8.fp8 import kernels
from fsdp_fp8.fp8.tensor import E4M3, E4M3_MAX, make_static_fp8_weight


def _errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (y.float() - ref).abs()
    return {
        "max_abs": d.max().item(),
        "mean_abs": d.mean().item(),
        "max_rel_to_ref_max": (d.max() / ref.abs().max()).item(),
    }


def _time(fn, reps: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def run(m: int, k: int, n: int, reps: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    w_hp = torch.randn(n, k, generator=g) / k**0.5
    s_w = w_hp.abs().max() / E4M3_MAX
    w = make_static_fp8_weight(
        (w_hp / s_w).to(E4M3).to(device), s_w.to(device), torch.tensor(1.0, device=device), torch.bfloat16
    )
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    s_x = (x.float().abs().max() / E4M3_MAX).reshape(1, 1)
    x_q = kernels.quantize_activation(x, s_x)
    ref = (x_q.float() * s_x) @ (w.qdata.float() * w.scale.reshape(())).T
    out: dict = {"m": m, "k": k, "n": n, "device": device, "torch": torch.__version__}
    default = kernels.fp8_gemm(x_q, s_x, w, None, torch.bfloat16)
    fast = kernels.fp8_gemm(x_q, s_x, w, None, torch.bfloat16, fast_accum=True)
    out["w8a8"] = _errors(default, ref)
    out["w8a8_fast_accum"] = _errors(fast, ref)
    out["fast_accum_same_bits_as_default"] = torch.equal(fast, default)
    out["fused_quantize_same_bits"] = torch.equal(
        kernels.quantize_activation(x, s_x, fused=True).view(torch.uint8), x_q.view(torch.uint8)
    )
    out["fused_dequantize_same_bits"] = torch.equal(
        kernels.dequantize(w, torch.bfloat16, fused=True), kernels.dequantize(w, torch.bfloat16)
    )
    a16 = F.linear(x, kernels.dequantize(w, torch.bfloat16))
    out["w8a16_vs_f32_of_bf16_x"] = _errors(a16, x.float() @ (w.qdata.float() * w.scale.reshape(())).T)
    seconds = {
        "bf16": lambda: F.linear(x, w_hp.to(device, torch.bfloat16)),
        "w8a8": lambda: kernels.fp8_gemm(kernels.quantize_activation(x, s_x), s_x, w, None, torch.bfloat16),
        "w8a8_fast_accum": lambda: kernels.fp8_gemm(
            kernels.quantize_activation(x, s_x), s_x, w, None, torch.bfloat16, fast_accum=True
        ),
        "w8a8_fused_quantize": lambda: kernels.fp8_gemm(
            kernels.quantize_activation(x, s_x, fused=True), s_x, w, None, torch.bfloat16
        ),
        "w8a16": lambda: F.linear(x, kernels.dequantize(w, torch.bfloat16)),
        "w8a16_fused": lambda: F.linear(x, kernels.dequantize(w, torch.bfloat16, fused=True)),
    }
    out["seconds_per_call"] = {name: _time(fn, reps, device) for name, fn in seconds.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--m", type=int, default=4352)
    p.add_argument("--k", type=int, default=5120)
    p.add_argument("--n", type=int, default=5120)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--results", default=str(common.RESULTS))
    args = p.parse_args(argv)
    out = run(args.m, args.k, args.n, args.reps, args.device)
    print(json.dumps(out, indent=1))
    with open(args.results, "a") as fh:
        fh.write(json.dumps({"bench": "kernels", **out}, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
