"""Action-conditioned jobs (Cosmos 3 world models): the raw action file and the checks made before
a load.

``--action forward_dynamics`` rolls the first frame (``--image``) forward under a sequence of raw
action vectors (``--actions FILE``: ``[T, raw_dim]``) of one embodiment (``--domain``);
``policy`` rolls out the video and predicts the actions; ``inverse_dynamics`` infers the actions
between a clip's frames (``--video``); all through diffusers'
``Cosmos3OmniPipeline.__call__(action=CosmosActionCondition(...))``. The file is
``.npy`` (a 2-D numeric array), ``.json`` (a list of equal-length lists of numbers) or ``.csv``
(one action per line, comma-separated numbers, no header). An empty, ragged or non-numeric file,
NaN or infinity, or a width other than the domain's is refused before the load, in one line.

No torch here (numpy only): the launcher checks its options before torch loads. The embodiment
table is diffusers' own, read when an action job is asked for.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from fsdp_fp8.errors import ArgumentError

ACTION_MODES = ("forward_dynamics", "inverse_dynamics", "policy")  # CosmosActionCondition's modes
PREDICTS = ("inverse_dynamics", "policy")  # the modes whose actions the model predicts
RESOLUTION_TIERS = (256, 480, 704, 720)  # diffusers' _ACTION_RESOLUTION_BINS (a test holds them equal)
ACTION_SUFFIXES = (".npy", ".json", ".csv")
MAX_ACTIONS = 100_000  # rows: a bound on what one request reads
ACTIONS_CONTEXT = "cannot read the raw actions"


def _rows_of(path: Path) -> list:
    """The file's rows as Python lists (numbers unchecked); an ``ArgumentError`` naming what is wrong."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        import numpy as np

        array = np.load(path, allow_pickle=False)  # never a pickle
        if array.ndim != 2:
            raise ArgumentError(f"holds a {array.ndim}-D array of shape {tuple(array.shape)}; actions are [T, D]")
        if not np.issubdtype(array.dtype, np.number) or np.issubdtype(array.dtype, np.complexfloating):
            raise ArgumentError(f"holds {array.dtype} values, not real numbers")
        return array.astype("float64").tolist()
    if suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise ArgumentError("is not a JSON list of lists of numbers ([[a, b, ...], ...])")
        return rows
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            return [[_number(cell) for cell in row] for row in csv.reader(handle) if row]
    raise ArgumentError(f"has the suffix {path.suffix!r}; actions are read from {', '.join(ACTION_SUFFIXES)}")


def _number(cell: str):
    try:
        return float(cell)
    except ValueError:
        return cell.strip()  # a text cell: refused below as not a number


def read_actions(path: str | Path) -> list[list[float]]:
    """The raw actions of ``path`` as ``T`` rows of ``D`` floats; an ``ArgumentError`` with one
    problem naming the file and what is wrong (empty, ragged, not numbers, NaN or infinity)."""
    path = Path(path)
    try:
        rows = _rows_of(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ArgumentError(f"--actions {path}: cannot be read: {exc}", ACTIONS_CONTEXT) from None
    except ArgumentError as exc:  # what _rows_of found
        raise ArgumentError(f"--actions {path} {exc.problems[0]}", ACTIONS_CONTEXT) from None
    except ValueError as exc:  # numpy's or json's own (a pickle refused, bad JSON)
        raise ArgumentError(f"--actions {path} {exc}", ACTIONS_CONTEXT) from None
    if not rows or not rows[0]:
        raise ArgumentError(f"--actions {path} holds no actions (an empty file, or empty rows)", ACTIONS_CONTEXT)
    if len(rows) > MAX_ACTIONS:
        raise ArgumentError(f"--actions {path} holds {len(rows)} actions; at most {MAX_ACTIONS}", ACTIONS_CONTEXT)
    widths = sorted({len(r) for r in rows})
    if len(widths) > 1:
        first = next(i for i, r in enumerate(rows) if len(r) != len(rows[0]))
        raise ArgumentError(
            f"--actions {path} is ragged: rows of {', '.join(map(str, widths))} values (row {first} has "
            f"{len(rows[first])}, row 0 has {len(rows[0])})",
            ACTIONS_CONTEXT,
        )
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ArgumentError(f"--actions {path}: row {i} value {j} is {value!r}, not a number", ACTIONS_CONTEXT)
            if not math.isfinite(value):
                raise ArgumentError(
                    f"--actions {path}: row {i} value {j} is {value}; actions must be finite", ACTIONS_CONTEXT
                )
    return [[float(v) for v in row] for row in rows]


def domain_widths() -> dict[str, int]:
    """diffusers' embodiment domains that take actions, each with its raw action width."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_RAW_ACTION_DIM

    return dict(_EMBODIMENT_TO_RAW_ACTION_DIM)


def action_problems(values, transformer: dict | None, where: str) -> list[str]:
    """What an action job of ``values`` cannot do, before the load: the options it needs (a
    domain, a chunk size, actions, a first frame), sizes it sets itself, a domain diffusers does
    not know, the file, a width other than the domain's or above the transformer's ``action_dim``
    (``transformer``: its config, ``where`` names it; None: unknown yet)."""
    action = getattr(values, "action", None)
    others = {name: getattr(values, name, None) for name in ("domain", "chunk_size", "actions", "resolution_tier")}
    if action is None:
        given = [f"--{n.replace('_', '-')}" for n, v in others.items() if v is not None and n != "resolution_tier"]
        return [f"{' / '.join(given)}: options of an action job; give --action too"] if given else []
    needed = ("domain", "chunk_size") + (("actions",) if action == "forward_dynamics" else ())
    problems = [f"--action {action} needs --{n.replace('_', '-')}" for n in needed if others[n] is None]
    if action in PREDICTS and others["actions"] is not None:
        problems.append(f"--actions drives forward_dynamics; --action {action} predicts the actions itself")
    image, video = getattr(values, "image", None), getattr(values, "video", None)
    if action == "inverse_dynamics" and not video:
        problems.append("--action inverse_dynamics infers the actions between a clip's frames: give --video")
    elif action != "inverse_dynamics" and not (image or video):
        problems.append(f"--action {action} rolls a first frame forward: give --image (or --video)")
    sized = [f"--{n}" for n in ("frames", "height", "width") if getattr(values, n, None) is not None]
    if sized:
        problems.append(
            f"--action sets the video's size from --chunk-size and --resolution-tier; leave out {', '.join(sized)}"
        )
    if getattr(values, "prompts", None):
        problems.append("--action runs one request: give --prompt, not --prompts")
    if transformer is not None and transformer.get("action_gen") is not True:
        problems.append(f"--action: {where} has no `action_gen`: its transformer takes no actions")
    widths = domain_widths()
    domain = others["domain"]
    if domain is not None and domain not in widths:
        problems.append(f"--domain {domain!r} is not one of diffusers' action domains: {', '.join(sorted(widths))}")
    if others["actions"] is not None:
        problems += _file_problems(others["actions"], widths.get(domain), domain, transformer, where)
    return problems


def _file_problems(path: str, width: int | None, domain, transformer: dict | None, where: str) -> list[str]:
    try:
        rows = read_actions(path)
    except ArgumentError as exc:
        return list(exc.problems)
    got = len(rows[0])
    problems = []
    if width is not None and got != width:
        problems.append(f"--actions {path} has {got} values per action; --domain {domain} takes {width}")
    dim = (transformer or {}).get("action_dim")
    if isinstance(dim, int) and got > dim:
        problems.append(f"--actions {path} has {got} values per action; {where} has `action_dim` {dim}")
    return problems


__all__ = ["ACTION_MODES", "PREDICTS", "RESOLUTION_TIERS", "action_problems", "domain_widths", "read_actions"]
