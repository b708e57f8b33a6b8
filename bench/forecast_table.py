"""The per-GPU memory forecast for Cosmos 3 Nano and Super (docs/cosmos3.md), from their
transformer shapes alone (``fsdp_fp8.runtime.forecast.config_tensors``: meta device, nothing
downloaded). Prints a Markdown table: 1, 2, 4, 8 GPUs x 720p / 189 frames and a 1024^2 image.

    python -m bench.forecast_table [--cfg-parallel]
    python -m bench.forecast_table --step-time    # per layout: memory and seconds per step (runtime.step_time)
    python -m bench.forecast_table --job          # the whole job: denoising and the VAE's phases (runtime.vae_forecast)
"""

from __future__ import annotations

import argparse

from fsdp_fp8.runtime.forecast import DEFAULT_TEXT_TOKENS, GiB, TransformerShape, VideoSize, config_tensors, forecast
from fsdp_fp8.runtime.parallel_layout import ParallelLayout
from fsdp_fp8.runtime.step_time import H200, LINK_EFFICIENCY, MFU, step_seconds
from fsdp_fp8.testing.wan22_vae import WAN22_TI2V_5B

# Nano: diffusers 0.42's Cosmos3OmniTransformer defaults (36 layers, 15.2B parameters: the
# published count). Super: the 64-layer Qwen3-VL-32B text shape per tower (64B parameters); not
# checked against the checkpoint's config.json.
NANO = {"num_hidden_layers": 36}
SUPER = {
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 64,
}
VAE_BYTES = int(1.4e9)  # assumed: a Wan 2.x VAE in BF16, not verified
# Wan2.2-TI2V-5B's vae/config.json (the shape the Cosmos 3 pipeline decodes with: 16x spatial, 4x
# temporal, 48 latent channels, patch size 2); its weights assumed in BF16 (VAE_BYTES).
WAN22_VAE = dict(WAN22_TI2V_5B, _class_name="AutoencoderKLWan")
SIZES = {"720p, 189 frames": VideoSize(720, 1280, 189), "1024^2 image": VideoSize(1024, 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cfg-parallel", action="store_true")
    p.add_argument("--step-time", action="store_true", help="the per-step time forecast instead of memory")
    p.add_argument("--job", action="store_true", help="the whole job's peak per GPU, the phase that sets it")
    args = p.parse_args()
    if args.step_time:
        return step_time_table()
    if args.job:
        return job_table()
    print("| model | size | GPUs | weights | gathered | activations | peak per GPU |")
    print("|---|---|---|---|---|---|---|")
    for name, overrides in (("Nano", NANO), ("Super", SUPER)):
        config = {**_defaults(), **overrides}
        tensors = config_tensors(config)
        shape = TransformerShape.from_config(config)
        for label, size in SIZES.items():
            for world in (1, 2, 4, 8):
                if args.cfg_parallel and world == 1:
                    continue
                fc = forecast(tensors, shape, size, world, components_bytes=VAE_BYTES, cfg_parallel=args.cfg_parallel)
                t = {term.name: term.device_bytes for term in fc.terms}
                gathered = t.get("root unit, gathered", 0) + t.get("decoder layers in flight", 0)
                print(
                    f"| {name} | {label} | {world} | {t['sharded weights'] / GiB:.1f} | {gathered / GiB:.1f} | "
                    f"{t['activations'] / GiB:.1f} | {fc.device_bytes / GiB:.1f} GiB |"
                )


def plans(gpus: int) -> list[ParallelLayout]:
    """FSDP alone, CFG-parallel, and the Ulysses layouts ``gpus`` allows."""
    out = [ParallelLayout(gpus)]
    if gpus >= 2:
        out.append(ParallelLayout(gpus, cfg_parallel=True))
        out.append(ParallelLayout(gpus, ulysses=gpus))
    if gpus >= 4:
        out.append(ParallelLayout(gpus, cfg_parallel=True, ulysses=gpus // 2))
    return out


def step_time_table() -> None:
    """Per GPU at 720p / 189 frames: the memory peak and the seconds per step of each layout."""
    size = SIZES["720p, 189 frames"]
    print(
        f"assumed: {MFU:.0%} of dense peak, {LINK_EFFICIENCY:.0%} of NVLink; {H200.name}, {DEFAULT_TEXT_TOKENS} text tokens"
    )
    print(
        "| model | GPUs | parallelism | peak per GPU | fits H100 80 GB | s / step W8A8 | s / step W8A16 | x one GPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, overrides in (("Nano", NANO), ("Super", SUPER)):
        config = {**_defaults(), **overrides}
        tensors, shape = config_tensors(config), TransformerShape.from_config(config)
        vision = size.vision_tokens(shape.patch)
        one = step_seconds(shape, DEFAULT_TEXT_TOKENS, vision, ParallelLayout(1), H200)
        for gpus in (1, 2, 4, 8):
            for plan in plans(gpus):
                fc = forecast(
                    tensors,
                    shape,
                    size,
                    gpus,
                    components_bytes=VAE_BYTES,
                    cfg_parallel=plan.cfg_parallel,
                    ulysses=plan.ulysses,
                )
                peak = fc.device_bytes / GiB
                fp8 = step_seconds(shape, DEFAULT_TEXT_TOKENS, vision, plan, H200)
                bf16 = step_seconds(shape, DEFAULT_TEXT_TOKENS, vision, plan, H200, w8a8=False)
                fits = "yes" if peak + 1 <= 74.5 else "no"  # 80 GB = 74.5 GiB, 1 GiB for CUDA and NCCL
                print(
                    f"| {name} | {gpus} | {plan.describe().replace('none', 'FSDP only')} | {peak:.1f} GiB | {fits} | {fp8:.2f} | {bf16:.2f} | "
                    f"{one / fp8:.1f}x |"
                )


def job_table() -> None:
    """Per GPU: the denoising loop and the VAE's phases beside the resident shards; the peak and
    the phase that sets it, with the decode untiled (--vae-tiling off) and tiled (on)."""
    import torch

    from fsdp_fp8.runtime.vae_forecast import job_forecast

    print("| model | size | GPUs | denoising | decode untiled | decode tiled | peak, tiling off | peak, tiling on |")
    print("|---|---|---|---|---|---|---|---|")
    phases = {}  # the VAE's working sets: the same for every model and world size
    for name, overrides in (("Nano", NANO), ("Super", SUPER)):
        config = {**_defaults(), **overrides}
        tensors, shape = config_tensors(config), TransformerShape.from_config(config)
        for label, size in SIZES.items():
            latent = (1, 48, *size.latent())
            video = (1, 3, size.frames, size.height, size.width)
            for world in (1, 2, 4, 8):
                fc = forecast(tensors, shape, size, world, components_bytes=VAE_BYTES)
                resident = sum(t.device_bytes for t in fc.terms if t.name in ("sharded weights", "non-FP8 components"))
                if label not in phases:
                    phases[label] = job_forecast(WAN22_VAE, 0, 0, latent, video, torch.bfloat16).phases
                cells = [fc.device_bytes] + [resident + p.working_bytes for p in phases[label][1:3]]
                peaks = []
                for skip in (", tiled", ", untiled"):
                    candidates = [("denoising", fc.device_bytes)] + [
                        (p.name.removeprefix("VAE "), resident + p.working_bytes)
                        for p in phases[label][1:]
                        if skip not in p.name and "encode" not in p.name
                    ]
                    top = max(candidates, key=lambda c: c[1])
                    fits = _fits(top[1])
                    peaks.append(f"{top[1] / GiB:.1f} GiB ({top[0]}; fits {fits})")
                print(
                    f"| {name} | {label} | {world} | "
                    + " | ".join(f"{c / GiB:.1f}" for c in cells)
                    + f" | {peaks[0]} | {peaks[1]} |"
                )


def _fits(peak: int) -> str:
    """The smallest of 48 GB / 80 GB cards the peak fits, 1 GiB left for the CUDA context and NCCL."""
    return "48 GB" if peak + GiB <= 44.7 * GiB else "80 GB" if peak + GiB <= 74.5 * GiB else "neither"


def _defaults() -> dict:
    import inspect

    from diffusers import Cosmos3OmniTransformer

    sig = inspect.signature(Cosmos3OmniTransformer.__init__)
    return {k: v.default for k, v in sig.parameters.items() if k != "self" and v.default is not inspect._empty}


if __name__ == "__main__":
    main()
