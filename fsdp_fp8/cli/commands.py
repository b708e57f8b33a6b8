"""``python -m fsdp_fp8 inspect|verify DIR``: look at a checkpoint without loading it."""

from __future__ import annotations

import argparse
import sys

from fsdp_fp8.format.files import file_sha256
from fsdp_fp8.format.checkpoint import Checkpoint, open_checkpoint
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.sharding import rank_forecast


def _mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.2f} MiB)"


def summary(ckpt: Checkpoint, world_size: int | None = None) -> str:
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
        from fsdp_fp8.format.slice_reader import STAGING_BYTES

        fp8 = [e for m in ckpt.fp8_modules.values() for e in (m.weight, m.weight_scale, m.input_scale)]
        other = [*ckpt.high_precision.values(), *ckpt.kv_scales.values()]
        lines.append(f"world size {world_size} (every tensor Shard(0), 0-d scales replicated; "
                     f"staging: largest single read into an accelerator, budget {_mib(STAGING_BYTES)}):")
        for rank in range(world_size):
            f = rank_forecast(fp8, other, world_size, rank, STAGING_BYTES)
            lines.append(f"  rank {rank}: reads {_mib(f.read_bytes)} (FP8 {_mib(f.fp8_bytes)}, high precision "
                         f"{_mib(f.high_precision_bytes)}), holds {_mib(f.held_bytes)} (padded), "
                         f"staging peak {_mib(f.staging_peak_bytes)}")
    return "\n".join(lines)


def _open(directory: str) -> Checkpoint | None:
    try:
        return open_checkpoint(directory)
    except (CheckpointError, OSError) as exc:
        print(exc, file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_fp8")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="summarise a checkpoint (reads headers and scales only)")
    inspect.add_argument("directory")
    inspect.add_argument("--world-size", type=int, default=None)
    verify = sub.add_parser("verify", help="check headers, index, configs and scales; exit 0 if loadable")
    verify.add_argument("directory")
    verify.add_argument("--sha256", action="store_true", help="also hash every shard file")
    args = parser.parse_args(argv)
    if args.command == "inspect" and args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be >= 1")
    ckpt = _open(args.directory)
    if ckpt is None:
        return 1
    if args.command == "inspect":
        print(summary(ckpt, args.world_size))
        return 0
    print(f"OK: {ckpt.directory}: {len(ckpt.tensors)} tensors in {len(ckpt.files)} files")
    if args.sha256:
        for name, shard in ckpt.files.items():
            print(f"{file_sha256(shard.path)}  {name}")
    return 0
