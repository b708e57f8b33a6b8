"""``fsdp-fp8`` / ``python -m fsdp_fp8``: ``run`` (the launcher), ``inspect``, ``verify`` and ``save``.

``inspect`` and ``verify`` look at a checkpoint without loading it: ``inspect`` summarises
headers and scales; ``verify`` decides as ``load_model`` would (docs/usage.md). ``save``
loads a checkpoint (sharded under torchrun) and writes it back with ``save_checkpoint``.
"""

from __future__ import annotations

import argparse
import sys

from fsdp_fp8.errors import CheckpointError, PeerLostError, ProblemsError
from fsdp_fp8.format.checkpoint import Checkpoint, open_checkpoint
from fsdp_fp8.format.files import file_sha256
from fsdp_fp8.format.sharding import entry_rank_bytes, rank_forecast


def _mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.2f} MiB)"


def shard_groups(world_size: int, replicas: int = 1) -> list[tuple[int, list[int]]]:
    """(shard coordinate, the global ranks holding it) of the mesh ``load_model`` shards over:
    ``(replicas, world_size // replicas)``, row-major as ``init_device_mesh`` lays it out."""
    shards = world_size // replicas
    return [(s, [r * shards + s for r in range(replicas)]) for s in range(shards)]


def _who(shard: int, ranks: list[int]) -> str:
    return f"rank {shard}" if len(ranks) == 1 else f"shard {shard} (ranks {', '.join(map(str, ranks))})"


def _mesh_words(world_size: int, replicas: int) -> str:
    if replicas == 1:
        return f"world size {world_size}"
    return f"world size {world_size}, HSDP {replicas} x {world_size // replicas} (replicate x shard)"


def summary(ckpt: Checkpoint, world_size: int | None = None, replicas: int = 1) -> str:
    q = ckpt.quant
    fp8_weights = sum(m.weight.nbytes for m in ckpt.fp8_modules.values())
    scales = sum(m.weight_scale.nbytes + m.input_scale.nbytes for m in ckpt.fp8_modules.values())
    high = sum(e.nbytes for e in ckpt.high_precision.values())
    lines = [
        f"checkpoint:      {ckpt.directory}",
        f"format:          {'ModelOpt static FP8' if q.is_modelopt_fp8 else 'plain (no quantization config)'}"
        + (f" via {', '.join(q.spellings)}" if q.spellings else ""),
        f"producer:        {q.producer or 'unknown'}",
        f"files:           {len(ckpt.files)} ({ckpt.index_file or 'single file'}), "
        f"{_mib(sum(f.size for f in ckpt.files.values()))}",
        f"FP8 linears:     {len(ckpt.fp8_modules)}, weights {_mib(fp8_weights)}, scales {scales} bytes",
        f"high precision:  {len(ckpt.high_precision)} tensors, {_mib(high)}",
        f"ignore list:     {', '.join(q.ignore) or '(none)'}",
        f"KV cache:        {q.kv_cache_quant_algo or 'not quantized'}"
        + (f" ({len(ckpt.kv_scales)} k/v scales)" if ckpt.kv_scales else ""),
        f"step policy:     {'present' if q.step_policy is not None else 'absent'}",
    ]
    if world_size:
        from fsdp_fp8.format import read_schedule
        from fsdp_fp8.format.slice_reader import STAGING_BYTES

        fp8 = [e for m in ckpt.fp8_modules.values() for e in (m.weight, m.weight_scale, m.input_scale)]
        other = [*ckpt.high_precision.values(), *ckpt.kv_scales.values()]
        read = [m.weight for m in ckpt.fp8_modules.values()] + list(ckpt.high_precision.values())
        prefetch = read_schedule.prefetch_budget()
        lines.append(
            f"{_mesh_words(world_size, replicas)} (every tensor Shard(0), 0-d scales replicated; "
            f"staging ring: host buffers reads into an accelerator go through, budget {_mib(STAGING_BYTES)}; "
            f"prefetch: page-cache hints during the set-up, budget {_prefetch_budget(read_schedule.PREFETCH_BYTES)}"
            f"{'' if prefetch == read_schedule.PREFETCH_BYTES else f', {_mib(prefetch)} here (a per-rank share of half the available memory)'}):"
        )
        groups = shard_groups(world_size, replicas)
        for shard, ranks in groups:
            f = rank_forecast(fp8, other, len(groups), shard, STAGING_BYTES, staged_entries=read)
            reads = sum(entry_rank_bytes(e, len(groups), shard) for e in read)
            lines.append(
                f"  {_who(shard, ranks)}: reads {_mib(f.read_bytes)} (FP8 {_mib(f.fp8_bytes)}, high precision "
                f"{_mib(f.high_precision_bytes)}), holds {_mib(f.held_bytes)} (padded), "
                f"staging ring {_mib(f.staging_peak_bytes)}, prefetch {_mib(min(prefetch, reads))}"
            )
    return "\n".join(lines)


def _prefetch_budget(budget: int) -> str:
    from fsdp_fp8.format import read_schedule

    return "every row a rank reads" if budget >= read_schedule.ALL_ROWS else _mib(budget)


def _open(directory: str) -> Checkpoint | None:
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


def _inspect(args: argparse.Namespace) -> int:
    ckpt = _open(args.directory)
    if ckpt is None:
        return 1
    print(summary(ckpt, args.world_size, args.replicas))
    if args.height or args.width or args.frames:  # the per-GPU memory forecast (fsdp_fp8.runtime.forecast)
        from fsdp_fp8.runtime.forecast import forecast_checkpoint

        size = {"height": args.height or 720, "width": args.width or 1280, "frames": args.frames or 1}
        try:
            fc = forecast_checkpoint(
                args.directory,
                args.world_size or 1,
                **size,
                resident=args.resident,
                offload=args.offload,
                cfg_parallel=args.cfg_parallel,
            )
        except ValueError as exc:
            print(f"error: {exc}")
            return 1
        print("\n".join(fc.lines()))
    return 0


def _verify(args: argparse.Namespace) -> int:
    """What ``load_model(None, DIR, device=...)`` would decide, without a process group or any
    tensor data: open, resolve the class ``config.json`` names, build it on meta, plan."""
    import torch

    from fsdp_fp8.load.api import plan_model_load

    device = torch.device(args.device)
    planned = plan_model_load(None, args.directory, device=device)
    if planned.problems:
        print(CheckpointError(planned.problems, f"cannot load {args.directory} onto {device.type}"), file=sys.stderr)
        return 1
    ckpt, plan, arch = planned.checkpoint, planned.plan, planned.architecture
    print(
        f"OK: {ckpt.directory} loads onto {device.type} as {arch.name} ({arch.kind}): "
        f"{len(plan.fp8)} FP8 linears, {len(plan.tensors)} other tensors, "
        f"{len(ckpt.tensors)} tensors in {len(ckpt.files)} files"
    )
    if plan.kv_scales:
        print(f"note: {len(plan.kv_scales)} FP8 KV-cache scales have no place in {arch.name} and are not loaded")
    if args.world_size:
        groups = shard_groups(args.world_size, args.replicas)
        if args.replicas > 1:
            print(f"{_mesh_words(args.world_size, args.replicas)}: each shard's rows are read once per replica")
        for shard, ranks in groups:
            f = plan.forecast(len(groups), shard)
            print(f"  {_who(shard, ranks)} of {len(groups)}: reads {_mib(f.read_bytes)}, holds {_mib(f.held_bytes)}")
    if args.sha256:
        for name, shard in ckpt.files.items():
            print(f"{file_sha256(shard.path)}  {name}")
    return 0


def _run(argv: list[str], prog: str) -> int:
    """``run``: the launcher (``fsdp_fp8.cli.runner``); leaves through ``shutdown_distributed``
    (never returns), as torchrun's ranks must (docs/shutdown.md)."""
    from fsdp_fp8.cli.runner import main as run_main
    from fsdp_fp8.cli.shutdown import shutdown_distributed

    try:
        code = run_main(argv, prog)
    except BaseException:
        shutdown_distributed(failed=True)  # abort, not destroy; keep the traceback and exit status
        raise
    shutdown_distributed(code)
    return code  # not reached


def _save(args) -> int:
    """Load SOURCE (sharded under torchrun) and write it to DESTINATION; exit 0 on success."""
    import torch.distributed as dist

    from fsdp_fp8.cli.runner import init_distributed
    from fsdp_fp8.cli.shutdown import shutdown_distributed
    from fsdp_fp8.load.api import default_device, load_model
    from fsdp_fp8.load.save import save_checkpoint

    init_distributed(args.timeout)  # a process group only under torchrun
    rank = dist.get_rank() if dist.is_initialized() else 0
    code = 0
    try:
        loaded = load_model(None, args.source, device=default_device())
        report = save_checkpoint(loaded, args.destination, max_shard_size=args.max_shard_size)
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
    parser = argparse.ArgumentParser(
        prog=prog, description="Load ModelOpt static-FP8 checkpoints into FSDP2-sharded models (docs/usage.md)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "run",
        add_help=False,
        help="load a checkpoint sharded over the ranks and sample (torchrun ... -m fsdp_fp8 run); "
        "'run --help' lists its options",
    )
    inspect = sub.add_parser("inspect", help="summarise a checkpoint (reads headers and scales only)")
    inspect.add_argument("directory", help="checkpoint directory, diffusers pipeline root or hub repo id")
    inspect.add_argument(
        "--world-size", type=_positive, default=None, help="also forecast what each of W ranks reads, holds and stages"
    )
    inspect.add_argument("--replicas", type=_positive, default=1, help=REPLICAS_HELP)
    inspect.add_argument("--height", type=_positive, help="with --width / --frames: forecast per-GPU peak memory")
    inspect.add_argument("--width", type=_positive, help="pixels (forecast; default 1280)")
    inspect.add_argument("--frames", type=_positive, help="frames (forecast; default 1: an image)")
    inspect.add_argument("--resident", choices=("none", "all"), default="none", help="forecast: layers kept gathered")
    inspect.add_argument("--offload", choices=("cpu",), help="forecast: FP8 shards in host memory")
    inspect.add_argument("--cfg-parallel", action="store_true", help="forecast: guidance passes on rank pairs")
    verify = sub.add_parser(
        "verify",
        help="check the checkpoint as load_model does (open, build the model on "
        "meta, plan); exit 0 exactly when load_model would load it",
    )
    verify.add_argument("directory", help="checkpoint directory, diffusers pipeline root or hub repo id")
    verify.add_argument(
        "--world-size", type=_positive, default=None, help="also show what each of W ranks would read and hold"
    )
    verify.add_argument("--replicas", type=_positive, default=1, help=REPLICAS_HELP)
    verify.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="the device load_model would load onto (default: cuda when torch sees a GPU, "
        "else cpu); cuda adds the checks made before loading onto CUDA",
    )
    verify.add_argument("--sha256", action="store_true", help="also hash every shard file")
    save = sub.add_parser(
        "save",
        help="load SOURCE (sharded under torchrun) and write it as a ModelOpt "
        "static-FP8 checkpoint in DESTINATION (absent or empty), gathering nothing",
    )
    save.add_argument("source", help="checkpoint directory, diffusers pipeline root or hub repo id")
    save.add_argument("destination")
    save.add_argument(
        "--max-shard-size",
        type=_positive,
        default=None,
        metavar="BYTES",
        help="tensor bytes per shard file (default: one file)",
    )
    save.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    return parser


REPLICAS_HELP = (
    "with --world-size: the forecast for HSDP over R replica groups of W/R ranks (launch/infer.py "
    "--replicas R), one line per shard with the ranks holding it"
)


def main(argv: list[str] | None = None, prog: str = "fsdp-fp8") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # the launcher parses its own options
        return _run(argv[1:], prog if prog.endswith(".py") else f"{prog} run")
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
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "save":
        return _save(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return _verify(args)


def console_main() -> int:
    """The ``fsdp-fp8`` console script."""
    return main()
