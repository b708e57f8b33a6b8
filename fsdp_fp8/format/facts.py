"""What each rank describes before the ranks agree: its *facts*, grouped by component (a dict of
dicts of strings, which ``fsdp_fp8.collective.agree_or_raise`` digests and compares). This module
describes what was read from disk; the load plan and the model describe themselves
(``LoadPlan.facts``, ``fsdp_fp8.load.fsdp_wrap.model_facts``).

Each rank validates the checkpoint and the plan on its own; if ranks saw different files (a
shard or config rewritten on one node, a shared filesystem serving different bytes), built
different models, or one rank found a problem, going on would end in an abort inside the first
FSDP collective or in silently different weights. So each rank describes what it will load:
every config file and the index (each value by its dotted key), every shard header (each
tensor's dtype, shape and byte range), the validated scale values, the plan, the model's
structure (names, shapes, dtypes) and where it goes (device type, mesh).
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
