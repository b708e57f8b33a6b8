"""``inspect``'s report, and the per-rank forecast ``inspect`` and ``verify`` share, in a user's
words: what the checkpoint holds, its step policy's windows, and with ``--world-size W`` what
each rank reads, holds and stages.

A forecast lists every rank (every shard under HSDP) up to ``LISTED_SHARDS``; beyond, it shows the
first and the last with the bounds between: ``torch.chunk`` gives each rank at most as many rows
of every tensor as the rank before it, so shard 0 reads the most and the last shard the least,
and every rank holds the same padded bytes. ``--world-size`` stops at ``MAX_WORLD_SIZE``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp_fp8.cli.reports import hsdp_words, plural
from fsdp_fp8.format.cache_option import computed_steps_range
from fsdp_fp8.format.step_policy import describe_policy, parse_step_policy
from fsdp_fp8.reading.read_options import ALL_ROWS, DEFAULT_READ_OPTIONS, ReadOptions
from fsdp_fp8.shard_rows import shard_groups

if TYPE_CHECKING:
    from fsdp_fp8.format.checkpoint import Checkpoint

MAX_WORLD_SIZE = 65_536  # inspect / verify --world-size: the most ranks a forecast is made for
LISTED_SHARDS = 16  # shards listed one per line; beyond, the first, the last and the bounds between
WIDTH = 100  # a long value wraps under its own column, at spaces only: a path is never cut


def bytes_and_mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.2f} MiB)"


def who(shard: int, ranks: list[int]) -> str:
    """``rank 3``, or under HSDP ``shard 1 (ranks 1, 3)`` (many ranks: how many, the first two and the last)."""
    if len(ranks) == 1:
        return f"rank {shard}"
    if len(ranks) <= 4:
        return f"shard {shard} (ranks {', '.join(map(str, ranks))})"
    return f"shard {shard} ({len(ranks)} ranks: {ranks[0]}, {ranks[1]}, ..., {ranks[-1]})"


def world_words(world_size: int, replicas: int) -> str:
    if replicas == 1:
        return f"world size {world_size}"
    return f"world size {world_size}, {hsdp_words(replicas, world_size // replicas)}"


def per_shard_lines(groups: list[tuple[int, list[int]]], line: Callable[[int, list[int]], str]) -> list[str]:
    """``line(shard, ranks)`` for every shard, or for the first and the last with the ones between
    summarised (see the module's docstring)."""
    if len(groups) <= LISTED_SHARDS:
        return [line(shard, ranks) for shard, ranks in groups]
    between = len(groups) - 2
    return [
        line(*groups[0]) + "  (the most a rank reads)",
        f"  ... {plural(between, 'shard' if len(groups[1][1]) > 1 else 'rank')} between: each reads between "
        "these two and holds the same",
        line(*groups[-1]) + "  (the least)",
    ]


def _wrapped(lines: list[str], indent: str = "", subsequent: str = " " * 17) -> list[str]:
    return [
        w
        for line in lines
        for w in textwrap.wrap(
            line,
            width=WIDTH,
            initial_indent=indent,
            subsequent_indent=subsequent,
            break_on_hyphens=False,
            break_long_words=False,
        )
    ]


def policy_words(raw: dict | None) -> str:
    """The checkpoint's step policy in a user's words, or that it has none."""
    if raw is None:
        return "none (every denoising step W8A8)"
    try:
        return describe_policy(parse_step_policy(raw))
    except ValueError as exc:  # open_checkpoint validated it; kept for a policy read another way
        return f"present but invalid: {exc}"


def cache_line(raw_policy: dict | None, steps: int, cache: str) -> str:
    """The steps a request computes with ``cache`` over ``steps`` under the checkpoint's step policy:
    the fewest diffusers' SeaCache rules (its defaults) and the precision rule allow, to every step."""
    from diffusers.hooks.sea_cache import SeaCacheConfig

    rules = SeaCacheConfig()
    policy = parse_step_policy(raw_policy) if raw_policy is not None else None
    precisions = [policy.precision(i, steps) if policy is not None else "native" for i in range(steps)]
    fewest, most = computed_steps_range(
        precisions, rules.retention_steps, rules.cache_end_steps, rules.max_consecutive_cached
    )
    return (
        f"step cache:      {cache}: {fewest}..{most} of {steps} steps computed, {2 * fewest}..{2 * most} "
        "transformer passes per video with guidance (the fewest the rules allow .. every step; the "
        "indicator decides where a request lands)"
    )


def summary(
    ckpt: Checkpoint, world_size: int | None = None, replicas: int = 1, options: ReadOptions = DEFAULT_READ_OPTIONS
) -> str:
    """``inspect``'s report: the checkpoint's make-up, and with ``world_size`` each rank's share."""
    q = ckpt.quant
    fp8_weights = sum(m.weight.nbytes for m in ckpt.fp8_modules.values())
    scales = sum(m.weight_scale.nbytes + m.input_scale.nbytes for m in ckpt.fp8_modules.values())
    high = sum(e.nbytes for e in ckpt.high_precision.values())
    lines = [
        f"format:          {'ModelOpt static FP8' if q.is_modelopt_fp8 else 'plain (no quantization config)'}"
        + (f" via {', '.join(q.spellings)}" if q.spellings else ""),
        f"producer:        {q.producer or 'unknown'}",
        f"files:           {len(ckpt.files)} ({ckpt.index_file or 'a single file'}), "
        f"{bytes_and_mib(sum(f.size for f in ckpt.files.values()))}",
        f"FP8 linears:     {len(ckpt.fp8_modules)}"
        + (f", weights {bytes_and_mib(fp8_weights)}, scales {scales:,} bytes" if ckpt.fp8_modules else ""),
        f"high precision:  {plural(len(ckpt.high_precision), 'tensor')}, {bytes_and_mib(high)}",
        f"ignore list:     {', '.join(q.ignore) or '(none)'}",
        f"KV cache:        {q.kv_cache_quant_algo or 'not quantized'}"
        + (f" ({plural(len(ckpt.kv_scales), 'k/v scale')})" if ckpt.kv_scales else ""),
        f"step policy:     {policy_words(q.step_policy)}",
    ]
    lines = [f"checkpoint:      {ckpt.directory}", *_wrapped(lines)]
    if world_size:
        lines += _forecast_lines(ckpt, world_size, replicas, options)
    return "\n".join(lines)


def _forecast_lines(ckpt: Checkpoint, world_size: int, replicas: int, options: ReadOptions) -> list[str]:
    """``inspect --world-size``: how the ranks share the tensors, then each rank's (or shard's) bytes."""
    from fsdp_fp8.reading.prefetch import prefetch_budget
    from fsdp_fp8.reading.rank_bytes import entry_rank_bytes, rank_forecast

    fp8 = [e for m in ckpt.fp8_modules.values() for e in (m.weight, m.weight_scale, m.input_scale)]
    other = [*ckpt.high_precision.values(), *ckpt.kv_scales.values()]
    read = [m.weight for m in ckpt.fp8_modules.values()] + list(ckpt.high_precision.values())
    groups = shard_groups(world_size, replicas)
    prefetch = prefetch_budget(options.prefetch_bytes)
    most = sum(entry_rank_bytes(e, len(groups), 0) for e in read)  # shard 0 reads the most (torch.chunk)
    lines = _wrapped(
        [
            "sharding: every tensor Shard(0) (rows split like torch.chunk), 0-d scales replicated",
            "staging ring: host buffers that reads into an accelerator go through, budget "
            + bytes_and_mib(options.staging_bytes),
            _bounce_words(ckpt, options, most),
            "prefetch: page-cache hints during the set-up, " + _prefetch_words(options.prefetch_bytes, prefetch, most),
        ],
        indent="  ",
        subsequent="    ",
    )

    def line(shard: int, ranks: list[int]) -> str:
        f = rank_forecast(fp8, other, len(groups), shard, options.staging_bytes, staged_entries=read)
        reads = sum(entry_rank_bytes(e, len(groups), shard) for e in read)
        return (
            f"  {who(shard, ranks)}: reads {bytes_and_mib(f.read_bytes)} (FP8 {bytes_and_mib(f.fp8_bytes)}, high "
            f"precision {bytes_and_mib(f.high_precision_bytes)}), holds {bytes_and_mib(f.held_bytes)} (padded), "
            f"staging ring {bytes_and_mib(f.staging_peak_bytes)}, prefetch {bytes_and_mib(min(prefetch, reads))}"
        )

    return [f"{world_words(world_size, replicas)}:", *lines, *per_shard_lines(groups, line)]


def _bounce_words(ckpt: Checkpoint, options: ReadOptions, most: int) -> str:
    """The O_DIRECT bounce buffers a load into host memory holds at most per rank (``most``: the
    most a rank reads); a load into an accelerator reads into its staging ring instead."""
    from fsdp_fp8.reading.read_choice import bounce_forecast

    buffers, each = bounce_forecast(options, list(ckpt.handles.values()), most)
    return (
        f"O_DIRECT bounce: a load into host memory that reads past the page cache holds at most {buffers} x "
        f"{bytes_and_mib(each)} = {bytes_and_mib(buffers * each)} per rank (reader threads x the largest "
        "request, at most what a rank reads; the device the files are on picks both unless ReadOptions fixes them)"
    )


def _prefetch_words(budget: int, capped: int, most: int) -> str:
    """What the prefetch hints at most per rank: never more than a rank reads."""
    if budget == 0:
        return "off (budget 0)"
    hinted = min(capped, most)
    if hinted == most:
        why = "every row it reads" if budget >= ALL_ROWS else f"all it reads, within the budget {bytes_and_mib(budget)}"
    elif capped < budget:
        why = "a per-rank share of half the available memory here"
    else:
        why = "the budget"
    return f"at most {bytes_and_mib(hinted)} per rank ({why})"
