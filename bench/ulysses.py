"""Ulysses attention against one rank: wall time of one transformer pass per rank.

A random-weight Cosmos 3 transformer (``fsdp_fp8.testing.cosmos3_checkpoint``; 2 layers, hidden
256, 8 query and 2 key/value heads of 64) exported to static FP8 and loaded by ``load_model``, one
pass (one forward: one CFG pass of one denoising step) over a long generation sequence, where
attention is most of the work. Three ways, one thread per rank, gloo on CPU:

- ``1 rank``: one process, no process group: the reference;
- ``2 ranks, whole``: FSDP2 over 2 ranks, each computing the whole pass (without Ulysses);
- ``2 ranks, Ulysses 2``: FSDP2 over 2 ranks, the generation rows split (``interop/ulysses``),
  through the transformer's one subclass of ours as ``load_pipeline`` sets it up.

A denoising step is two such passes (classifier-free guidance) and the scheduler's update: the
pass is what Ulysses splits.

Each round starts fresh processes for the three ways in turn (interleaved, so a machine whose
load changes affects all three alike); a round times ``--passes`` passes after a warm-up, with
every rank starting each pass together. Printed: the median per way and rank over all rounds,
the ratios to one rank, whether every way's output has the same bytes, and the load average.

    python -m bench.ulysses [--frames 4 --height 64 --width 64 --rounds 5 --passes 3 --mode native]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from bench import harness
from bench.common import default_cache

CONFIG = dict(
    head_dim=64,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=2,
    latent_channel=4,
    latent_patch_size=2,
    patch_latent_dim=16,
    rope_axes_dim=[16, 8, 8],
    enable_fps_modulation=False,
    vocab_size=1024,
)
TEXT_TOKENS = 64
WAYS = {"1 rank": (1, 1), "2 ranks, whole": (2, 1), "2 ranks, Ulysses 2": (2, 2)}  # way -> (world, Ulysses degree)


def checkpoint() -> Path:
    """The FP8 export of CONFIG, written once into the bench cache."""
    from fsdp_fp8.testing.cosmos3_checkpoint import write_cosmos3_checkpoint

    cache = default_cache()
    path = cache / f"cosmos3-sp-{hashlib.sha256(json.dumps(CONFIG, sort_keys=True).encode()).hexdigest()[:12]}"
    if not (path / "config.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            write_cosmos3_checkpoint(Path(tmp) / "ckpt", CONFIG)
            os.replace(Path(tmp) / "ckpt", path)  # whole or absent
    return path


def _inputs(config, args) -> dict:
    from fsdp_fp8.interop.cosmos import latent_shape, pack_inputs

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (TEXT_TOKENS,), generator=g)
    latent = torch.randn(latent_shape(config, args.frames, args.height, args.width), generator=g).bfloat16()
    return pack_inputs(config, ids, latent, timestep=500.0)


@torch.no_grad()
def _rank(rank: int, world: int, sp_degree: int, args) -> tuple[list[float], str]:
    from fsdp_fp8 import Float8StaticLinear, install_step_policy, load_model, share_quantized_inputs
    from fsdp_fp8.interop.forward_state import PipelineState, attach_pipeline_state
    from fsdp_fp8.interop.ulysses import Ulysses, install_ulysses
    from fsdp_fp8.runtime.parallel_layout import ParallelLayout
    from fsdp_fp8.runtime.parallel_mesh import build_mesh

    model = load_model(None, args.checkpoint, device=torch.device("cpu")).model
    share_quantized_inputs(model)
    for m in model.modules():
        if isinstance(m, Float8StaticLinear):
            m.mode = args.mode
    ulysses = None
    if sp_degree > 1:
        ulysses = Ulysses.of(build_mesh(ParallelLayout(world, ulysses=sp_degree), "cpu"))
        install_ulysses(model, ulysses)
    attach_pipeline_state(model, PipelineState(install_step_policy(model, None), ulysses=ulysses))
    inputs = _inputs(model.config, args)
    out = model(**inputs)[0][0]  # warm-up
    # every rank starts each pass together
    seconds = harness.sample_seconds(lambda: model(**inputs), args.passes, before=dist.barrier if world > 1 else None)
    digest = hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return seconds, digest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--mode", choices=("native", "a16"), default="native", help="W8A8 (native) or W8A16")
    args = p.parse_args()
    args.checkpoint = str(checkpoint())
    times: dict[tuple[str, int], list[float]] = {}
    digests: set[str] = set()
    for _ in range(args.rounds):
        for way, (world, sp_degree) in WAYS.items():
            for rank, (seconds, digest) in harness.spawn_ranks(_rank, world, sp_degree, args).items():
                times.setdefault((way, rank), []).extend(seconds)
                digests.add(digest)
    tokens = args.frames * (args.height // 2) * (args.width // 2)
    print(f"{tokens} generation + {TEXT_TOKENS} text tokens, {args.mode}, {args.rounds} rounds x {args.passes} passes")
    one = statistics.median(times["1 rank", 0])
    for (way, rank), samples in times.items():
        median = statistics.median(samples)
        print(f"{way:<16} rank {rank}  {median * 1000:8.1f} ms/pass   vs 1 rank {median / one:.2f}")
    print(f"outputs identical: {len(digests) == 1}   load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
