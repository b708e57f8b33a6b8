"""What ``launch/infer.py`` does: load a checkpoint sharded across the ranks, sample, report.

    torchrun --nproc-per-node N launch/infer.py [--checkpoint DIR] [--steps S] [--seed K]
             [--prompt TEXT] [--report PATH] ...   (docs/usage.md lists every option)

Without ``--checkpoint`` it runs the embedded demo (built and cached on first use). A
transformers causal LM generates ``--new-tokens`` greedily from ``--prompt-ids`` (or the
prompt); a diffusers transformer runs one forward on ``--seed``-ed inputs (fsdp_fp8.interop.hf_run).
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

from fsdp_fp8.cli.generate import check_output, is_pipeline_root, read_prompts, run_pipeline
from fsdp_fp8.cli.options import given_options, unused_options, value_problems
from fsdp_fp8.cli.platform import platform_info
from fsdp_fp8.errors import ProblemsError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.step_policy import describe_trace, resolve_step_policy
from fsdp_fp8.fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.interop.hf_run import DENOISERS, prompt_bytes, run_hf
from fsdp_fp8.load.api import default_device, load_model, local_cuda_index
from fsdp_fp8.load.collectives import AllGatherMeter
from fsdp_fp8.load.fsdp_wrap import device_mesh
from fsdp_fp8.load.residency import POLICIES, apply_residency
from fsdp_fp8.runtime.precision import denoising_step, install_step_policy
from fsdp_fp8.runtime.ptq import (
    METHODS,
    check_ptq_checkpoint,
    check_ptq_world_size,
    linear_weight_bytes,
    quantize_model,
)
from fsdp_fp8.runtime.sampler import sample

log = logging.getLogger("fsdp_fp8")

ERROR_GRACE_S = 3.0
DEFAULT_PROMPT = "a red fox jumps over a sleeping dog, golden hour"
DEFAULT_LATENT_TOKENS = 64


def parse_args(argv: list[str] | None = None, prog: str = "launch/infer.py") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="ModelOpt static-FP8 checkpoint directory (default: the embedded demo)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="prompt text (a pipeline's tokenizer, else its bytes become token ids)"
    )
    p.add_argument(
        "--prompts", metavar="FILE", help="pipeline: one prompt per line; each rank generates its share (docs/usage.md)"
    )
    p.add_argument("--negative-prompt", default=None, help="pipeline: the unconditional prompt (default empty)")
    p.add_argument(
        "--output",
        metavar="FILE",
        help="pipeline: save the decoded result as .png (image / animated frames) or .mp4; "
        "with --prompts, FILE-000.png, FILE-001.png, ...",
    )
    p.add_argument(
        "--frames",
        type=int,
        help="pipeline: frames to generate (1: an image; default: the demo's, else the pipeline's)",
    )
    p.add_argument("--height", type=int, help="pipeline: height in pixels (default: the demo's, else the pipeline's)")
    p.add_argument("--width", type=int, help="pipeline: width in pixels (default: the demo's, else the pipeline's)")
    p.add_argument("--fps", type=float, default=24.0, help="pipeline: frames per second (prompt template, mp4)")
    p.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale")
    p.add_argument("--latent-tokens", type=int, default=DEFAULT_LATENT_TOKENS, help="latent tokens (default 64)")
    p.add_argument(
        "--step-policy",
        choices=("auto", "off"),
        default="auto",
        help="auto: the checkpoint's diffusion step policy; off: every step W8A8",
    )
    p.add_argument("--prompt-ids", type=_id_list, help="causal LM prompt as token ids, e.g. 1,2,3")
    p.add_argument("--new-tokens", type=int, default=8, help="causal LM: greedy tokens to generate (default 8)")
    p.add_argument("--report", help="also write the report as JSON to this path (rank 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="HSDP: shard within each of R replica groups of WORLD_SIZE / R consecutive ranks (one node "
        "each, with torchrun's rank order) and replicate across them (default 1: shard over every rank)",
    )
    p.add_argument(
        "--cfg-parallel",
        action="store_true",
        help="pipeline: ranks in pairs run the two guidance passes of each step at once (even world size)",
    )
    p.add_argument(
        "--resident",
        choices=POLICIES,
        default="none",
        help="FSDP2 blocks kept gathered between forwards: none (re-gather each forward), "
        "auto (what --resident-budget and the free device memory allow), all",
    )
    p.add_argument(
        "--resident-budget",
        type=_byte_count,
        metavar="BYTES",
        help="with --resident auto: the most the gathered blocks may take per rank (e.g. 60e9, 48GiB)",
    )
    p.add_argument(
        "--quantize",
        choices=METHODS,
        help="quantize a high-precision checkpoint's linears with TorchAO at load (one process)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="RE",
        help="with --quantize: only linears whose name matches RE (re.search; repeatable)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="RE",
        help="with --quantize: leave linears whose name matches RE in high precision (repeatable)",
    )
    args = p.parse_args(argv)
    if (args.include or args.exclude) and not args.quantize:
        p.error("--include / --exclude select linears for --quantize; pass --quantize too")
    if args.resident_budget is not None and args.resident != "auto":
        p.error("--resident-budget applies to --resident auto; pass that too")
    if args.report:  # now, not after the whole run: make its directory, fail if it cannot be
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        except OSError as exc:
            p.error(f"--report {args.report}: cannot create its directory: {exc}")
    if args.prompts and args.quantize:
        p.error("--prompts runs a pipeline; --quantize runs one process on a transformer")
    problems = value_problems(args)  # every value, now: not after the model is loaded
    checks = [lambda: check_output(args.output)]
    if args.prompts is None or os.path.isfile(args.prompts):
        checks.append(lambda: read_prompts(args))
    for check in checks:
        try:
            check()
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
    if problems:
        p.error("; ".join(sorted(problems)))
    args.given = given_options(p, args)
    return args


def _byte_count(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
    }
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].upper()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a byte count such as 60e9 or 48GiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be >= 0, got {text!r}")
    return int(value)


def _id_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def init_distributed(timeout_s: float) -> None:
    """gloo on CPU, NCCL on CUDA; a single process (no torchrun) runs without a group."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return
    device = torch.device("cuda", local_cuda_index())
    torch.cuda.set_device(device)
    # device_id (torch >= 2.3) binds the group to this GPU: NCCL builds its communicator here,
    # so a missing peer or a bad device fails now rather than in the first all-gather, and no
    # collective has to guess the device from the current one.
    dist.init_process_group("nccl", timeout=timeout, device_id=device)


def _mesh(args: argparse.Namespace, device: torch.device):
    """The HSDP mesh ``(replicas, world // replicas)`` for ``--replicas`` > 1, else None (1-D)."""
    if args.replicas == 1 or not dist.is_initialized():
        return None
    return device_mesh(device.type, args.replicas)


def _mesh_shape(args: argparse.Namespace) -> list[int]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return [args.replicas, world // args.replicas]


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
        from fsdp_fp8.cli.demo import DEMO_SIZE, demo_checkpoint

        if _rank() == 0:
            log.info("using the embedded demo checkpoint (built once, then cached)")
        path = demo_checkpoint()
        for key, value in DEMO_SIZE.items():
            name = {"num_frames": "frames"}.get(key, key)
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.quantize:  # a single process (main checked): refuse an FP8 checkpoint before building
        check_ptq_checkpoint(open_checkpoint(path))
    device = default_device()
    mesh = _mesh(args, device)
    t0 = time.perf_counter()
    if is_pipeline_root(path):  # a diffusers pipeline: fsdp_fp8.cli.generate
        _warn_unused(args, "pipeline", "a diffusers pipeline")
        report, loaded = run_pipeline(args, path, device, mesh)
        _warn_no_fp8(report["fp8_linears"], path, report)
        return {
            **report,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": _mesh_shape(args),
            "device": str(device),
            "quantize": None,
            "ranks": _rank_rows(_all_reports(loaded.report)),
        }
    if args.prompts or args.output:
        raise ValueError(f"--prompts / --output run a diffusers pipeline; {path} has no model_index.json")
    # The model class comes from config.json; every rank opens and plans inside load_model,
    # where the ranks agree before anything is built, sharded or read.
    loaded = load_model(None, path, mesh, device=device)
    model, arch = loaded.model, loaded.architecture
    _warn_unused(args, "cosmos3" if arch.name in DENOISERS else arch.kind, arch.name)
    quantized = None
    if args.quantize:
        before = linear_weight_bytes(model)
        names = quantize_model(model, args.quantize, include=args.include, exclude=args.exclude)
        quantized = {
            "method": args.quantize,
            "linears": len(names),
            "weight_bytes_before": before,
            "weight_bytes_after": linear_weight_bytes(model),
        }
    policy = resolve_step_policy(loaded.checkpoint.quant.step_policy, args.step_policy)
    routing = install_step_policy(model, policy, loaded.towers)
    share_quantized_inputs(model)
    load_s = time.perf_counter() - t0
    if arch.kind != "mot":  # transformers / diffusers: one deterministic run, digested
        t1 = time.perf_counter()
        output = run_hf(model, arch, loaded.checkpoint.directory, args)
        if quantized is None:
            _warn_no_fp8(len(loaded.fp8_linears), path, output)
        return {
            "checkpoint": str(loaded.checkpoint.directory),
            "architecture": arch.name,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": _mesh_shape(args),
            "device": str(device),
            "fp8_linears": len(loaded.fp8_linears),
            "kv_scales_unused": len(loaded.plan.kv_scales),
            "quantize": quantized,
            "load_seconds": round(load_s, 3),
            "run_seconds": round(time.perf_counter() - t1, 3),
            **output,
            "ranks": _rank_rows(_all_reports(loaded.report)),
        }
    residency = apply_residency(model, args.resident, budget_bytes=args.resident_budget, device=device)
    if _rank() == 0:
        log.info(
            "loaded %d FP8 linears in %.2f s; %d of %d blocks resident (%s); sampling %d steps",
            len(loaded.fp8_linears),
            load_s,
            len(residency.resident),
            residency.blocks,
            args.resident,
            args.steps,
        )
    step_bytes: list[int] = []  # all-gather bytes this rank sent per step (step 1: with the reasoner)

    def progress(i: int, n: int) -> None:
        step_bytes.append(meter.bytes - sum(step_bytes))
        if _rank() == 0:
            log.info("step %d/%d  %s", i + 1, n, routing.trace[-1])

    t1 = time.perf_counter()
    with AllGatherMeter() as meter:
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
    reports = _all_reports(loaded.report)
    trace = {"precision_trace": describe_trace(routing.trace)}
    if quantized is None:
        _warn_no_fp8(len(loaded.fp8_linears), path, trace)
    return {
        "checkpoint": str(loaded.checkpoint.directory),
        "world_size": reports[0].world_size,
        "mesh": _mesh_shape(args),
        "device": str(device),
        "fp8_linears": len(loaded.fp8_linears),
        "quantize": quantized,
        "load_seconds": round(load_s, 3),
        "sample_seconds": round(sample_s, 3),
        "steps": args.steps,
        **trace,
        "step_policy": "checkpoint" if policy is not None else "none",
        "latent_shape": list(latent.shape),
        "latent_sha256": hashlib.sha256(latent_bytes).hexdigest(),
        "residency": residency.as_dict(),
        "allgather_bytes_per_step": step_bytes,
        "ranks": _rank_rows(reports),
    }


def _warn_unused(args: argparse.Namespace, kind: str, what: str) -> None:
    """Options this kind of run ignores are named, not dropped silently."""
    unused = unused_options(getattr(args, "given", set()), kind)
    if unused and _rank() == 0:
        log.warning(
            "%s do%s not apply to %s and %s ignored",
            ", ".join(unused),
            "es" if len(unused) == 1 else "",
            what,
            "is" if len(unused) == 1 else "are",
        )


def _warn_no_fp8(fp8_linears: int, path, result: dict) -> None:
    """A checkpoint without one static-FP8 linear runs in high precision: say so, and report
    no precision trace (W8A8 / W8A16 would describe linears that do not exist)."""
    if fp8_linears:
        return
    if _rank() == 0:
        log.warning(
            "%s has no FP8 linear: every linear runs in high precision (a plain checkpoint, "
            "not a ModelOpt static-FP8 one)",
            path,
        )
    for row in [result, *result.get("outputs", [])]:
        if "precision_trace" in row:
            row["precision_trace"] = None


def _rank_rows(reports) -> list[dict]:
    return [
        {
            "rank": r.rank,
            "bytes_held": r.bytes_held,
            "bytes_read": r.bytes_read,
            "load_seconds": round(r.seconds, 3),
            "read_seconds": round(r.read_seconds, 3),
            "read_gb_per_s": round(r.gb_per_s, 3),
            "peak_rss_bytes": r.peak_rss_bytes,
            "peak_device_bytes": r.peak_device_bytes,
        }
        for r in reports
    ]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _quantize_lines(q: dict | None) -> list[str]:
    if q is None:
        return []
    before, after = q["weight_bytes_before"], q["weight_bytes_after"]
    return [
        f"quantized       {q['linears']} linears to {q['method']} at load (TorchAO)",
        f"linear weights  {before:,} -> {after:,} bytes ({after / before:.2f}x)",
    ]


def _output_lines(result: dict) -> list[str]:
    if "generated_ids" in result:  # a transformers causal LM (fsdp_fp8.interop.hf_run)
        return [
            f"model           {result['architecture']}, KV-cache scales unused: {result['kv_scales_unused']}",
            f"prompt          {result['prompt_ids']} ({result['prompt_source']})",
            f"generated       {result['generated_ids']} in {result['run_seconds']:.2f} s (greedy)",
            f"logits          sha256 {result['logits_sha256']}",
        ]
    if "pipeline" in result:  # a diffusers pipeline (fsdp_fp8.cli.generate)
        lines = [
            f"pipeline        {result['pipeline']}, {len(result['outputs'])} prompt(s), {result['steps']} steps "
            f"in {result['sample_seconds']:.2f} s",
            f"precision       {result['precision_trace']}  (step policy: {result['step_policy']})",
            f"resident        {len(result['residency']['resident'])} of {result['residency']['blocks']} "
            f"blocks ({result['residency']['policy']})",
        ]
        for row in result["outputs"]:
            saved = f" -> {row['output']}" if "output" in row else ""
            lines.append(
                f"latent {row['index']:>3}      {tuple(row['latent_shape'])} sha256 {row['latent_sha256']}"
                f" (rank {row['rank']}){saved}"
            )
        return lines
    if "precision_trace" in result and "architecture" in result:  # a diffusers denoiser, alone
        return [
            f"model           {result['architecture']}, {result['steps']} steps in {result['run_seconds']:.2f} s",
            f"precision       {result['precision_trace']}",
            f"latent          {tuple(result['latent_shape'])} sha256 {result['latent_sha256']}",
        ]
    if "output_sha256" in result:  # a diffusers transformer
        return [
            f"model           {result['architecture']}, one forward in {result['run_seconds']:.2f} s",
            f"output          {tuple(result['output_shape'])} sha256 {result['output_sha256']}",
        ]
    res, per_step = result["residency"], result["allgather_bytes_per_step"]
    return [
        f"sampling        {result['steps']} steps in {result['sample_seconds']:.2f} s",
        f"precision       {result['precision_trace']}  (step policy: {result['step_policy']})",
        f"resident        {len(res['resident'])} of {res['blocks']} blocks ({res['policy']})",
        f"all-gathered    {per_step[0]:,} B in step 1 (with the reasoner), {per_step[-1]:,} B per step after",
        f"latent          {tuple(result['latent_shape'])} sha256 {result['latent_sha256']}",
    ]


def _no_trace(line: str) -> str:
    return line.replace("precision       None", "precision       high precision (no FP8 linear)")


def _mesh_words(shape: list[int] | None) -> str:
    if not shape or shape[0] == 1:
        return ""
    return f", HSDP mesh {shape[0]} x {shape[1]} (replicate x shard)"


def format_report(result: dict) -> str:
    lines = [
        f"checkpoint      {result['checkpoint']}",
        f"world size      {result['world_size']} ({result['device']}){_mesh_words(result.get('mesh'))}",
        f"FP8 linears     {result['fp8_linears']}",
        *_quantize_lines(result.get("quantize")),
        f"load            {result['load_seconds']:.2f} s",
        *map(_no_trace, _output_lines(result)),
        # What the digests above depend on besides checkpoint and options (docs/usage.md).
        f"computed with   torch {result['torch']} on {result['device']}, {result['device_name']}; "
        "digests compare only with runs on the same torch build and device model",
        "",
        f"{'rank':>4}  {'held':>12}  {'read':>12}  {'load s':>7}  {'read s':>7}  {'GB/s':>6}  {'peak RSS':>12}  "
        f"{'peak device':>12}",
    ]
    for r in result["ranks"]:
        lines.append(
            f"{r['rank']:>4}  {_mib(r['bytes_held']):>12}  {_mib(r['bytes_read']):>12}  {r['load_seconds']:>7.2f}  "
            f"{r['read_seconds']:>7.2f}  {r['read_gb_per_s']:>6.2f}  {_mib(r['peak_rss_bytes']):>12}  "
            f"{_mib(r['peak_device_bytes']):>12}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "launch/infer.py") -> int:
    args = parse_args(argv, prog)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[fsdp_fp8] %(message)s")
    try:
        if args.quantize:  # a replicated model: no process group, refused at world size > 1
            check_ptq_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        else:
            init_distributed(args.timeout)
        result = run(args)
        result.update(platform_info(torch.device(result["device"])))
    except Exception as exc:  # one clear message on rank 0, not a traceback per rank
        # Errors every rank raised alike (agreed, or before any collective) print once, on
        # rank 0; any other is this rank's own and says which rank it is.
        agreed = isinstance(exc, ProblemsError) or not dist.is_initialized()
        if rank == 0 or not agreed:
            print(f"error{'' if rank == 0 else f' (rank {rank})'}: {exc}", file=sys.stderr, flush=True)
        if rank != 0:
            # torchrun stops every rank once one exits non-zero: give rank 0 time to print.
            time.sleep(ERROR_GRACE_S)
        if os.environ.get("FSDP_FP8_TRACEBACK"):
            raise
        return 1
    if rank == 0:
        print(format_report(result), flush=True)
        if args.report:
            with open(args.report, "w") as f:
                json.dump(result, f, indent=2)
    return 0
