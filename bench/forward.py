"""All-gather bytes per forward and time per denoising step: FP8 (W8A8, W8A16) against BF16.

    torchrun --nproc-per-node N -m bench.forward [--size small|default] [--steps 5] [--reps 3]

The same reference MoT is loaded twice with ``load_model``: from its FP8 checkpoint and from
its BF16 one (exported by bench/common.py, cached). Bytes are counted at the collective
(``fsdp_fp8.runtime.allgather_meter.AllGatherMeter``: the all-gather FSDP2 calls on this torch), per forward. A
denoising step is what the sampler does per step: a conditional and an unconditional
``denoise`` (classifier-free guidance); the reasoner runs once, outside the timing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bench import common, harness
from fsdp_fp8 import Float8StaticLinear, load_model
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.interop.architectures import resolve_model_spec
from fsdp_fp8.load.options import local_cuda_index
from fsdp_fp8.runtime.allgather_meter import AllGatherMeter
from fsdp_fp8.runtime.shutdown import shutdown_distributed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(common.SIZES), default="small")
    p.add_argument("--steps", type=int, default=5, help="timed denoising steps per repetition")
    p.add_argument("--reps", type=int, default=3, help="repetitions, the three variants interleaved")
    p.add_argument("--latent-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (NCCL) when available, else CPU (gloo)",
    )
    p.add_argument("--dir", help="checkpoint cache (see bench/load.py)")
    p.add_argument("--results", default=str(common.RESULTS))
    return p.parse_args(argv)


def expected_gather_bytes(model, world: int) -> tuple[int, int]:
    """(FP8-linear weight bytes, all other bytes) one rank sends to unshard everything, padded rows."""
    fp8_weights = {id(m.weight) for m in model.modules() if isinstance(m, Float8StaticLinear)}
    q = other = 0
    for p in model.parameters():
        rows = p.shape[0] if p.ndim else 1
        row_elems = math.prod(p.shape[1:])
        n = math.ceil(rows / world) * row_elems
        if id(p) in fp8_weights:
            q += n  # one byte per element: codes travel as uint8, scales never travel
        else:
            other += n * p.dtype.itemsize
    return q, other


def set_mode(model, mode: str) -> None:
    for m in model.modules():
        if isinstance(m, Float8StaticLinear):
            m.mode = mode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def step_seconds(model, x, t, state, steps: int) -> list[float]:
    """Seconds of ``steps`` guided steps (two forwards), each ended by the slowest rank."""

    def step() -> None:
        model.denoise(x, t, state)
        model.denoise(x, t, None)

    def done() -> None:
        _sync(x.device)
        dist.barrier()

    return harness.sample_seconds(step, steps, before=lambda: _sync(x.device), after=done)


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    timeout = timedelta(seconds=1800)
    if use_cuda:
        device = torch.device("cuda", local_cuda_index())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    backend = dist.get_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        fp8_dir, bf16_dir = common.checkpoints(args.size, args.dir)
    box = [(fp8_dir, bf16_dir) if rank == 0 else None]
    dist.broadcast_object_list(box)
    fp8_dir, bf16_dir = box[0]
    arch = resolve_model_spec(open_checkpoint(fp8_dir).config)
    fp8 = load_model(arch.model_fn, fp8_dir, device=device).model
    share_quantized_inputs(fp8)
    bf16 = load_model(arch.model_fn, bf16_dir, device=device).model
    cfg = fp8.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens), generator=gen)
    prompt = prompt.to(device)
    x = torch.randn(1, args.latent_tokens, cfg.latent_channels, generator=gen).to(device, torch.bfloat16)
    t = torch.full((1,), 0.5, device=device)

    gathered = {}
    states = {}
    with torch.no_grad():
        for name, model in (("fp8", fp8), ("bf16", bf16)):
            set_mode(model, "native")
            states[name] = model.reason(prompt)
            counts = []
            for _ in range(2):  # first forward after reason, then steady state
                with AllGatherMeter() as c:
                    model.denoise(x, t, states[name])
                counts.append(c.bytes)
            gathered[name] = counts
    q, other = expected_gather_bytes(fp8, world)

    variants = {"W8A8": (fp8, "native", "fp8"), "W8A16": (fp8, "a16", "fp8"), "BF16": (bf16, "native", "bf16")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for name, (model, mode, s) in variants.items():  # warm-up
        set_mode(model, mode)
        step_seconds(model, x, t, states[s], 1)
    for _, name in harness.interleaved(variants, args.reps):
        model, mode, s = variants[name]
        set_mode(model, mode)
        times[name] += step_seconds(model, x, t, states[s], args.steps)
    set_mode(fp8, "native")

    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        steady_fp8, steady_bf16 = gathered["fp8"][1], gathered["bf16"][1]
        record = {
            "bench": "forward",
            "size": args.size,
            "world_size": world,
            "cpus": os.cpu_count(),
            "backend": backend,
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "latent_tokens": args.latent_tokens,
            "prompt_tokens": args.prompt_tokens,
            "allgather_bytes_fp8": gathered["fp8"],
            "allgather_bytes_bf16": gathered["bf16"],
            "expected_fp8_linear_bytes": q,
            "expected_other_bytes": other,
            "step_seconds_median": med,
            "step_seconds_all": {k: [round(s, 4) for s in v] for k, v in times.items()},
        }
        print(
            f"world size {world} ({backend}, {record['device']}), size {args.size}, "
            f"{args.latent_tokens} latent + {args.prompt_tokens} prompt tokens"
        )
        print("all-gather bytes per forward (this rank; first forward, then steady state):")
        print(f"  FP8  model: {gathered['fp8']}")
        print(f"  BF16 model: {gathered['bf16']}")
        if world > 1:
            rest = steady_fp8 - q  # norms and biases of the blocks: BF16 in both models
            record["fp8_over_bf16"] = steady_fp8 / steady_bf16
            record["bf16_equals_2q_plus_rest"] = steady_bf16 == 2 * q + rest
            print(
                f"  FP8 / BF16 = {steady_fp8 / steady_bf16:.4f}: FP8 = {q:,} B of E4M3 codes + {rest:,} B BF16 "
                f"norms/biases; BF16 = 2 x {q:,} + {steady_bf16 - 2 * q:,} B; scales moved: 0 B "
                f"(the root's BF16 embeddings/heads stay gathered after the first forward)"
            )
        print(f"time per denoising step (2 forwards, median of {args.reps} x {args.steps}):")
        for k, v in med.items():
            print(f"  {k:<6} {v * 1e3:9.1f} ms   ({v / med['BF16']:.2f}x BF16)")
        common.append_jsonl(args.results, [record])
    dist.barrier()
    return 0


if __name__ == "__main__":
    # Destroys the group and leaves through os._exit after flushing (docs/shutdown.md).
    shutdown_distributed(main())
