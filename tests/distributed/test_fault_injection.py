"""Hostile checkpoints and failing ranks, through ``load_model`` on 2 and 4 gloo ranks.

For every case every rank must fail, within seconds, with an error that names the cause,
and no rank may hold a usable model: a failure found before the ranks agree leaves the
``model_fn`` result untouched (still on meta, nothing swapped or sharded); a failure
during the load leaves a model whose forward raises ``ModelUnusableError``.

Process start-up dominates on CPU, so one spawn per world size walks every case (each rank
calls ``load_model`` on each, records what it saw) and the tests below judge the records.
A rank that dies ends its world, so each kill case gets its own spawn; survivors write
their records to files because the harness reports a dead rank as a failed run.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from calibration import bound
from ckpt_writer import config_json_quant, edit_header, nested_config, read_raw, set_scalar, write_index, write_raw
from ranks import RanksFailed, run_ranks
from small_models import HIDDEN, UnevenModel, what_still_runs, write_uneven_checkpoint

WORLD_SIZES = (2, 4)
S1, S2, S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))  # S3 holds every scale
FAIL_WITHIN_S = 10.0  # per load_model call; every case here fails in well under a second
PG_TIMEOUT_S = 20.0  # bounds a collective waiting on a dead peer, in place of gloo's 30 minutes
RUN_TIMEOUT_S = 120.0  # the whole spawn; pytest-timeout, if set, is larger


# --- what each rank does --------------------------------------------------------------------


class _Injected(OSError):
    pass


def _inject(rank: int, case: dict, stack) -> None:
    """Arrange this rank's fault for ``case`` (undone by ``stack`` when the case ends)."""
    import fsdp_fp8.collective.agreement as api
    import fsdp_fp8.compose.model as composed
    from fsdp_fp8.reading import read_schedule

    if rank != case.get("fault_rank", 1):
        return
    fault = case.get("fault")
    if fault == "raise_read":

        def broken_read(request, buffers, **kw):
            raise _Injected(f"injected read failure for `{request.pieces[0].entry.key}`")

        stack.enter_context(mock.patch.object(read_schedule, "read_request", broken_read))
    elif fault == "truncate_after_agreement":
        real = api.agree_or_raise

        def agree_then_truncate(*args, **kwargs):
            real(*args, **kwargs)
            path = Path(case["paths"][rank]) / S3  # this rank's copy: the others keep theirs
            header_len = int.from_bytes(path.read_bytes()[:8], "little")
            os.truncate(path, 8 + header_len)  # every scale it still has to read is gone

        stack.enter_context(mock.patch.object(api, "agree_or_raise", agree_then_truncate))
    elif fault == "die_read":

        def dying_read(*args, **kwargs):
            os._exit(17)

        stack.enter_context(mock.patch.object(read_schedule, "read_request", dying_read))
    elif fault == "die_open":
        stack.enter_context(mock.patch.object(composed, "open_checkpoint", lambda path: os._exit(17)))
    elif fault is not None:
        raise AssertionError(fault)


def _key_map(rank: int, case: dict):
    if case.get("key_map") == "rank1_renames" and rank == 1:
        return lambda key: key.replace("layers.", "blocks.")
    return None


def _model_state(model, failed: bool) -> dict:
    """Was the model mutated, and what does its forward do (after a failure: with no collective)?"""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from fsdp_fp8 import Float8StaticLinear, ModelUnusableError
    from fsdp_fp8.runtime.allgather_meter import all_gather_name

    if model is None:
        return {"built": False}
    state = {
        "built": True,
        "all_on_meta": all(p.is_meta for p in model.parameters()),
        "swapped": sorted(n for n, m in model.named_modules() if isinstance(m, Float8StaticLinear)),
        "sharded": isinstance(model, FSDPModule),
    }
    if state["all_on_meta"]:
        return state
    collectives = []

    def refuse_collective(*args, **kwargs):
        collectives.append(1)
        raise RuntimeError("collective in the forward of a model that failed to load")

    name = all_gather_name()  # the collective FSDP2 calls on this torch
    saved = getattr(dist, name)
    if failed:  # the peers may be gone: the refusal must come before FSDP2's all-gather
        setattr(dist, name, refuse_collective)
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 2, HIDDEN, dtype=torch.bfloat16))
        state["forward"] = "ran"
    except ModelUnusableError as exc:
        state["forward"] = f"ModelUnusableError: {exc}"
    except Exception as exc:  # noqa: BLE001 - recorded and judged by the test
        state["forward"] = f"{type(exc).__name__}: {exc}"
    finally:
        setattr(dist, name, saved)
    state["forward_s"] = time.monotonic() - t0
    state["forward_collectives"] = len(collectives)
    if failed:
        state |= what_still_runs(model)
    return state


def _attempt(rank: int, world: int, case: dict) -> dict:
    import contextlib

    import torch.distributed as dist

    from fsdp_fp8 import CheckpointError, load_model

    path = case["paths"][rank] if "paths" in case else case["path"]
    built = []

    def model_fn(config):
        built.append(UnevenModel())
        return built[-1]

    gathers = []
    real_gather = dist.all_gather_object

    def counting_gather(*args, **kwargs):
        gathers.append(1)
        return real_gather(*args, **kwargs)

    record: dict = {"error": None}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "all_gather_object", counting_gather))
        _inject(rank, case, stack)
        t0 = time.monotonic()
        try:
            load_model(model_fn, path, key_map=_key_map(rank, case), device=torch.device("cpu"))
        except CheckpointError as exc:
            record["error"] = ("CheckpointError", str(exc), exc.problems)
        except Exception as exc:  # noqa: BLE001 - recorded and judged by the test
            record["error"] = (type(exc).__qualname__, str(exc), None)
        record["seconds"] = time.monotonic() - t0
    record["all_gather_object_calls"] = len(gathers)
    record["model"] = _model_state(built[-1] if built else None, failed=record["error"] is not None)
    return record


def _walk_cases(rank: int, world: int, cases: list[dict]) -> dict:
    return {case["name"]: _attempt(rank, world, case) for case in cases}


def _survive_kill(rank: int, world: int, case: dict, out_dir: str) -> dict:
    record = _attempt(rank, world, case)  # the dying rank never gets past this line
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(record))
    return record


# --- hostile checkpoints, written once per module -------------------------------------------


def _shift_last(path: Path, delta: int, data: bytes | None = None) -> None:
    """Move the last tensor's byte range by ``delta``; ``data`` replaces the data region."""
    header, old = read_raw(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + delta, end + delta]
    write_raw(path, header, old if data is None else data(old))


def _first_key(path: Path) -> str:
    header, _ = read_raw(path)
    return sorted(k for k in header if k != "__metadata__")[0]


def _remap(directory: Path, key: str, value: str) -> None:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map[key] = value
    write_index(directory, weight_map)


def _set_dtype(path: Path, dtype: str) -> None:
    key = _first_key(path)
    edit_header(path, lambda h: h[key].update(dtype=dtype))


def _set_shape(path: Path) -> None:
    key = _first_key(path)

    def edit(h):
        h[key]["shape"] = [d * 2 for d in h[key]["shape"]] or [2]

    edit_header(path, edit)


def _overlap(path: Path) -> None:
    _shift_last(path, -2, lambda data: data[:-2])


def _gap(path: Path) -> None:
    _shift_last(path, 4, lambda data: data + b"\0" * 4)


def _overrun(path: Path) -> None:
    _shift_last(path, 6)  # same file size: the last range now runs 6 bytes past its end


def _with_configs(directory: Path, hf_quant=None, quantization_config=None) -> None:
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    if quantization_config is not None:
        (directory / "config.json").write_text(
            json.dumps({"model_type": "test", "quantization_config": quantization_config})
        )


def _nested(edit):
    c = nested_config(ignore=("head",))
    edit(c)
    return c


def _config(edit, ignore=("head",)):
    q = config_json_quant(ignore=ignore)
    edit(q)
    return q


def _group(q):
    return q["config_groups"]["group_0"]


# name -> (edit(directory), needles the error must contain)
HOSTILE = {
    "truncated shard": (lambda d: (d / S1).write_bytes((d / S1).read_bytes()[:-3]), [S1, "truncated"]),
    "header length > file": (
        lambda d: write_raw(d / S2, *read_raw(d / S2), header_len=10**7),
        [S2, "header length 10000000 is larger than the file"],
    ),
    "non-JSON header": (lambda d: write_raw(d / S1, b"{not json", b""), [S1, "not valid JSON"]),
    "overlapping ranges": (lambda d: _overlap(d / S1), [S1, "overlaps"]),
    "gapped ranges": (lambda d: _gap(d / S1), [S1, "4 unaccounted bytes"]),
    "overrunning range": (lambda d: _overrun(d / S2), [S2, "truncated: tensors end at byte"]),
    "dtype/shape vs byte range": (lambda d: _set_shape(d / S1), [S1, "bytes but data_offsets"]),
    "unknown dtype": (lambda d: _set_dtype(d / S1, "F4_E2M1"), [S1, "unknown dtype 'F4_E2M1'"]),
    "NaN scale": (
        lambda d: set_scalar(d / S3, "layers.0.up.weight_scale", float("nan")),
        ["`layers.0.up.weight_scale`", "is nan", "finite and > 0"],
    ),
    "inf scale": (
        lambda d: set_scalar(d / S3, "layers.1.gate.input_scale", float("inf")),
        ["`layers.1.gate.input_scale`", "is inf", "finite and > 0"],
    ),
    "zero scale": (
        lambda d: set_scalar(d / S3, "layers.0.down.weight_scale", 0.0),
        ["`layers.0.down.weight_scale`", "is 0.0", "finite and > 0"],
    ),
    "negative scale": (
        lambda d: set_scalar(d / S3, "layers.1.up.input_scale", -1.0),
        ["`layers.1.up.input_scale`", "is -1.0", "finite and > 0"],
    ),
    "index not JSON": (
        lambda d: (d / "model.safetensors.index.json").write_text("{oops"),
        ["model.safetensors.index.json is not valid JSON"],
    ),
    "index without weight_map": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        ["model.safetensors.index.json", "`weight_map` is missing"],
    ),
    "index path outside dir": (lambda d: _remap(d, "shift", "../" + S1), ["'../" + S1 + "'", "uses '..'"]),
    "index absolute path": (lambda d: _remap(d, "shift", "/etc/passwd.safetensors"), ["absolute path"]),
    "no safetensors": (lambda d: [p.unlink() for p in d.glob("*.safetensors*")], ["no safetensors checkpoint"]),
    "pickle offered": (
        lambda d: (
            [p.unlink() for p in d.glob("*.safetensors*")],
            (d / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n."),
        ),
        ["pytorch_model.bin", "never unpickled"],
    ),
    # config hostility
    "config wrong type": (
        lambda d: _with_configs(d, hf_quant=_nested(lambda c: c["quantization"].update(exclude_modules="head"))),
        ["`quantization.exclude_modules` must be a list"],
    ),
    "config bits as string": (
        lambda d: _with_configs(d, quantization_config=_config(lambda q: _group(q)["weights"].update(num_bits="8"))),
        ["group_0.weights.num_bits` is '8'"],
    ),
    "config NVFP4": (
        lambda d: _with_configs(d, hf_quant=_nested(lambda c: c["quantization"].update(quant_algo="NVFP4"))),
        ["`quantization.quant_algo` is 'NVFP4'"],
    ),
    "config per-channel": (
        lambda d: _with_configs(
            d, quantization_config=_config(lambda q: _group(q)["weights"].update(strategy="channel"))
        ),
        ["weights.strategy` is 'channel'"],
    ),
    "config dynamic activations": (
        lambda d: _with_configs(
            d, quantization_config=_config(lambda q: _group(q)["input_activations"].update(dynamic=True))
        ),
        ["input_activations.dynamic` is True"],
    ),
    "config spellings disagree": (
        lambda d: _with_configs(d, quantization_config=_config(lambda q: None, ignore=("head", "layers.1.gate"))),
        ["disagree on ignore/exclude_modules"],
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Every directory the cases load, by name; ``good`` first."""
    root = tmp_path_factory.mktemp("faults")
    dirs = {"good": write_uneven_checkpoint(root / "good")}
    for name, (edit, _) in HOSTILE.items():
        d = root / name.replace(" ", "_").replace("/", "_")
        shutil.copytree(dirs["good"], d)
        edit(d)
        dirs[name] = d
    # Same keys, shapes and data; one header carries an extra metadata field.
    other = root / "other_header"
    shutil.copytree(dirs["good"], other)
    edit_header(other / S2, lambda h: h["__metadata__"].update(note="rewritten on one node"))
    dirs["other_header"] = other
    return dirs


def _cases(dirs: dict, world: int, root: Path) -> list[dict]:
    good = str(dirs["good"])
    copies = []  # the truncation case damages rank 1's own copy only
    for rank in range(world):
        copy = root / f"w{world}_rank{rank}_copy"
        shutil.copytree(dirs["good"], copy)
        copies.append(str(copy))
    return [
        {"name": "good", "path": good},
        *({"name": name, "path": str(dirs[name])} for name in HOSTILE),
        {"name": "problem on rank 1 only", "paths": [good, str(dirs["NaN scale"])] + [good] * (world - 2)},
        {"name": "key_map differs on rank 1", "path": good, "key_map": "rank1_renames"},
        {"name": "ranks see different files", "paths": [good, str(dirs["other_header"])] + [good] * (world - 2)},
        {"name": "rank 1 raises mid-load", "path": good, "fault": "raise_read"},
        {"name": "shard truncated after agreement", "paths": copies, "fault": "truncate_after_agreement"},
        {"name": "good again", "path": good},  # a failed case leaves nothing behind
    ]


@pytest.fixture(scope="module")
def observed(checkpoints, tmp_path_factory):
    """``observed(world)``: every rank's records of every case, one spawn per world size."""
    cache: dict = {}

    def walk(world: int) -> dict:
        if world not in cache:
            cases = _cases(checkpoints, world, tmp_path_factory.mktemp(f"w{world}"))
            t0 = time.monotonic()
            results = run_ranks(_walk_cases, world, cases, timeout=RUN_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
            cache[world] = {"ranks": results, "seconds": time.monotonic() - t0}
        return cache[world]

    return walk


# --- judging --------------------------------------------------------------------------------


def _records(observed, world, name) -> list[dict]:
    return [ranks[name] for ranks in observed(world)["ranks"]]


def _assert_untouched(record: dict, exchanges: int = 1) -> None:
    model = record["model"]
    assert model["built"] is False or (model["all_on_meta"] and not model["swapped"] and not model["sharded"]), model
    # The agreement was the only collective (a second exchange only when what the ranks read
    # differs, to name the difference): nothing after it ran.
    assert record["all_gather_object_calls"] == exchanges, record["all_gather_object_calls"]


def _assert_unusable(record: dict) -> None:
    """Its forward refuses with no collective, no module of it computes, it holds no storage."""
    model = record["model"]
    assert model["forward"].startswith("ModelUnusableError: this model did not finish loading"), model
    assert model["forward_collectives"] == 0, model
    assert model["computing"] == [] and model["held_bytes"] == 0, model


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_clean_checkpoint_loads_before_and_after_the_faults(observed, world):
    for name in ("good", "good again"):
        for record in _records(observed, world, name):
            assert record["error"] is None, record["error"]
            assert record["model"]["forward"] == "ran"
            assert record["all_gather_object_calls"] == 2  # agreement before mutation, outcome after load


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_checkpoint_fails_on_every_rank_naming_the_cause(observed, world, case):
    records = _records(observed, world, case)
    problems = []
    for rank, record in enumerate(records):
        assert record["error"] is not None, f"rank {rank} accepted {case!r}"
        kind, text, found = record["error"]
        assert kind == "CheckpointError", record["error"]
        assert all(n in text for n in HOSTILE[case][1]), (HOSTILE[case][1], text)
        assert record["seconds"] < bound(FAIL_WITHIN_S), record["seconds"]
        _assert_untouched(record)
        problems.append(found)
    # The same verdict on every rank; every rank found each problem, and it is listed once.
    assert all(p == problems[0] for p in problems), problems
    assert problems[0] and all(p.startswith(f"all {world} ranks: ") for p in problems[0]), problems[0]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_problem_on_one_rank_fails_every_rank_before_mutation(observed, world):
    for case in ("problem on rank 1 only", "key_map differs on rank 1"):
        records = _records(observed, world, case)
        verdicts = [r["error"][2] for r in records]
        for record in records:
            assert record["error"][0] == "CheckpointError", record["error"]
            assert record["seconds"] < bound(FAIL_WITHIN_S)
            _assert_untouched(record)
        assert all(v == verdicts[0] for v in verdicts), verdicts
        assert verdicts[0] and all(p.startswith("rank 1: ") for p in verdicts[0]), verdicts[0]
    scale = _records(observed, world, "problem on rank 1 only")[0]["error"][2]
    assert any("`layers.0.up.weight_scale`" in p and "finite and > 0" in p for p in scale), scale
    renamed = _records(observed, world, "key_map differs on rank 1")[0]["error"][2]
    assert any("`layers.0.up.weight`" in p for p in renamed), renamed


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_that_see_different_files_are_refused(observed, world):
    records = _records(observed, world, "ranks see different files")
    for record in records:
        kind, _, found = record["error"]
        assert kind == "CheckpointError"
        # The file, the key and both values: the header digest of the shard whose metadata differs.
        assert any(p.startswith(f"ranks disagree on {S2}") and "`(header sha256)` differs: rank" in p for p in found), (
            found
        )
        _assert_untouched(record, exchanges=2)
    assert all(r["error"][2] == records[0]["error"][2] for r in records)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize(
    "case, needles",
    [
        # An OSError in a read worker is a problem naming the key, the file and the offset.
        (
            "rank 1 raises mid-load",
            ["rank 1: CheckpointError: ", "failed: _Injected: injected read failure for `layers."],
        ),
        # The scales are not read again (their validated values load), so nothing fails to read:
        # the check after the reads finds the shard changed.
        (
            "shard truncated after agreement",
            ["rank 1: CheckpointError: ", S3, "was rewritten in place after it was validated (size"],
        ),
    ],
)
def test_failure_during_load_fails_every_rank_and_leaves_the_model_unusable(observed, world, case, needles):
    for record in _records(observed, world, case):
        kind, text, _ = record["error"]
        assert kind == "LoadFailedError", record["error"]
        assert text.startswith(f"checkpoint load failed on 1 of {world} ranks: "), text
        assert all(n in text for n in needles), (needles, text)
        assert record["seconds"] < bound(FAIL_WITHIN_S)
        assert record["model"]["sharded"] and record["model"]["swapped"]
        _assert_unusable(record)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_whole_walk_is_fast(observed, world):
    # ~33 load_model calls per rank, most failing: process start-up is the bulk of it
    # (2 ranks ~20-30 s, 4 ranks ~40 s on 2 busy cores); each call is bounded above.
    assert observed(world)["seconds"] < bound(RUN_TIMEOUT_S), observed(world)["seconds"]


# --- a rank killed: every survivor raises, within seconds, and holds no usable model --------


def _run_with_a_dead_rank(world: int, case: dict, tmp_path: Path, monkeypatch) -> tuple[list[dict], float, str]:
    import ranks

    # The harness kills the others FAIL_GRACE_S after a rank dies; here the survivors must be
    # allowed to report. Their own bound is asserted from their records (FAIL_WITHIN_S).
    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 2 * FAIL_WITHIN_S)
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_survive_kill, world, case, str(tmp_path), timeout=RUN_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert "rank 1 exited with code 17 before returning a result" in message, message
    assert message.startswith(f"1 of {world} ranks failed"), message  # every survivor returned
    survivors = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world) if r != 1]
    return survivors, elapsed, message


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_rank_killed_mid_load(world, checkpoints, tmp_path, monkeypatch):
    case = {"name": "killed mid-load", "path": str(checkpoints["good"]), "fault": "die_read"}
    survivors, elapsed, _ = _run_with_a_dead_rank(world, case, tmp_path, monkeypatch)
    for record in survivors:
        kind, text, _ = record["error"]
        assert kind == "PeerLostError", record["error"]
        assert text.startswith("checkpoint load failed: "), text
        # either it saw the dead peer in the agreement, or it arrived after a survivor had given up on it
        assert any(
            reason in text
            for reason in (
                "could not complete the agreement on the outcome of the load with the other ranks",
                "arrived at the agreement on the outcome of the load after rank(s)",
            )
        ), text
        print(f"world {world}: survivor raised {record['seconds']:.3f} s after calling load_model")
        # gloo sees the dead peer: not the pg timeout
        assert record["seconds"] < bound(FAIL_WITHIN_S), record["seconds"]
        _assert_unusable(record)
    assert elapsed < bound(RUN_TIMEOUT_S), elapsed  # spawn included; nobody waited for the pg timeout


def test_rank_killed_before_agreement(checkpoints, tmp_path, monkeypatch):
    case = {"name": "killed before agreement", "path": str(checkpoints["good"]), "fault": "die_open"}
    survivors, elapsed, _ = _run_with_a_dead_rank(2, case, tmp_path, monkeypatch)
    (record,) = survivors
    kind, text, _ = record["error"]
    assert kind == "PeerLostError", record["error"]
    assert "could not complete the agreement before loading with the other ranks" in text, text
    assert "rank(s) [1] left before arriving" in text and "nothing was changed" in text, text
    assert record["seconds"] < bound(FAIL_WITHIN_S), record["seconds"]
    assert record["model"]["all_on_meta"] and not record["model"]["swapped"] and not record["model"]["sharded"]
