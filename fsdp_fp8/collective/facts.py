"""What each rank describes before the ranks agree: its *facts*, grouped by component.

Each rank validates the checkpoint and the plan on its own; if ranks saw different files (a
shard or config rewritten on one node, a shared filesystem serving different bytes), built
different models, or one rank found a problem, going on would end in an abort inside the first
FSDP collective or in silently different weights. So each rank describes what it will load:
every config file and the index (each value by its dotted key), every shard header (each
tensor's dtype, shape and byte range), the validated scale values, the plan, the model's
structure (names, shapes, dtypes) and where it goes (device type, mesh). The objects are read
by their attributes only: this layer imports no loader.
"""

from __future__ import annotations

import json


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
