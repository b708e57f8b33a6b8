"""What ``launch/infer.py`` does: load a checkpoint sharded across the ranks, sample, report.

Three steps, each in its own module: parse (``fsdp_fp8.cli.arguments``: every option checked
before torch loads), run (here: init the process group, load, run the kind of model the
checkpoint holds; the pipeline run is ``fsdp_fp8.cli.generate``), print
(``fsdp_fp8.cli.reports``: one dataclass per kind of run, with its own lines).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from fsdp_fp8.cli import interrupts
from fsdp_fp8.cli.arguments import parse_run_args
from fsdp_fp8.cli.generate import is_pipeline_root, run_pipeline
from fsdp_fp8.cli.options import unused_options
from fsdp_fp8.cli.outputs import write_report
from fsdp_fp8.cli.platform import platform_info
from fsdp_fp8.cli.reports import (
    CausalLMReport,
    DenoiserReport,
    ForwardReport,
    MoTReport,
    PipelineReport,
    Quantized,
    RankRow,
    Report,
)
from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.compose.model import load_model
from fsdp_fp8.errors import ArgumentError, ProblemsError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.step_policy import describe_trace
from fsdp_fp8.interop.hf_run import DENOISERS, prompt_bytes, run_hf
from fsdp_fp8.load.options import LoadOptions
from fsdp_fp8.load.preflight import start_process_group
from fsdp_fp8.runtime.collectives import AllGatherMeter
from fsdp_fp8.runtime.heartbeat import stall_s_for, watch_peers
from fsdp_fp8.runtime.inference import prepare_for_inference
from fsdp_fp8.runtime.parallel_layout import ParallelLayout
from fsdp_fp8.runtime.parallel_mesh import ParallelMesh, build_mesh
from fsdp_fp8.runtime.precision import denoising_step
from fsdp_fp8.runtime.ptq import check_ptq_checkpoint, check_ptq_world_size, linear_weight_bytes, quantize_model
from fsdp_fp8.runtime.residency import apply_residency
from fsdp_fp8.runtime.sampler import sample

log = logging.getLogger("fsdp_fp8")


def init_distributed(timeout_s: float) -> None:
    """Under torchrun (``RANK`` set) this rank's process group (``preflight.start_process_group``:
    gloo on CPU, NCCL on CUDA); a single process (no torchrun) runs without a group."""
    if "RANK" in os.environ and not dist.is_initialized():
        start_process_group(timeout_s)


def parallel_mesh_of(args: argparse.Namespace) -> ParallelMesh | None:
    """The launcher's one mesh (``runtime.parallel_mesh``): ``--replicas`` for the weights,
    ``--cfg-parallel`` / ``--ulysses`` for the work (the layout was checked with the arguments).
    None without a process group."""
    if not dist.is_initialized():
        return None
    layout = ParallelLayout(
        rank_and_world()[1],
        cfg_parallel=getattr(args, "cfg_parallel", False),
        ulysses=getattr(args, "ulysses", 1),
        replicas=args.replicas,
    )
    return build_mesh(layout, LoadOptions().device.type)


def load_options_of(args: argparse.Namespace, mesh: ParallelMesh | None = None) -> LoadOptions:
    """The launcher's one ``LoadOptions``, from its arguments: the mesh's weight dims and
    ``--timeout`` for every agreement."""
    return LoadOptions(mesh=mesh.weights if mesh is not None else None, timeout_s=args.timeout)


def _all_rank_rows(load_report) -> list[RankRow]:
    """Every rank's load figures, on every rank (one all-gather of small objects)."""
    reports = [load_report]
    if dist.is_initialized():
        reports = [None] * rank_and_world()[1]
        dist.all_gather_object(reports, load_report)
    return [RankRow.from_load(r) for r in reports]


def _job(args: argparse.Namespace, path, device: torch.device, loaded, load_s: float) -> dict:
    """The fields every report has (``reports.Report``); the caller adds its kind's."""
    world = rank_and_world()[1]
    return dict(
        checkpoint=str(path),
        world_size=world,
        mesh=[args.replicas, world // args.replicas],
        device=str(device),
        fp8_linears=len(loaded.fp8_linears),
        load_seconds=round(load_s, 3),
        ranks=_all_rank_rows(loaded.report),
    )


def checkpoint_path(args: argparse.Namespace):
    """``--checkpoint``, else the embedded demo (built once, then cached) with its size options."""
    if args.checkpoint:
        return args.checkpoint
    from fsdp_fp8.cli.demo import DEMO_SIZE, demo_checkpoint

    if rank_and_world()[0] == 0:
        log.info("using the embedded demo checkpoint (built once, then cached)")
    path = demo_checkpoint()
    for key, value in DEMO_SIZE.items():
        name = {"num_frames": "frames"}.get(key, key)
        if getattr(args, name) is None:
            setattr(args, name, value)
    return path


def run(args: argparse.Namespace) -> Report:
    """Load the checkpoint and run what it holds: a pipeline, a transformers / diffusers model, or
    the reference MoT; the returned report is the same on every rank (rank 0 prints it)."""
    path = checkpoint_path(args)
    if args.quantize:  # a single process (main checked): refuse an FP8 checkpoint before building
        check_ptq_checkpoint(open_checkpoint(path))
    mesh = parallel_mesh_of(args)
    options = load_options_of(args, mesh)
    t0 = time.perf_counter()
    if is_pipeline_root(path):  # a diffusers pipeline: fsdp_fp8.cli.generate
        _warn_unused(args, "pipeline", "a diffusers pipeline")
        with watch_peers(stall_s=stall_s_for(args.timeout), what="during the pipeline's load or generation"):
            fields, loaded = run_pipeline(args, path, options, mesh)
        job = _job(args, path, options.device, loaded, fields.pop("load_seconds"))
        return _warn_no_fp8(PipelineReport(**job, **fields), path)
    if args.prompts or args.output:
        raise ArgumentError(f"--prompts / --output run a diffusers pipeline; {path} has no model_index.json")
    with watch_peers(stall_s=stall_s_for(args.timeout), what="during the model's load or run"):
        return _run_model(args, path, options, t0)


def _run_model(args: argparse.Namespace, path, options: LoadOptions, t0: float) -> Report:
    """A transformers / diffusers model or the reference MoT, from its config.json."""
    # The model class comes from config.json; every rank opens and plans inside load_model,
    # where the ranks agree before anything is built, sharded or read.
    loaded = load_model(None, path, options=options)
    spec = loaded.spec
    _warn_unused(args, "cosmos3" if spec.name in DENOISERS else spec.kind, spec.name)
    quantized = _quantize(args, loaded.model)
    routing = prepare_for_inference(loaded, args.step_policy)
    job = _job(args, loaded.checkpoint.directory, options.device, loaded, time.perf_counter() - t0)
    if spec.kind != "mot":
        report = _run_transformers(args, loaded, job)
    else:
        report = _run_mot(args, loaded, routing, options.device, job)
    report.quantize = quantized
    return report if quantized else _warn_no_fp8(report, path)


def _quantize(args: argparse.Namespace, model) -> Quantized | None:
    if not args.quantize:
        return None
    before = linear_weight_bytes(model)
    names = quantize_model(model, args.quantize, include=args.include, exclude=args.exclude)
    return Quantized(args.quantize, len(names), before, linear_weight_bytes(model))


def _run_transformers(args: argparse.Namespace, loaded, job: dict) -> Report:
    """transformers / diffusers: one deterministic run (``fsdp_fp8.interop.hf_run``), digested."""
    spec = loaded.spec
    t1 = time.perf_counter()
    output = run_hf(loaded.model, spec, loaded.checkpoint.directory, args)
    common = dict(
        job,
        architecture=spec.name,
        kv_scales_unused=len(loaded.plan.kv_scales),
        run_seconds=round(time.perf_counter() - t1, 3),
    )
    if "generated_ids" in output:
        return CausalLMReport(**common, **output)
    if "latent_sha256" in output:
        return DenoiserReport(**common, **output)
    return ForwardReport(**common, **output)


def _run_mot(args: argparse.Namespace, loaded, routing, device, job: dict) -> MoTReport:
    """The reference MoT: our own sampler, the all-gather bytes of each step counted."""
    model = loaded.model
    residency = apply_residency(model, args.resident, budget_bytes=args.resident_budget, device=device)
    rank = rank_and_world()[0]
    if rank == 0:
        log.info(
            "loaded %d FP8 linears in %.2f s; %d of %d blocks resident (%s); sampling %d steps",
            len(loaded.fp8_linears),
            job["load_seconds"],
            len(residency.resident),
            residency.blocks,
            args.resident,
            args.steps,
        )
    step_bytes: list[int] = []  # all-gather bytes this rank sent per step (step 1: with the reasoner)

    def progress(i: int, n: int) -> None:
        step_bytes.append(meter.bytes - sum(step_bytes))
        if rank == 0:
            log.info("step %d/%d  %s", i + 1, n, routing.trace[-1])

    t1 = time.perf_counter()
    with AllGatherMeter() as meter:  # run() watches the peers around the load and this
        latent = sample(
            model,
            prompt_bytes(args.prompt, model.config.vocab_size),
            steps=args.steps,
            seed=args.seed,
            guidance=args.guidance,
            num_latent_tokens=args.latent_tokens,
            step_context=lambda i, n: denoising_step(model, i, n),
            on_step=progress,
        )
    sample_s = time.perf_counter() - t1
    latent_bytes = latent.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return MoTReport(
        **job,
        sample_seconds=round(sample_s, 3),
        steps=args.steps,
        precision_trace=describe_trace(routing.trace),
        step_policy="checkpoint" if routing.policy is not None else "none",
        latent_shape=list(latent.shape),
        latent_sha256=hashlib.sha256(latent_bytes).hexdigest(),
        residency=residency.as_dict(),
        allgather_bytes_per_step=step_bytes,
    )


def _warn_unused(args: argparse.Namespace, kind: str, what: str) -> None:
    """Options this kind of run ignores are named, not dropped silently."""
    unused = unused_options(getattr(args, "given", set()), kind)
    if unused and rank_and_world()[0] == 0:
        log.warning(
            "%s do%s not apply to %s and %s ignored",
            ", ".join(unused),
            "es" if len(unused) == 1 else "",
            what,
            "is" if len(unused) == 1 else "are",
        )


def _warn_no_fp8(report: Report, path) -> Report:
    """A checkpoint without one static-FP8 linear runs in high precision: say so, and report
    no precision trace (W8A8 / W8A16 would describe linears that do not exist)."""
    if report.fp8_linears:
        return report
    if rank_and_world()[0] == 0:
        log.warning(
            "%s has no FP8 linear: every linear runs in high precision (a plain checkpoint, "
            "not a ModelOpt static-FP8 one)",
            path,
        )
    report.set_no_fp8()
    return report


def main(argv: list[str] | None = None, prog: str = "launch/infer.py") -> int:
    """Parse, run, print: the exit status (0, 1 on a failure, 128 + N on signal N)."""
    return execute(parse_run_args(argv, prog))


def execute(args: argparse.Namespace) -> int:
    """Run the parsed ``args`` on this rank and print the outcome once (rank 0, or the rank that
    alone knows of its failure); the exit status."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[fsdp_fp8] %(message)s")
    try:
        if args.quantize:  # a replicated model: no process group, refused at world size > 1
            check_ptq_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        else:
            init_distributed(args.timeout)
        report = run(args)
        for key, value in platform_info(torch.device(report.device)).items():
            setattr(report, key, value)
    except interrupts.Interrupted as stop:  # every rank was sent it: rank 0 says so, once
        if rank == 0:
            print(f"error: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except Exception as exc:  # one clear message on rank 0, not a traceback per rank
        # Errors every rank raised alike (agreed, or before any collective) print once, on
        # rank 0; any other is this rank's own and says which rank it is.
        agreed = isinstance(exc, ProblemsError) or not dist.is_initialized()
        if rank == 0 or not agreed:
            print(f"error{'' if rank == 0 else f' (rank {rank})'}: {exc}", file=sys.stderr, flush=True)
        if rank != 0:
            interrupts.wait_for_rank_0()
        if os.environ.get("FSDP_FP8_TRACEBACK"):
            raise
        # Leaving this clause frees the failed run's frames (weak references' callbacks run):
        # torchrun's SIGTERM then would add an "Exception ignored in" traceback to the line.
        interrupts.ignore()
        return 1
    if rank == 0:
        print(report.text(), flush=True)
        problem = write_report(args.report, report.to_dict()) if args.report else None
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return 1
    return 0
