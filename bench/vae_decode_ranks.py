"""gpu_smoke's ``decode`` worker, under torchrun: a Wan 2.2-shaped VAE's decode at one size,
one rank's tiled decode (rank 0 alone) against the split over every rank
(``fsdp_fp8.interop.vae_decode``): seconds, each rank's peak (CUDA: ``max_memory_allocated``;
CPU: RSS) and whether the frames are equal byte for byte. Rank 0 writes ``--report`` (JSON).

    torchrun --nproc-per-node N -m bench.vae_decode_ranks --report R.json [--dry]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from bench import harness
from fsdp_fp8.runtime.shutdown import shutdown_distributed
from fsdp_fp8.testing.wan22_vae import WAN22_TI2V_5B, wan22_config

# Wan2.2-TI2V-5B's VAE shape (random weights, BF16); --dry: narrow layers, float32, a small frame.
FULL, DRY = WAN22_TI2V_5B, wan22_config(8, 8, 1)


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed(device, fn):
    _peak_reset(device)
    seconds, out = harness.timed(fn, after=(lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None)
    return round(seconds, 3), _peak(device), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--dry", action="store_true")
    p.add_argument("--frames", type=int, default=17)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.dry
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from diffusers import AutoencoderKLWan

    from fsdp_fp8.interop.vae_decode import RequestDecode

    dtype = torch.bfloat16 if cuda else torch.float32
    height, width, frames = (720, 1280, args.frames) if not args.dry else (96, 96, 5)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**(DRY if args.dry else FULL)).to(device, dtype).eval()
    vae.enable_tiling(*((64, 64, 48, 48) if args.dry else ()))
    latent = (1, 48, (frames - 1) // 4 + 1, height // 16, width // 16)
    z = torch.randn(latent, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    figures = {}
    with torch.no_grad():
        reference = None
        if rank == 0:
            figures["tiled_seconds"], figures["tiled_peak"], reference = _timed(device, lambda: vae.decode(z).sample)
        dist.barrier()
        request = RequestDecode(dist.group.WORLD, rank, world)
        figures["split_seconds"], figures["split_peak"], out = _timed(device, lambda: request.decode(vae, z))
        figures["sent_bytes"] = request.sent_bytes
        if rank == 0:
            figures["equal"] = bool(torch.equal(out, reference))
    every = [None] * world
    dist.all_gather_object(every, figures)
    if rank == 0:
        size = dict(height=height, width=width, frames=frames, dtype=str(dtype), backend=dist.get_backend())
        with open(args.report, "w") as f:
            json.dump(dict(size, world=world, ranks=every), f)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        shutdown_distributed(failed=True)  # keep the traceback and Python's exit status
        raise
    # not a normal exit: gloo's worker threads can abort an interpreter that is finalizing
    # ("terminate called without an active exception"; docs/shutdown.md)
    shutdown_distributed(0)
