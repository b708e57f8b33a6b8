"""The VAE decode split over 2 ranks against one rank's tiled decode: wall time on CPU, gloo, one
thread per rank, a Wan 2.2-shaped ``AutoencoderKLWan`` (random weights, the stages, compression
and patch size of Wan2.2-TI2V-5B's VAE, narrower layers) at a size where the decode's compute
dominates, diffusers' default tiles (256 pixels every 192).

Per repeat: rank 0 runs ``vae.decode`` with ``enable_tiling()`` alone (the one-rank tiled decode),
then both ranks run the split decode (``fsdp_fp8.interop.vae_decode``); the floor is rank 0's own
share of the tiles decoded alone (no transfer, no blend). Medians of ``--repeats``; the frames are
compared byte for byte. The load average is printed before and after: the figures are only as
good as the machine was quiet.

    python -m bench.vae_decode [--height 576 --width 576 --frames 5 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from bench import harness
from fsdp_fp8.testing.wan22_vae import wan22_config

WAN22 = wan22_config(16, 32, 1)  # the Wan 2.2 shape, narrow enough for a CPU bench


def _rank(rank: int, world: int, args) -> dict:
    from diffusers import AutoencoderKLWan

    from fsdp_fp8.interop.vae_decode import RequestDecode, assign_tiles, decode_tile, tile_plan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN22).eval()
    vae.enable_tiling()
    latent = (1, 48, (args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
    z = torch.randn(latent, generator=torch.Generator().manual_seed(0))
    plan = tile_plan(vae, latent)
    owned = assign_tiles([plan.area(t, latent[-2], latent[-1]) for t in plan.tiles], world)
    request = RequestDecode(dist.group.WORLD, rank, world)
    one, split, floor, same = [], [], [], True
    with torch.no_grad():
        for _ in range(args.repeats):
            dist.barrier()
            if rank == 0:
                seconds, reference = harness.timed(lambda: vae.decode(z).sample)
                one.append(seconds)
                floor.append(harness.timed(lambda: [decode_tile(vae, z, plan, plan.tiles[i]) for i in owned[0]])[0])
            dist.barrier()
            seconds, out = harness.timed(lambda: request.decode(vae, z))
            split.append(seconds)
            same = same and (out is None or torch.equal(out, reference))
    return dict(one=one, split=split, floor=floor, same=same, tiles=len(plan.tiles), owned=owned)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--height", type=int, default=576)
    p.add_argument("--width", type=int, default=576)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    load_before = os.getloadavg()
    r0 = harness.spawn_ranks(_rank, 2, args)[0]
    one, split, floor = (statistics.median(r0[k]) for k in ("one", "split", "floor"))
    print(
        f"VAE decode, {args.height}x{args.width}, {args.frames} frames: {r0['tiles']} tiles, rank shares {r0['owned']}"
    )
    print(f"  1 rank, tiled:       {one:.2f} s")
    print(f"  2 ranks, split:      {split:.2f} s  ({split / one:.2f}x the one-rank decode)")
    print(f"  floor (rank 0's tiles alone): {floor:.2f} s  (split / floor {split / floor:.2f}x)")
    print(f"  frames equal byte for byte: {r0['same']}")
    print(f"  load average before {load_before}, after {os.getloadavg()} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
