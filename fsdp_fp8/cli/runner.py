"""What ``launch/infer.py`` does: load a checkpoint sharded across the ranks, sample, report.

Three steps, each in its own module: parse (``fsdp_fp8.cli.arguments``: every option checked
before torch loads), run (here: init the process group, load, run the kind of model the
checkpoint holds; a pipeline runs on the library's engine, ``fsdp_fp8.generation``), print
(``fsdp_fp8.cli.reports``: one dataclass per kind of run, with its own lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from fsdp_fp8.cli import interrupts
from fsdp_fp8.cli.arguments import job_of, parse_run_args
from fsdp_fp8.cli.outputs import check_output, write_report
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
    plural,
)
from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.compose.model import load_model
from fsdp_fp8.compose.pipeline import pipeline_name
from fsdp_fp8.errors import ArgumentError, GenerationError, ProblemsError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.step_policy import describe_trace
from fsdp_fp8.generation.checks import ignored_options, unused_options
from fsdp_fp8.generation.engine import LogObserver, tasks_of
from fsdp_fp8.generation.loading import (
    agree_on_run_settings,
    checkpoint_of,
    is_pipeline_root,
    load_engine,
    with_schedule,
)
from fsdp_fp8.generation.reference_mot import sample_reference_mot
from fsdp_fp8.generation.results import FAILED
from fsdp_fp8.generation.values import GenerationRequest, Job, OptionValues, RunSettings
from fsdp_fp8.interop.hf_run import DENOISERS, run_hf
from fsdp_fp8.load.options import LoadOptions
from fsdp_fp8.load.preflight import start_process_group
from fsdp_fp8.runtime.heartbeat import stall_s_for, watch_peers
from fsdp_fp8.runtime.inference import prepare_for_inference
from fsdp_fp8.runtime.parallel_layout import ParallelLayout
from fsdp_fp8.runtime.parallel_mesh import ParallelMesh, build_mesh
from fsdp_fp8.runtime.ptq import check_ptq_checkpoint, check_ptq_world_size, linear_weight_bytes, quantize_model

log = logging.getLogger("fsdp_fp8")


def init_distributed(timeout_s: float) -> None:
    """Under torchrun (``RANK`` set) this rank's process group (``preflight.start_process_group``:
    gloo on CPU, NCCL on CUDA); a single process (no torchrun) runs without a group."""
    if "RANK" in os.environ and not dist.is_initialized():
        with interrupts.ended_in_native_wait():  # the rendezvous: a peer that already exited never comes
            start_process_group(timeout_s)


def parallel_mesh_of(settings: RunSettings) -> ParallelMesh | None:
    """The launcher's one mesh (``runtime.parallel_mesh``): ``--replicas`` for the weights,
    ``--cfg-parallel`` / ``--ulysses`` for the work (the layout was checked with the arguments).
    None without a process group."""
    if not dist.is_initialized():
        return None
    layout = ParallelLayout(
        rank_and_world()[1], cfg_parallel=settings.cfg_parallel, ulysses=settings.ulysses, replicas=settings.replicas
    )
    return build_mesh(layout, LoadOptions().device.type)


def load_options_of(settings: RunSettings, mesh: ParallelMesh | None = None) -> LoadOptions:
    """The launcher's one ``LoadOptions``, from its settings: the mesh's weight dims and
    ``--timeout`` for every agreement."""
    return LoadOptions(mesh=mesh.weights if mesh is not None else None, timeout_s=settings.timeout)


def _all_rank_rows(load_report) -> list[RankRow]:
    """Every rank's load figures, on every rank (one all-gather of small objects)."""
    reports = [load_report]
    if dist.is_initialized():
        reports = [None] * rank_and_world()[1]
        dist.all_gather_object(reports, load_report)
    return [RankRow.from_load(r) for r in reports]


def _job(settings: RunSettings, path, device: torch.device, loaded, load_s: float) -> dict:
    """The fields every report has (``reports.Report``); the caller adds its kind's."""
    world = rank_and_world()[1]
    return dict(
        checkpoint=str(path),
        world_size=world,
        mesh=[settings.replicas, world // settings.replicas],
        device=str(device),
        fp8_linears=len(loaded.fp8_linears),
        load_seconds=round(load_s, 3),
        ranks=_all_rank_rows(loaded.report),
    )


def run(job: Job) -> Report:
    """Load the checkpoint and run what it holds: a pipeline, a transformers / diffusers model, or
    the reference MoT; the returned report is the same on every rank (rank 0 prints it)."""
    path, request = checkpoint_of(job.settings, job.request)
    request = with_schedule(path, request, job.given)  # a distilled root's fixed steps, guidance 1.0
    job = dataclasses.replace(job, request=request)
    settings = job.settings
    if settings.quantize:  # a single process (main checked): refuse an FP8 checkpoint before building
        check_ptq_checkpoint(open_checkpoint(path))
    agree_on_run_settings(settings, path, job.request.step_policy)  # before the mesh: else ranks hang apart
    mesh = parallel_mesh_of(settings)
    options = load_options_of(settings, mesh)
    t0 = time.perf_counter()
    if is_pipeline_root(path):  # a diffusers pipeline: fsdp_fp8.cli.generate
        _warn_unused(job, "pipeline", "a diffusers pipeline")
        _warn_ignored(job)
        with watch_peers(stall_s=stall_s_for(settings.timeout), what="during the pipeline's load or generation"):
            return _warn_no_fp8(_run_pipeline(job, path, options, mesh), path)
    if job.request.prompts or job.request.output:
        raise ArgumentError(f"--prompts / --output run a diffusers pipeline; {path} has no model_index.json")
    with watch_peers(stall_s=stall_s_for(settings.timeout), what="during the model's load or run"):
        return _run_model(job, path, options, t0)


def _run_pipeline(job: Job, path, options: LoadOptions, mesh) -> PipelineReport:
    """A diffusers pipeline root: loaded once, every prompt run by the library's engine."""
    request, settings = job.request, job.settings
    tasks = tasks_of(request)
    check_output(request.output, sound=request.sound)
    if request.frames == 1 and any(t.prompt.image or t.prompt.video for t in tasks):
        raise ArgumentError("a request conditioned on an image or a video makes a video; pass --frames 5 or more")
    rank, world = rank_and_world()
    t0 = time.perf_counter()
    engine = load_engine(path, settings, step_policy=request.step_policy, mesh=mesh, options=options, given=job.given)
    load_s = time.perf_counter() - t0
    if rank == 0:
        log.info(
            "loaded %s: %s; %s over %s, %s each",
            pipeline_name(engine.pipe),
            plural(len(engine.loaded.fp8_linears), "FP8 linear"),
            plural(len(tasks), "prompt"),
            plural(world, "rank"),
            plural(request.steps, "step"),
        )
    t1 = time.perf_counter()
    results = engine.generate(tasks, LogObserver(engine.routing))
    sample_s = time.perf_counter() - t1
    failed = [r for r in results if r.status == FAILED]
    if failed:  # every rank has the same results: one agreed error
        raise GenerationError([f"prompt {r.index}: {r.error}" for r in failed])
    first = results[0]
    return PipelineReport(
        **_job(settings, path, options.device, engine.loaded, load_s),
        pipeline=pipeline_name(engine.pipe),
        steps=request.steps,
        cfg_parallel=engine.layout.cfg_parallel,
        parallelism=engine.layout.describe(),
        sample_seconds=round(sample_s, 3),
        residency=engine.residency.as_dict(),
        step_policy="checkpoint" if engine.routing.policy is not None else "none",
        precision_trace=first.precision_trace,
        latent_shape=first.latent_shape,
        latent_sha256=first.latent_sha256,
        outputs=results,
        mode=" + ".join(sorted({r.mode for r in results})),
    )


def _run_model(job: Job, path, options: LoadOptions, t0: float) -> Report:
    """A transformers / diffusers model or the reference MoT, from its config.json."""
    # The model class comes from config.json; every rank opens and plans inside load_model,
    # where the ranks agree before anything is built, sharded or read.
    loaded = load_model(None, path, options=options)
    spec = loaded.spec
    _warn_unused(job, "cosmos3" if spec.name in DENOISERS else spec.kind, spec.name)
    quantized = _quantize(job.settings, loaded.model)
    routing = prepare_for_inference(loaded, job.request.step_policy)
    common = _job(job.settings, loaded.checkpoint.directory, options.device, loaded, time.perf_counter() - t0)
    if spec.kind != "mot":
        report = _run_transformers(job.request, loaded, common)
    else:
        report = _run_mot(job, loaded, routing, options.device, common)
    report.quantize = quantized
    return report if quantized else _warn_no_fp8(report, path)


def _quantize(settings: RunSettings, model) -> Quantized | None:
    if not settings.quantize:
        return None
    before = linear_weight_bytes(model)
    names = quantize_model(model, settings.quantize, include=list(settings.include), exclude=list(settings.exclude))
    return Quantized(settings.quantize, len(names), before, linear_weight_bytes(model))


def _run_transformers(request: GenerationRequest, loaded, job: dict) -> Report:
    """transformers / diffusers: one deterministic run (``fsdp_fp8.interop.hf_run``), digested."""
    spec = loaded.spec
    t1 = time.perf_counter()
    output = run_hf(
        loaded.model,
        spec,
        loaded.checkpoint.directory,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        prompt_ids=request.prompt_ids,
        new_tokens=request.new_tokens,
        seed=request.seed,
        steps=request.steps,
        guidance=request.guidance,
    )
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


def _run_mot(job: Job, loaded, routing, device, common: dict) -> MoTReport:
    """The reference MoT (``fsdp_fp8.generation.reference_mot``), reported."""
    run = sample_reference_mot(loaded, routing, job.request, job.settings, device)
    return MoTReport(
        **common,
        sample_seconds=round(run.seconds, 3),
        steps=job.request.steps,
        precision_trace=describe_trace(routing.trace),
        step_policy="checkpoint" if routing.policy is not None else "none",
        latent_shape=list(run.latent.shape),
        latent_sha256=run.latent_sha256,
        residency=run.residency.as_dict(),
        allgather_bytes_per_step=list(run.allgather_bytes_per_step),
    )


def _warn_unused(job: Job, kind: str, what: str) -> None:
    """Options this kind of run ignores are named, not dropped silently."""
    unused = unused_options(set(job.given), kind)
    if unused and rank_and_world()[0] == 0:
        log.warning(
            "%s do%s not apply to %s and %s ignored",
            ", ".join(unused),
            "es" if len(unused) == 1 else "",
            what,
            "is" if len(unused) == 1 else "are",
        )


def _warn_ignored(job: Job) -> None:
    """Options given whose effect this pipeline run never reaches are said once, on rank 0."""
    if rank_and_world()[0] == 0:
        for note in ignored_options(OptionValues(job.request, job.settings), set(job.given)):
            log.warning("%s", note)


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
    alone knows of its failure); the exit status. The ``Namespace`` becomes frozen values here
    (``request.job_of``), once."""
    job = job_of(args)
    settings = job.settings
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[fsdp_fp8] %(message)s")
    try:
        if settings.quantize:  # a replicated model: no process group, refused at world size > 1
            check_ptq_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        else:
            init_distributed(settings.timeout)
        report = run(job)
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
        problem = write_report(settings.report, report.to_dict()) if settings.report else None
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return 1
    return 0
