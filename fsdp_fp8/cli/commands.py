"""``fsdp-fp8`` / ``python -m fsdp_fp8``: ``run`` (the launcher), ``serve`` (the server: ``cli.serving``),
``inspect``, ``verify`` and ``save``.

``inspect`` and ``verify`` look at a checkpoint without loading it: ``inspect`` summarises
headers and scales; ``verify`` decides as ``load_model`` would (docs/usage.md). ``save``
loads a checkpoint (sharded under torchrun) and writes it back with ``save_checkpoint``.

Nothing that imports torch is imported before the options are parsed and checked: ``--help``
and a usage error answer at once (each subcommand imports what it needs when it runs).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_fp8.cli import interrupts, quiet
from fsdp_fp8.cli.arguments import RankZeroParser, add_option, byte_count
from fsdp_fp8.cli.inspection import (
    MAX_WORLD_SIZE,
    bytes_and_mib,
    cache_line,
    per_shard_lines,
    shard_groups,
    summary,
    who,
    world_words,
)
from fsdp_fp8.cli.reports import plural
from fsdp_fp8.errors import CheckpointError, PeerLostError, ProblemsError
from fsdp_fp8.format.cache_option import cache_option_problems
from fsdp_fp8.format.timeouts import timeout_problems
from fsdp_fp8.generation.declare import bounds, declared
from fsdp_fp8.generation.inputs import checkpoint_problems
from fsdp_fp8.generation.values import RESIDENT_POLICIES, GenerationRequest, RunSettings
from fsdp_fp8.reading.read_options import ALL_ROWS, ReadOptions

if TYPE_CHECKING:
    from fsdp_fp8.format.checkpoint import Checkpoint


def _open(directory: str) -> Checkpoint | None:
    from fsdp_fp8.format.checkpoint import open_checkpoint

    try:
        return open_checkpoint(directory)
    except (CheckpointError, OSError) as exc:
        print(exc, file=sys.stderr)
        return None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _world_size(text: str) -> int:
    value = _positive(text)
    if value > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(
            f"must be <= {MAX_WORLD_SIZE:,} (the most ranks a forecast is made for), got {value:,}"
        )
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _inspect(args: argparse.Namespace) -> int:
    ckpt = _open(args.directory)
    if ckpt is None:
        return 1
    print(summary(ckpt, args.world_size, args.replicas, ReadOptions(prefetch_bytes=args.prefetch_bytes)))
    if args.cache not in (None, "off"):  # the step cache's range of computed steps (format.cache_option)
        print(cache_line(ckpt.quant.step_policy, args.steps, args.cache))
    if args.height or args.width or args.frames or args.action:  # the per-GPU memory forecast (runtime.forecast)
        from fsdp_fp8.format.hub import resolve_hub_path
        from fsdp_fp8.interop.diffusers_pipeline import schedule_of
        from fsdp_fp8.runtime.forecast import ActionChunk, forecast_checkpoint

        size = {"height": args.height or 720, "width": args.width or 1280, "frames": args.frames or 1}
        tier = {"resolution_tier": args.resolution_tier} if args.resolution_tier else {}
        action = ActionChunk(args.action, args.chunk_size, **tier) if args.action else None
        try:
            fc = forecast_checkpoint(
                args.directory,
                args.world_size or 1,
                **size,
                action=action,
                schedule=schedule_of(resolve_hub_path(args.directory)),
                resident=args.resident,
                resident_budget=args.resident_budget,
                offload=args.offload,
                cfg_parallel=args.cfg_parallel,
                ulysses=args.ulysses,
            )
        except (ValueError, OSError) as exc:  # a config it cannot divide by, another class, no config
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("\n".join(fc.lines()))
        _print_job(args.directory, fc, {"height": fc.video.height, "width": fc.video.width, "frames": fc.video.frames})
    return 0


def _action_problems(args: argparse.Namespace) -> list[str]:
    """inspect's action options, as the run takes them: a chunk with the mode, the frames from the
    chunk, the run's bound on it."""
    chunk, tier = args.chunk_size, args.resolution_tier
    if args.action is None:
        given = [flag for flag, value in (("--chunk-size", chunk), ("--resolution-tier", tier)) if value is not None]
        return [f"{' / '.join(given)}: the forecast of an action job; give --action too"] if given else []
    problems = [f"--action {args.action} needs --chunk-size (its action tokens)"] if chunk is None else []
    if args.frames:
        problems.append("--action: the video is 1 + --chunk-size frames; leave out --frames")
    if chunk is not None and (bound := bounds(GenerationRequest)["chunk_size"].problem("chunk_size", chunk)):
        problems.append(bound)
    return problems


def _print_job(directory: str, fc, size: dict) -> None:
    """The whole request, phase by phase, where the root is a pipeline with a Wan VAE
    (``fsdp_fp8.runtime.vae_forecast``)."""
    from fsdp_fp8.format.hub import resolve_hub_path
    from fsdp_fp8.runtime.vae_forecast import pipeline_job_forecast

    root = resolve_hub_path(directory)
    if not (root / "vae" / "config.json").is_file():
        return
    try:
        job = pipeline_job_forecast(root, fc, **size)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:  # diffusers refused the VAE's config
        print(f"VAE phases: not forecast: {root / 'vae' / 'config.json'}: {type(exc).__name__}: {exc}")
        return
    print("\n".join(job.lines()) if job else "VAE phases: not forecast (the VAE is no AutoencoderKLWan)")


def _verify(args: argparse.Namespace) -> int:
    """What ``load_model(None, DIR, device=...)`` would decide, without a process group or any
    tensor data: open, resolve the class ``config.json`` names, build it on meta, plan."""
    import torch

    from fsdp_fp8.collective import agreement_before_changes
    from fsdp_fp8.compose.model import plan_model
    from fsdp_fp8.format.files import file_sha256
    from fsdp_fp8.load.options import LoadOptions

    device = torch.device(args.device)
    try:  # no process group: the agreement is this process's own verdict, every problem at once
        with agreement_before_changes(f"cannot load {args.directory} onto {device.type}") as pending:
            planned = plan_model(None, args.directory, options=LoadOptions(device=device))
            pending.on_refusal(planned.release)
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        return 1
    ckpt, plan, arch = planned.checkpoint, planned.plan, planned.spec
    print(
        f"OK: {ckpt.directory} loads onto {device.type} as {arch.name} ({arch.kind}): "
        f"{plural(len(plan.fp8), 'FP8 linear')}\n    and {plural(len(plan.tensors), 'other tensor')} to load; "
        f"the checkpoint holds {plural(len(ckpt.tensors), 'tensor')} in {plural(len(ckpt.files), 'file')}"
    )
    if plan.kv_scales:
        print(
            f"note: {plural(len(plan.kv_scales), 'FP8 KV-cache scale')} have no place in {arch.name} and are not loaded"
        )
    if not plan.fp8:
        print(
            f"warning: {ckpt.directory} has no FP8 linear: load_model loads it, but every linear runs in high "
            "precision (a plain checkpoint, not a ModelOpt static-FP8 one)",
            file=sys.stderr,
        )
    if args.world_size:
        groups = shard_groups(args.world_size, args.replicas)
        if args.replicas > 1:
            print(f"{world_words(args.world_size, args.replicas)}: each shard's rows are read once per replica")

        def line(shard: int, ranks: list[int]) -> str:
            f = plan.forecast(len(groups), shard)
            return f"  {who(shard, ranks)} of {len(groups)}: reads {bytes_and_mib(f.read_bytes)}, holds {bytes_and_mib(f.held_bytes)}"

        print("\n".join(per_shard_lines(groups, line)))
    if args.sha256:
        for name, shard in ckpt.files.items():
            print(f"{file_sha256(shard.path)}  {name}")
    return NO_FP8_EXIT if args.require_fp8 and not plan.fp8 else 0


def _run(argv: list[str], prog: str) -> int:
    """``run``: the launcher. Parse and check every option first (no torch yet); with
    ``--nproc-per-node`` start the ranks (``fsdp_fp8.cli.spawn``), else run this rank
    (``fsdp_fp8.cli.runner``) and leave through ``shutdown_distributed`` (never returns), as
    torchrun's ranks must (docs/shutdown.md)."""
    from fsdp_fp8.cli.arguments import parse_run_args

    args = parse_run_args(argv, prog)
    if args.nproc_per_node is not None:
        from fsdp_fp8.cli.spawn import launch_ranks

        return launch_ranks(args.nproc_per_node, _without_nproc(argv))
    interrupts.install()
    quiet.quiet_third_party()
    try:  # torch's import takes seconds: torchrun may stop this rank meanwhile (a peer failed)
        from fsdp_fp8.cli.runner import execute
        from fsdp_fp8.runtime.shutdown import shutdown_distributed
    except interrupts.Interrupted as stop:  # no process group yet: one line, no traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    try:
        code = execute(args)
    except BaseException:
        shutdown_distributed(failed=True)  # abort, not destroy; keep the traceback and exit status
        raise
    interrupts.ignore()  # the outcome is printed: a signal now would only add a traceback
    shutdown_distributed(code)
    return code  # not reached


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc-per-node N`` (or ``=N``, or an abbreviation argparse took for it)."""
    out, skip = [], False
    for token in argv:
        flag = token.split("=", 1)[0]
        if skip:
            skip = False
        elif len(flag) > len("--npr") - 1 and "--nproc-per-node".startswith(flag):
            skip = "=" not in token
        else:
            out.append(token)
    return out


def _clean(args) -> int:
    """Remove the leftovers of dead saves next to DESTINATION; say what was removed and kept."""
    import os

    from fsdp_fp8.save.temp_dir import clean_leftovers

    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 cleans, once
        return 0
    target = Path(args.source)
    cleaning = clean_leftovers(target.absolute().parent)
    for line in cleaning.lines():
        print(line)
    if not cleaning.lines():
        print(f"nothing to clean next to {target}")
    return 1 if cleaning.failed else 0


def _save(args) -> int:
    """Load SOURCE (sharded under torchrun) and write it to DESTINATION; exit 0 on success."""
    if args.clean:
        return _clean(args)
    import torch.distributed as dist

    from fsdp_fp8.cli.runner import init_distributed
    from fsdp_fp8.collective import rank_and_world
    from fsdp_fp8.compose.model import load_model
    from fsdp_fp8.runtime.shutdown import shutdown_distributed
    from fsdp_fp8.save.destination import check_destination
    from fsdp_fp8.save.save_checkpoint import save_checkpoint

    init_distributed(args.timeout)  # a process group only under torchrun
    rank = rank_and_world()[0]
    code = 0
    try:
        check_destination(args.destination, args.timeout)  # before anything is loaded
        loaded = load_model(None, args.source, timeout_s=args.timeout)
        report = save_checkpoint(loaded, args.destination, max_shard_size=args.max_shard_size, timeout_s=args.timeout)
        if rank == 0:
            print(f"saved {report.directory}: {report.tensors} tensors in {report.files} files")
    except (ProblemsError, PeerLostError, OSError) as exc:
        # Agreed errors are the same on every rank: rank 0 prints them; others say who they are.
        if rank == 0 or not isinstance(exc, ProblemsError):
            print(f"error{'' if rank == 0 else f' (rank {rank})'}: {exc}", file=sys.stderr)
        code = 1
    if dist.is_initialized():
        shutdown_distributed(code)  # never returns
    return code


def build_parser(prog: str = "fsdp-fp8") -> argparse.ArgumentParser:
    parser = RankZeroParser(
        prog=prog,
        description="Load ModelOpt static-FP8 checkpoints into FSDP2-sharded PyTorch models, check them "
        f"and write them back. '{prog} COMMAND --help' lists a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=RankZeroParser)
    sub.add_parser(
        "run",
        add_help=False,
        help="load a checkpoint sharded over the ranks and sample (torchrun ... -m fsdp_fp8 run, or "
        "fsdp-fp8 run --nproc-per-node N); 'run --help' lists its options",
    )
    sub.add_parser(
        "serve",
        add_help=False,
        help="load a pipeline once over the ranks and serve it over HTTP, the OpenAI Videos API "
        "(torchrun ... -m fsdp_fp8 serve); 'serve --help' lists its options",
    )
    _add_inspect(sub.add_parser("inspect", help="summarise a checkpoint (reads headers and scales only)"))
    _add_verify(
        sub.add_parser(
            "verify",
            help="check the checkpoint as load_model does (open, build the model on "
            "meta, plan); exit 0 exactly when load_model would load it",
        )
    )
    _add_save(
        sub.add_parser(
            "save",
            help="load SOURCE (sharded under torchrun) and write it as a ModelOpt "
            "static-FP8 checkpoint in DESTINATION (absent or empty), gathering nothing",
        )
    )
    return parser


def _add_checkpoint_and_ranks(command: argparse.ArgumentParser, world_size_help: str) -> None:
    """The arguments ``inspect`` and ``verify`` share: the checkpoint, W ranks, R replica groups."""
    command.add_argument("directory", help="checkpoint directory, diffusers pipeline root or hub repo id")
    command.add_argument("--world-size", type=_world_size, default=None, metavar="W", help=world_size_help)
    command.add_argument("--replicas", type=_positive, default=1, help=REPLICAS_HELP)


def _cache_text(value: str) -> str:
    """``--cache`` checked as the launcher checks it (``format.cache_option``)."""
    problems = cache_option_problems(value)
    if problems:
        raise argparse.ArgumentTypeError("; ".join(problems))
    return value


def _add_inspect(inspect: argparse.ArgumentParser) -> None:
    _add_checkpoint_and_ranks(inspect, "also forecast what each of W ranks reads, holds and stages")
    inspect.add_argument(
        "--prefetch-bytes",
        type=_non_negative,
        default=ALL_ROWS,
        metavar="BYTES",
        help="with --world-size: the prefetch budget to forecast (default: every row a rank reads; 0: off)",
    )
    inspect.add_argument("--height", type=_positive, help="with --width / --frames: forecast per-GPU peak memory")
    inspect.add_argument("--width", type=_positive, help="pixels (forecast; default 1280)")
    inspect.add_argument("--frames", type=_positive, help="frames (forecast; default 1: an image)")
    # The run's own declarations of --resident and --resident-budget (one choice list, one help).
    run_options = {name: meta for name, _, meta in declared(RunSettings)}
    inspect.add_argument(
        "--resident",
        choices=RESIDENT_POLICIES,
        default="none",
        help=f"forecast: {run_options['resident'].help} (here no device reports its free memory)",
    )
    inspect.add_argument(
        "--resident-budget",
        type=byte_count,
        metavar="BYTES",
        help=f"forecast: {run_options['resident_budget'].help}; --resident auto needs it here",
    )
    inspect.add_argument("--offload", choices=("cpu",), help="forecast: FP8 shards in host memory")
    inspect.add_argument("--cfg-parallel", action="store_true", help="forecast: guidance passes on rank pairs")
    inspect.add_argument(
        "--cache",
        type=_cache_text,
        metavar="off|seacache[:THRESHOLD]",
        help="forecast: the steps a request computes with step caching, as the range its rules allow (with --steps)",
    )
    inspect.add_argument("--steps", type=_positive, default=35, help="with --cache: denoising steps (default 35)")
    # An action job's tokens: the run's own declarations (one choice list, one help); --height /
    # --width are then its first frame's
    add_option(inspect, "action", note="forecast (--height / --width: its first frame's size): ")
    for name in ("chunk_size", "resolution_tier"):
        add_option(inspect, name, note="forecast: ")
    inspect.add_argument(
        "--ulysses",
        "--sequence-parallel",
        type=_positive,
        default=1,
        metavar="N",
        help="forecast: each pass's generation tokens split over Ulysses groups of N ranks "
        "(--sequence-parallel: its older name; default 1)",
    )


def _add_verify(verify: argparse.ArgumentParser) -> None:
    _add_checkpoint_and_ranks(verify, "also show what each of W ranks would read and hold")
    verify.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="the device load_model would load onto (default: cuda when torch sees a GPU, "
        "else cpu); cuda adds the checks made before loading onto CUDA",
    )
    verify.add_argument("--sha256", action="store_true", help="also hash every shard file")
    verify.add_argument(
        "--require-fp8",
        action="store_true",
        help=f"exit {NO_FP8_EXIT} when the checkpoint has no FP8 linear (by default that is a warning: "
        "load_model loads it, in high precision)",
    )


def _add_save(save: argparse.ArgumentParser) -> None:
    save.add_argument("source", help="checkpoint directory, diffusers pipeline root or hub repo id")
    save.add_argument("destination", nargs="?")
    save.add_argument(
        "--clean",
        action="store_true",
        help="save --clean DESTINATION: only remove what saves that died left next to DESTINATION "
        "(their hidden temporary directories) and say what was removed; loads nothing",
    )
    save.add_argument(
        "--max-shard-size",
        type=_positive,
        default=None,
        metavar="BYTES",
        help="tensor bytes per shard file (default: one file)",
    )
    save.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")


REPLICAS_HELP = (
    "with --world-size: the forecast for HSDP over R replica groups of W/R ranks (launch/infer.py "
    "--replicas R), one line per shard with the ranks holding it"
)
NO_FP8_EXIT = 3  # verify --require-fp8 on a checkpoint without one FP8 linear (1: refused)


def main(argv: list[str] | None = None, prog: str = "fsdp-fp8") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # the launcher parses its own options
        return _run(argv[1:], prog if prog.endswith(".py") else f"{prog} run")
    if argv[:1] == ["serve"]:  # the server too (fsdp_fp8.cli.serving)
        from fsdp_fp8.cli.serving import main as serve_main

        return serve_main(argv[1:], f"{prog} serve")
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if getattr(args, "replicas", 1) > 1:
        if not args.world_size:
            parser.error(f"--replicas {args.replicas} needs --world-size")
        if args.world_size % args.replicas:
            parser.error(
                f"--replicas {args.replicas} does not divide --world-size {args.world_size}: HSDP needs every "
                "replica group to have the same number of ranks"
            )
    quiet.quiet_third_party()
    if args.command == "inspect":
        if args.resident == "auto" and args.resident_budget is None:
            parser.error("--resident auto needs --resident-budget BYTES here: inspect has no device to ask")
        if args.resident_budget is not None and args.resident != "auto":
            parser.error("--resident-budget applies to --resident auto; pass that too")
        if problems := _action_problems(args):
            parser.error("; ".join(problems))
        return _inspect(args)
    if args.command == "save":
        if args.clean and args.destination is not None:
            parser.error("save --clean takes one path: the DESTINATION whose leftovers to remove")
        if not args.clean and args.destination is None:
            parser.error("save needs SOURCE and DESTINATION")
        problems = timeout_problems(args.timeout)
        if not args.clean:  # before torch, as the launcher's --checkpoint
            problems += checkpoint_problems("SOURCE", args.source)[1]
        if problems:
            parser.error("; ".join(problems))
        return _save(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return _verify(args)


def console_main() -> int:
    """The ``fsdp-fp8`` console script."""
    return main()
