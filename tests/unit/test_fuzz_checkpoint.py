"""Fuzz the reader with mutations of a real ModelOpt export: refuse cleanly or load the true bytes.

Each case copies one file of ``fixtures/modelopt-0.47-llama-sharded`` with a seeded random
mutation (bytes flipped, inserted or deleted in a shard header, the length prefix changed,
a file cut short, one JSON value of a header, the index or a config replaced, a config's
numeric model field made non-finite or non-positive, JSON nested deeply, a header or JSON
file re-encoded (BOM, UTF-16, a non-UTF-8 byte, a NaN constant), or bytes of the data region
flipped), then runs ``open_checkpoint`` and the load plan against the fixture's Llama on
meta. Three outcomes only:

- refused with ``CheckpointError`` (or ``FileNotFoundError``); any other exception fails;
- accepted, and then every tensor holds the same keys, dtypes and shapes as the original and
  the bytes ``slice_reader`` reads for it equal what safetensors itself reads from the
  mutated file: a mutation may only be accepted when it hit nothing but data bytes (or
  JSON that means the same thing);
- every case finishes within ``CASE_LIMIT_S``: nothing hangs.

Default: 2,000 cases, well under a minute (the directory lives in ``/dev/shm`` where there is
one, so the file writes cost nothing). A longer run::

    FSDP_FP8_FUZZ_CASES=20000 FSDP_FP8_FUZZ_SEED=7 .venv/bin/python -m pytest -q tests/unit/test_fuzz_checkpoint.py
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tempfile
import time
from pathlib import Path

import pytest
import torch
from calibration import bound
from small_models import FIXTURE, fixture_llama_fn

from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.meta_build import meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.reading import slice_reader

CASES = int(os.environ.get("FSDP_FP8_FUZZ_CASES", "2000"))
SEED = int(os.environ.get("FSDP_FP8_FUZZ_SEED", "0"))
CASE_LIMIT_S = 5.0
SHARDS = sorted(p.name for p in FIXTURE.glob("*.safetensors"))
JSONS = ["model.safetensors.index.json", "config.json", "hf_quant_config.json"]
ODD_VALUES = [
    None,
    True,
    -1,
    0,
    1,
    2**63,
    1.5,
    float("nan"),
    "",
    "x",
    "F8_E4M3",
    "../x.safetensors",
    [],
    [-1],
    [0, 1],
    {},
    {"dtype": "F32"},
]


def _header_span(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0]


def _mutate_bytes(rng: random.Random, raw: bytes, lo: int, hi: int) -> tuple[bytes, str]:
    kind = rng.choice(["flip", "flip", "insert", "delete", "truncate"])
    at = rng.randrange(lo, max(lo + 1, hi))
    if kind == "flip":
        out = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(lo, max(lo + 1, hi))
            out[i] = rng.randrange(256) if rng.random() < 0.5 else out[i] ^ (1 << rng.randrange(8))
        return bytes(out), kind
    if kind == "insert":
        return raw[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + raw[at:], f"{kind}@{at}"
    if kind == "delete":
        return raw[:at] + raw[at + rng.randint(1, 8) :], f"{kind}@{at}"
    return raw[:at], f"{kind}@{at}"


def _odd(rng: random.Random, value):
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return value + rng.choice([-8, -1, 1, 2, 4096])
    return rng.choice(ODD_VALUES)


def _mutate_json(rng: random.Random, obj):
    """Replace, delete or add one value somewhere inside ``obj`` (in place); returns a path."""
    path, node = [], obj
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return "/".join(path) + " (empty)"
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.7:
            path.append(str(key))
            node = child
            continue
        action = rng.choice(["set", "set", "del", "add"]) if isinstance(node, dict) else "set"
        if action == "set":
            node[key] = _odd(rng, child)
        elif action == "del":
            del node[key]
        else:
            node[rng.choice(["extra", "__metadata__", "crc", key + "x"])] = _odd(rng, child)
        return "/".join(path + [str(key)]) + f" {action}"


# Fields the model's arithmetic depends on (fsdp_fp8.format.checkpoint.POSITIVE_FIELDS).
NUMERIC_FIELDS = ["rms_norm_eps", "rope_theta"]
MUST_REFUSE = "refuse: "
BAD_NUMBERS = ["1e999", "-1e999", "0", "-1e-6", "0.0", "NaN", "Infinity", "-Infinity"]


def _reencode(rng: random.Random, text: str) -> tuple[bytes, str]:
    """The same JSON text in an encoding or spelling the safetensors library refuses."""
    kind = rng.choice(["bom", "utf-16", "latin-1 byte", "nan"])
    if kind == "bom":
        return b"\xef\xbb\xbf" + text.encode(), kind
    if kind == "utf-16":
        return text.encode(rng.choice(["utf-16", "utf-16-le", "utf-16-be"])), kind
    if kind == "latin-1 byte":
        at = text.index('"', 1) + 1  # inside the first string
        return text[:at].encode() + bytes([rng.randrange(0x80, 0x100)]) + text[at:].encode(), kind
    return text.replace("{", '{"fuzz": ' + rng.choice(["NaN", "Infinity", "-Infinity"]) + ", ", 1).encode(), kind


def _nest(rng: random.Random, text: str) -> tuple[bytes, str]:
    depth = rng.choice([33, 200, 5000, 200_000])
    return (text[:-1] + f', "deep": {"[" * depth}{"]" * depth}}}').encode(), f"nested {depth}"


def _mutation(rng: random.Random, originals: dict[str, bytes]) -> tuple[str, bytes, str]:
    """(file name, its mutated bytes, description); descriptions starting with ``MUST_REFUSE``
    are mutations no valid checkpoint has."""
    target = rng.choice(["shard"] * 6 + ["json"] * 3 + ["data"] + ["encoding", "config number", "nesting"])
    if target == "config number":
        obj = json.loads(originals["config.json"])
        field, value = rng.choice(NUMERIC_FIELDS), rng.choice(BAD_NUMBERS)
        text = json.dumps({**obj, field: "@"}).replace('"@"', value)
        return "config.json", text.encode(), f"refuse: config {field}={value}"
    if target in ("encoding", "nesting"):
        change = _reencode if target == "encoding" else _nest
        name = rng.choice(SHARDS + JSONS)
        raw = originals[name]
        if name in JSONS:
            mutated, how = change(rng, raw.decode())
            return name, mutated, f"refuse: {how}"
        span = _header_span(raw)
        text, how = change(rng, raw[8:span].decode().rstrip())
        return name, struct.pack("<Q", len(text)) + text + raw[span:], f"refuse: header {how}"
    if target == "json":
        name = rng.choice(JSONS)
        raw = originals[name]
        if rng.random() < 0.5:
            obj = json.loads(raw)
            where = _mutate_json(rng, obj)
            return name, json.dumps(obj).encode(), f"json {where}"
        mutated, how = _mutate_bytes(rng, raw, 0, len(raw))
        return name, mutated, f"bytes {how}"
    name = rng.choice(SHARDS)
    raw = originals[name]
    span = _header_span(raw)
    if target == "data":
        out = bytearray(raw)  # flips only: the file keeps its size
        i = rng.randrange(span, len(raw))
        out[i] ^= 1 << rng.randrange(8)
        return name, bytes(out), f"data flip@{i}"
    choice = rng.random()
    if choice < 0.15:
        n = struct.unpack("<Q", raw[:8])[0]
        new = rng.choice([n + rng.randint(-16, 16), rng.randrange(2**64), 0, len(raw)])
        return name, struct.pack("<Q", new) + raw[8:], f"length {n}->{new}"
    if choice < 0.55:
        header = json.loads(raw[8:span])
        where = _mutate_json(rng, header)
        text = json.dumps(header).encode()
        return name, struct.pack("<Q", len(text)) + text + raw[span:], f"header json {where}"
    mutated, how = _mutate_bytes(rng, raw, 0, span)
    return name, mutated, f"header bytes {how}"


def _reference(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for name in SHARDS:
        with safe_open(directory / name, framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def _judge_accepted(directory: Path, ckpt, original: dict[str, tuple], description: str) -> None:
    found = {k: (e.dtype, e.shape) for k, e in ckpt.tensors.items()}
    assert found == original, f"{description}: accepted with a different set of tensors"
    try:
        reference = _reference(directory)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{description}: accepted, but safetensors refuses the file: {exc}")
    for key, entry in ckpt.tensors.items():
        got = slice_reader.read_bytes(entry, 0, entry.shape[0] if entry.shape else 1).reshape(entry.shape)
        want = reference[key]
        assert got.dtype == want.dtype and torch.equal(
            got.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8)
        ), f"{description}: `{key}` loaded bytes differ from the mutated file's"


@pytest.mark.timeout(600)
def test_mutated_fixture_is_refused_cleanly_or_loads_the_true_bytes(tmp_path):
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):  # thousands of rewrites: keep them in memory
        tmp_path = Path(tempfile.mkdtemp(prefix="fsdp_fp8-fuzz-", dir=shm))
    try:
        _fuzz(tmp_path)
    finally:
        if str(tmp_path).startswith("/dev/shm/"):
            shutil.rmtree(tmp_path, ignore_errors=True)


def _fuzz(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, directory)
    originals = {p.name: p.read_bytes() for p in directory.iterdir()}
    pristine = open_checkpoint(directory)
    original = {k: (e.dtype, e.shape) for k, e in pristine.tensors.items()}
    config = pristine.config
    rng = random.Random(SEED)
    outcomes = {"refused": 0, "accepted": 0}
    for case in range(CASES):
        name, mutated, how = _mutation(rng, originals)
        description = f"case {case} (seed {SEED}): {name}: {how}"
        (directory / name).write_bytes(mutated)
        t0 = time.monotonic()
        try:
            ckpt = open_checkpoint(directory)
            with meta_init():
                model = fixture_llama_fn(config)  # the model does not follow a mutated config
            plan_load(ckpt, model)
        except (CheckpointError, FileNotFoundError):
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{description}: raised {type(exc).__name__}: {exc}")
        else:
            outcomes["accepted"] += 1
            assert not how.startswith(MUST_REFUSE), f"{description}: accepted"
            _judge_accepted(directory, ckpt, original, description)
        finally:
            (directory / name).write_bytes(originals[name])
        assert time.monotonic() - t0 < bound(CASE_LIMIT_S), f"{description}: took {time.monotonic() - t0:.1f} s"
    # The mutations must exercise both outcomes, or the fuzz tests nothing.
    assert outcomes["refused"] > CASES // 4 and outcomes["accepted"] > 0, outcomes


# --- what the fuzz found, pinned ------------------------------------------------------------


def test_index_mapping_a_key_to_a_list_is_refused_not_a_type_error(tmp_path):
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    index = tmp_path / "model.safetensors.index.json"
    obj = json.loads(index.read_text())
    obj["weight_map"]["model.norm.weight"] = [SHARDS[0]]
    index.write_text(json.dumps(obj))
    with pytest.raises(CheckpointError, match=r"`model.norm.weight` maps to \['model-00001"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}])
def test_header_dtype_that_is_not_a_string_is_refused_not_a_type_error(tmp_path, dtype):
    from ckpt_writer import edit_header

    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    edit_header(tmp_path / SHARDS[3], lambda h: h["model.layers.1.mlp.down_proj.input_scale"].update(dtype=dtype))
    with pytest.raises(CheckpointError, match="`model.layers.1.mlp.down_proj.input_scale` in .*: unknown dtype"):
        open_checkpoint(tmp_path)
