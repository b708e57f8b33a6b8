"""Ranks agree before anyone mutates, and on the outcome after the reads: all raise or none does.

What the ranks agree on. Each rank validates the checkpoint and the plan on its own; if ranks
saw different files (a shard or config rewritten on one node, a shared filesystem serving
different bytes), built different models, or one rank found a problem, going on would end
in an abort inside the first FSDP collective or in silently different weights. So each rank
describes what it will load as *facts*, grouped by component: every config file and the index
(each value by its dotted key), every shard header (each tensor's dtype, shape and byte range),
the validated scale values, the plan, the model's structure (names, shapes, dtypes) and where
it goes (device type, mesh). One exchange carries each rank's problems and a SHA-256 per
component; only when digests differ does a second exchange carry those components' facts, so
every rank can name the same differing keys and values. Every rank then raises the same
``CheckpointError`` (each distinct problem once, with the ranks that found it: ``all 4 ranks:
...``, ``rank 1: ...``).

Where and how long. The exchanges run on a gloo side group, created once per default process
group, never on the default group itself: with NCCL, torchrun's async error handling makes
the watchdog kill a process whose collective waits too long, instead of letting it raise. The
side group has its own timeout (``timeout_s``); each rank marks its arrival in the default
store first, so a rank that gives up names the ranks that never arrived, and a rank arriving
after a peer gave up raises at once instead of waiting a whole timeout. Any failure of the
exchange is a ``PeerLostError`` naming the ranks, the stage and the timeout.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from datetime import timedelta

import torch.distributed as dist

from fsdp_fp8.errors import CheckpointError, PeerLostError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # the wait for a peer before anything is read (opening, planning)
# Sizes the wait for the outcome of the reads: the slowest rank reads its forecast bytes at
# no less than this (slow network storage), on top of the base timeout.
ASSUMED_READ_BYTES_PER_S = 50e6
# Sizes the wait for the outcome of a save's writes: every rank may write into one shared
# filesystem at once (and syncs), so the whole save's bytes at no less than this, in all.
ASSUMED_WRITE_BYTES_PER_S = 50e6
MAX_NAMED_DIFFERENCES = 5  # per component, in the error; the count of the rest follows

_side: dict = {}  # "group", "world" (the default group it belongs to), "sequence", "created"
_created = [0]  # side groups this process created: the same count on every rank


def ranks_label(ranks: list[int], world_size: int) -> str:
    """``all 4 ranks``, ``ranks 0, 2`` or ``rank 1``."""
    ranks = sorted(set(ranks))
    if world_size > 1 and len(ranks) == world_size:
        return f"all {world_size} ranks"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def merge_rank_problems(found: list[tuple[int, str]], world_size: int) -> list[str]:
    """One line per distinct problem, saying which ranks found it: a problem every rank
    has is one problem, not ``world_size`` of them."""
    by_problem: dict[str, list[int]] = {}
    for rank, problem in found:
        by_problem.setdefault(problem, []).append(rank)
    return [f"{ranks_label(ranks, world_size)}: {problem}" for problem, ranks in by_problem.items()]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def outcome_timeout_s(plan, world_size: int, base_s: float) -> float:
    """``base_s`` plus the time the slowest rank needs for its forecast bytes at
    ``ASSUMED_READ_BYTES_PER_S``: a rank behind on slow storage is not mistaken for a hung one."""
    slowest = max(plan.rank_bytes(world_size, rank) for rank in range(world_size))
    return base_s + slowest / ASSUMED_READ_BYTES_PER_S


# --- the side group ---------------------------------------------------------------------------


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - without a store the error cannot name the late rank
        return None


def side_group(timeout_s: float, context: str = ""):
    """The gloo group the agreements run on (collective the first time, like ``new_group``:
    a peer that does not come within ``timeout_s`` is a ``PeerLostError``)."""
    world = dist.group.WORLD
    if _side.get("world") is not world:
        _side.clear()
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as exc:
            context = f"{context}: " if context else ""
            raise PeerLostError(
                f"{context}rank {dist.get_rank()} could not set up the agreement group with the "
                f"other ranks within {timeout_s:g} s (the agreement timeout; a peer is late, "
                f"died or failed); nothing was changed: {type(exc).__name__}: {exc}"
            ) from exc
        _created[0] += 1
        _side.update(group=group, world=world, sequence=itertools.count(), created=_created[0])
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:  # present in every torch this package supports (>= 2.10)
        set_timeout(timedelta(seconds=timeout_s), _side["group"])
    return _side["group"]


def _check(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


def exchange(obj, *, timeout_s: float, stage: str, context: str, before_changes: bool = False) -> list:
    """Every rank's ``obj``, in rank order, through the side group; or a ``PeerLostError``
    (``before_changes``: it says that nothing was changed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    context = f"{context}: " if context else ""
    nothing = "nothing was changed; " if before_changes else ""
    group = side_group(timeout_s, context.rstrip(": "))
    # The group's name is the same on every rank and new for every group: markers of an
    # earlier group (the store outlives it) are never mistaken for this one's.
    prefix = f"fsdp_fp8/agreement/{getattr(group, 'group_name', '')}/{_side['created']}/{next(_side['sequence'])}"
    store = _store()
    if store is not None:
        try:
            store.set(f"{prefix}/arrived/{rank}", "1")
        except Exception:  # noqa: BLE001 - the exchange itself will tell
            store = None
    gave_up = [r for r in range(world) if r != rank and store is not None and _check(store, f"{prefix}/gave_up/{r}")]
    if gave_up:
        _side.clear()
        raise PeerLostError(
            f"{context}rank {rank} arrived at the {stage} after rank(s) {gave_up} had given up "
            f"waiting for it (agreement timeout {timeout_s:g} s); {nothing}stopping here"
        )
    out: list = [None] * world
    t0 = time.monotonic()
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:  # a peer died, failed, or did not arrive within the timeout
        _side.clear()  # a group left mid-collective is not reused
        waited = time.monotonic() - t0
        missing = []
        if store is not None:
            _quiet(store.set, f"{prefix}/gave_up/{rank}", "1")
            missing = [r for r in range(world) if not _check(store, f"{prefix}/arrived/{r}")]
        if missing and waited >= 0.9 * timeout_s:
            who = f"rank(s) {missing} did not arrive within {timeout_s:g} s (the agreement timeout)"
        elif missing:
            who = f"rank(s) {missing} left before arriving (died or failed) after {waited:.1f} s"
        else:
            who = f"a peer died or failed during it after {waited:.1f} s (agreement timeout {timeout_s:g} s)"
        raise PeerLostError(
            f"{context}rank {rank} could not complete the {stage} with the other ranks: {who}; "
            f"{nothing}{type(exc).__name__}: {exc}"
        ) from exc
    return out


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


# --- the facts ---------------------------------------------------------------------------------


def _flatten(obj, prefix: str, out: dict[str, str]) -> None:
    stack = [(obj, prefix)]
    while stack:
        node, where = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        empty = True
        for key, value in items:
            empty = False
            path = f"{where}.{key}" if where else str(key)
            if isinstance(value, (dict, list)):
                stack.append((value, path))
            else:
                out[path] = json.dumps(value)
        if empty:
            out[where] = json.dumps(node)


def checkpoint_facts(checkpoint) -> dict[str, dict[str, str]]:
    """What a rank read from disk: configs and index by key, headers by tensor, scale values."""
    facts: dict[str, dict[str, str]] = {}
    for name, obj in checkpoint.json_files.items():
        _flatten(obj, "", facts.setdefault(name, {}))
    for name, shard in checkpoint.files.items():
        facts[name] = {"(size)": str(shard.size), "(header sha256)": shard.header_sha256}
    for key, e in checkpoint.tensors.items():
        facts.setdefault(e.file, {})[key] = f"{e.dtype} {list(e.shape)} bytes [{e.begin}, {e.end})"
    facts["scale values"] = {key: repr(value) for key, value in checkpoint.scales.items()}
    return facts


def plan_facts(plan) -> dict[str, str]:
    facts = {
        f"fp8 {t.module}": f"{t.entry.weight.key} ({t.out_features}, {t.in_features}) {t.compute_dtype}"
        for t in plan.fp8
    }
    facts.update({f"tensor {t.name}": t.entry.key for t in plan.tensors})
    for what in ("missing", "unexpected", "skipped", "kv_scales"):
        facts.update({f"{what} {key}": "yes" for key in getattr(plan, what)})
    return facts


def model_facts(model, device, mesh) -> dict[str, dict[str, str]]:
    """The model's structure and where it goes: two ranks must build the very same thing."""
    structure = {f"module {name or '(root)'}": type(m).__name__ for name, m in model.named_modules()}
    structure.update({f"parameter {n}": f"{tuple(p.shape)} {p.dtype}" for n, p in model.named_parameters()})
    structure.update({f"buffer {n}": f"{tuple(b.shape)} {b.dtype}" for n, b in model.named_buffers()})
    placement = {"device type": device.type, "mesh": "every rank (1-D)", "placements": "(Shard(0),)"}
    if mesh is not None:  # HSDP: FSDP2 replicates over the first dim and shards over the last
        placement["mesh"] = f"{mesh.mesh.tolist()} dims {mesh.mesh_dim_names}"
        placement["placements"] = "(Replicate(), Shard(0))" if mesh.ndim == 2 else "(Shard(0),)"
    return {"model structure": structure, "placement": placement}


def _digest(items: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(items.items())).encode()).hexdigest()


def _differences(component: str, by_rank: list[dict[str, str] | None], world: int) -> list[str]:
    keys = sorted(set().union(*(d for d in by_rank if d is not None)))
    found = []
    for key in keys:
        values = [None if d is None else d.get(key) for d in by_rank]
        if len(set(values)) == 1:
            continue
        groups: dict = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        said = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {'(absent)' if v is None else v}"
            for v, r in groups.items()
        )
        found.append(f"`{key}` differs: {said}")
    shown = found[:MAX_NAMED_DIFFERENCES]
    more = f" (and {len(found) - len(shown)} more)" if len(found) > len(shown) else ""
    if not found:  # the same items, differently ordered or typed: still not the same input
        return [f"ranks disagree on {component}: the digests differ"]
    return [f"ranks disagree on {component}{more}: {d}" for d in shown]


def agree_or_raise(
    problems: list[str], facts: dict[str, dict[str, str]] | None, context: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Collective when a process group is up; raises the union of all ranks' problems and every
    disagreement between the ranks' facts, the same ``CheckpointError`` on every rank."""
    if not distributed():
        if problems:
            raise CheckpointError(problems, context)
        return
    world = dist.get_world_size()
    digests = None if facts is None else {c: _digest(items) for c, items in facts.items()}
    verdicts = exchange(
        (dist.get_rank(), sorted(problems), digests),
        timeout_s=timeout_s,
        stage="agreement before loading",
        context=context,
        before_changes=True,
    )
    merged = merge_rank_problems([(rank, p) for rank, rank_problems, _ in verdicts for p in rank_problems], world)
    compared = [d for _, _, d in verdicts if d is not None]
    components = sorted(set().union(*compared)) if compared else []
    differ = [
        c
        for c in components
        if len({d.get(c) for _, _, d in verdicts if d is not None}) > 1
        or any(d is not None and c not in d for _, _, d in verdicts)
    ]
    if differ:  # every rank computed the same list, so every rank takes part
        mine = None if facts is None else {c: facts.get(c) for c in differ}
        details = exchange(
            mine, timeout_s=timeout_s, stage="comparison of what the ranks read", context=context, before_changes=True
        )
        for c in differ:
            merged += _differences(c, [None if d is None else d.get(c) for d in details], world)
    if merged:
        raise CheckpointError(merged, context)
