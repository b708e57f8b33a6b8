"""What ``launch/infer.py`` does: load a checkpoint sharded across the ranks, sample, report.

    torchrun --nproc-per-node N launch/infer.py [--checkpoint DIR] [--steps S] [--seed K]
             [--prompt TEXT] [--report PATH]

Without ``--checkpoint`` it runs the embedded demo (built and cached on first use).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp_fp8.api import default_device, load_model
from fsdp_fp8.architectures import resolve_architecture
from fsdp_fp8.checkpoint import open_checkpoint
from fsdp_fp8.precision import denoising_step, install_step_policy
from fsdp_fp8.sampler import sample
from fsdp_fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.step_policy import describe_trace, resolve_step_policy

log = logging.getLogger("fsdp_fp8")

DEFAULT_PROMPT = "a red fox jumps over a sleeping dog, golden hour"
DEFAULT_LATENT_TOKENS = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/infer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="ModelOpt static-FP8 checkpoint directory (default: the embedded demo)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (bytes become token ids)")
    p.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale")
    p.add_argument("--latent-tokens", type=int, default=DEFAULT_LATENT_TOKENS)
    p.add_argument("--step-policy", choices=("auto", "off"), default="auto",
                   help="auto: the checkpoint's diffusion step policy; off: every step W8A8")
    p.add_argument("--report", help="also write the report as JSON to this path (rank 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def prompt_ids(text: str, vocab_size: int) -> torch.Tensor:
    """No tokenizer download: UTF-8 bytes folded into the vocabulary."""
    data = text.encode("utf-8") or b" "
    return torch.tensor([[b % vocab_size for b in data]], dtype=torch.long)


def init_distributed(timeout_s: float) -> None:
    """gloo on CPU, NCCL on CUDA; a single process (no torchrun) runs without a group."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _all_reports(report) -> list:
    if not dist.is_initialized():
        return [report]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, report)
    return out


def run(args: argparse.Namespace) -> dict:
    if args.checkpoint:
        path = args.checkpoint
    else:
        from fsdp_fp8.demo import demo_checkpoint

        if _rank() == 0:
            log.info("using the embedded demo checkpoint (built once, then cached)")
        path = demo_checkpoint()
    config = open_checkpoint(path).config
    arch = resolve_architecture(config, f"{path}/config.json")
    device = default_device()
    t0 = time.perf_counter()
    loaded = load_model(arch.model_fn, path, device=device)
    model = loaded.model
    policy = resolve_step_policy(loaded.checkpoint.quant.step_policy, args.step_policy)
    routing = install_step_policy(model, policy, arch.towers(model) if arch.towers else None)
    share_quantized_inputs(model)
    load_s = time.perf_counter() - t0
    if _rank() == 0:
        log.info("loaded %d FP8 linears in %.2f s; sampling %d steps", len(loaded.fp8_linears), load_s, args.steps)

    def progress(i: int, n: int) -> None:
        if _rank() == 0:
            log.info("step %d/%d  %s", i + 1, n, "W8A16" if routing.trace[-1] == "a16" else "W8A8")

    t1 = time.perf_counter()
    latent = sample(
        model,
        prompt_ids(args.prompt, model.config.vocab_size),
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        num_latent_tokens=args.latent_tokens,
        step_context=lambda i, n: denoising_step(model, i, n),
        on_step=progress,
    )
    sample_s = time.perf_counter() - t1
    latent_bytes = latent.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    reports = _all_reports(loaded.report)
    return {
        "checkpoint": str(loaded.checkpoint.directory),
        "world_size": reports[0].world_size,
        "device": str(device),
        "fp8_linears": len(loaded.fp8_linears),
        "load_seconds": round(load_s, 3),
        "sample_seconds": round(sample_s, 3),
        "steps": args.steps,
        "precision_trace": describe_trace(routing.trace),
        "step_policy": "checkpoint" if policy is not None else "none",
        "latent_shape": list(latent.shape),
        "latent_sha256": hashlib.sha256(latent_bytes).hexdigest(),
        "ranks": [
            {
                "rank": r.rank,
                "bytes_held": r.bytes_held,
                "bytes_read": r.bytes_read,
                "load_seconds": round(r.seconds, 3),
                "read_gb_per_s": round(r.gb_per_s, 3),
                "peak_rss_bytes": r.peak_rss_bytes,
                "peak_device_bytes": r.peak_device_bytes,
            }
            for r in reports
        ],
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def format_report(result: dict) -> str:
    lines = [
        f"checkpoint      {result['checkpoint']}",
        f"world size      {result['world_size']} ({result['device']})",
        f"FP8 linears     {result['fp8_linears']}",
        f"load            {result['load_seconds']:.2f} s",
        f"sampling        {result['steps']} steps in {result['sample_seconds']:.2f} s",
        f"precision       {result['precision_trace']}  (step policy: {result['step_policy']})",
        f"latent          {tuple(result['latent_shape'])} sha256 {result['latent_sha256']}",
        "",
        f"{'rank':>4}  {'held':>12}  {'read':>12}  {'load s':>7}  {'GB/s':>6}  {'peak RSS':>12}  {'peak device':>12}",
    ]
    for r in result["ranks"]:
        lines.append(
            f"{r['rank']:>4}  {_mib(r['bytes_held']):>12}  {_mib(r['bytes_read']):>12}  {r['load_seconds']:>7.2f}  "
            f"{r['read_gb_per_s']:>6.2f}  {_mib(r['peak_rss_bytes']):>12}  {_mib(r['peak_device_bytes']):>12}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[fsdp_fp8] %(message)s")
    try:
        init_distributed(args.timeout)
        result = run(args)
    except Exception as exc:  # one clear message on rank 0, not a traceback per rank
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("FSDP_FP8_TRACEBACK"):
            raise
        return 1
    if rank == 0:
        print(format_report(result), flush=True)
        if args.report:
            with open(args.report, "w") as f:
                json.dump(result, f, indent=2)
    return 0
