"""The reference MoT denoiser's run, for every front end: its residency applied, then ``steps``
of fsdp_fp8's own flow-matching sampler (``fsdp_fp8.runtime.sampler``), each step's precision
from the checkpoint's step policy and the all-gather bytes this rank sent counted per step.

The launcher reports it (``fsdp_fp8.cli.reports.MoTReport``); a Python caller gets the same
``MoTSample`` from ``sample_reference_mot``. Diffusers pipelines run on the engine instead
(``fsdp_fp8.generation.engine``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.generation.values import GenerationRequest, RunSettings
from fsdp_fp8.interop.hf_run import prompt_bytes
from fsdp_fp8.runtime.allgather_meter import AllGatherMeter
from fsdp_fp8.runtime.precision import denoising_step
from fsdp_fp8.runtime.residency import Residency, apply_residency
from fsdp_fp8.runtime.sampler import sample

log = logging.getLogger("fsdp_fp8")


@dataclass(frozen=True)
class MoTSample:
    """One run of the reference MoT: the final latent, its digest and shape, the seconds the
    sampler took, the blocks kept gathered and the all-gather bytes this rank sent per step (the
    first step's with the reasoner's pass)."""

    latent: torch.Tensor
    latent_sha256: str
    seconds: float
    residency: Residency
    allgather_bytes_per_step: tuple[int, ...]


def sample_reference_mot(loaded, routing, request: GenerationRequest, settings: RunSettings, device) -> MoTSample:
    """``request.steps`` steps of the loaded reference MoT on ``device``, ``routing`` (from
    ``prepare_for_inference``) choosing each step's precision; ``settings.resident`` decides
    which blocks stay gathered."""
    model = loaded.model
    residency = apply_residency(model, settings.resident, budget_bytes=settings.resident_budget, device=device)
    rank = rank_and_world()[0]
    if rank == 0:
        log.info(
            "%d FP8 linears; %d of %d blocks resident (%s); sampling %d steps",
            len(loaded.fp8_linears),
            len(residency.resident),
            residency.blocks,
            settings.resident,
            request.steps,
        )
    step_bytes: list[int] = []

    def progress(i: int, n: int) -> None:
        step_bytes.append(meter.bytes - sum(step_bytes))
        if rank == 0:
            log.info("step %d/%d  %s", i + 1, n, routing.trace[-1])

    t0 = time.perf_counter()
    with AllGatherMeter() as meter:
        latent = sample(
            model,
            prompt_bytes(request.prompt, model.config.vocab_size),
            steps=request.steps,
            seed=request.seed,
            guidance=request.guidance,
            num_latent_tokens=request.latent_tokens,
            step_context=lambda i, n: denoising_step(model, i, n),
            on_step=progress,
        )
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256(latent.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()
    return MoTSample(latent, digest, seconds, residency, tuple(step_bytes))
