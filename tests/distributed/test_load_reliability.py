"""What reaches the model is what was checked, on 2 gloo ranks, one spawn walking every case.

- Files replaced or rewritten between the agreement and the reads (real ``os.replace`` and
  in-place writes, on rank 1 only and on every rank): the load fails on every rank naming the
  file, or, where the rewrite kept size and mtime, the validated scale values are what loads.
- FP8 codes that are NaN in E4M3 in the rows one rank reads: every rank fails, naming it.
- Ranks that read different configs / index, or build different models (``strict=False``):
  every rank refuses before anything is swapped or sharded, naming file, key and both values.
- After a load that fails here no module of the model computes and its storage is released
  (a read that raises: tests/distributed/test_fault_injection.py, at 2 and 4 ranks).
- Agreements run on a gloo side group with their own timeout: a rank slower than it is named
  by every other rank, the slow rank itself does not wait a second timeout, and the wait for
  the outcome is sized from the read forecast.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from calibration import bound, slowdown
from ckpt_writer import read_raw, set_scalar, write_index
from ranks import run_ranks
from small_models import HIDDEN, UnevenModel, what_still_runs, write_uneven_checkpoint

S1, S3 = "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"
REFUSE_WITHIN_S = 5.0
TIMEOUT_S = 1.0  # the agreement timeout the slow-rank cases use
# How long a slow rank sleeps at most: longer than TIMEOUT_S. It wakes once rank 0's attempt at
# the case has ended (rank 0 gave up on it: what the case judges is known), well before.
SLOW_S = 4.0
# Both, and the forecast case's sleep and storage rate, are reference-machine figures: the
# fixture scales them by calibration.slowdown() so that load cannot eat the margins between them.


def _keep_times(path: Path, write) -> None:
    """Rewrite ``path`` in place through ``write(file)``, then put its mtime back."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        write(f)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _nan_codes_in_last_row(directory: Path, key: str) -> None:
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    path = directory / index[key]
    header, _ = read_raw(path)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    begin, end = header[key]["data_offsets"]
    cols = header[key]["shape"][1]
    _keep_times(path, lambda f: (f.seek(8 + n + end - cols), f.write(bytes([0x7F, 0xFF] * (cols // 2)))))


def _slow(case: dict, slept: list) -> None:
    """Rank 1 late: ``case["sleep"]`` seconds, or until rank 0's attempt at this case has ended
    (it gave up waiting for rank 1), whichever comes first; the seconds slept go to ``slept``."""
    t0, ended = time.monotonic(), Path(case["ended"])
    while time.monotonic() - t0 < case["sleep"] and not ended.exists():
        time.sleep(0.01)
    slept.append(time.monotonic() - t0)


def _fault(rank: int, case: dict, stack, slept: list) -> None:
    import fsdp_fp8.collective.agreement as api
    import fsdp_fp8.compose.model as composed
    from fsdp_fp8.collective import agreement
    from fsdp_fp8.reading import read_schedule

    if case.get("slow_storage"):  # every rank: the forecast assumes storage this slow
        stack.enter_context(mock.patch.object(agreement, "ASSUMED_READ_BYTES_PER_S", case["slow_storage"]))
    fault, on = case.get("fault"), case.get("on", [1])
    if fault is None or rank not in on:
        return
    mine = Path(case["paths"][rank] if "paths" in case else case["path"])
    if fault in ("replace", "rewrite_scale", "nan_scale_keep_mtime", "nan_codes"):
        real = api.agree_or_raise

        def agree_then_change(*args, **kwargs):
            real(*args, **kwargs)  # the ranks agreed on what they validated; now the files change
            if fault == "replace":  # a re-sync: a new file renamed over the validated one
                shutil.copyfile(Path(case["other"]) / S1, mine / f"{S1}.partial")
                os.replace(mine / f"{S1}.partial", mine / S1)
            elif fault == "rewrite_scale":
                set_scalar(mine / S3, "layers.0.up.weight_scale", float("nan"))
            elif fault == "nan_scale_keep_mtime":
                st = os.stat(mine / S3)
                set_scalar(mine / S3, "layers.0.up.weight_scale", float("nan"))
                os.utime(mine / S3, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                _nan_codes_in_last_row(mine, "layers.0.up.weight")

        stack.enter_context(mock.patch.object(api, "agree_or_raise", agree_then_change))
    elif fault == "slow_open":
        real_open = composed.open_checkpoint
        stack.enter_context(
            mock.patch.object(composed, "open_checkpoint", lambda p: (_slow(case, slept), real_open(p))[1])
        )
    elif fault == "slow_read":
        real_read = read_schedule.read_request

        def slow(*args, **kwargs):
            if not slept:  # the first read only
                _slow(case, slept)
            return real_read(*args, **kwargs)

        stack.enter_context(mock.patch.object(read_schedule, "read_request", slow))


def _model_fn(rank: int, case: dict, built: list):
    def model_fn(config):
        model = UnevenModel()
        if case.get("extra_module_on") == rank:
            model.extra = torch.nn.Linear(HIDDEN, 3, bias=False).to(torch.bfloat16)
        built.append(model)
        return model

    return model_fn


def _state(model) -> dict:
    """Which modules still compute, how much storage the model holds, and its output."""
    if model is None:
        return {"built": False}
    return {"built": True, **what_still_runs(model), "on_meta": all(p.is_meta for p in model.parameters())}


def _attempt(rank: int, world: int, case: dict) -> dict:
    import torch.distributed as dist

    from fsdp_fp8 import CheckpointError, load_model

    path = case["paths"][rank] if "paths" in case else case["path"]
    built: list = []
    groups = []
    real_gather = dist.all_gather_object

    def recording_gather(out, obj, group=None):
        groups.append(group)
        return real_gather(out, obj, group=group)

    record: dict = {"error": None}
    slept: list = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "all_gather_object", recording_gather))
        _fault(rank, case, stack, slept)
        t0 = time.monotonic()
        try:
            loaded = load_model(
                _model_fn(rank, case, built),
                path,
                device=torch.device("cpu"),
                strict=case.get("strict", True),
                **case.get("kwargs", {}),
            )
        except CheckpointError as exc:
            record["error"] = ("CheckpointError", str(exc), exc.problems)
        except Exception as exc:  # noqa: BLE001 - judged by the tests
            record["error"] = (type(exc).__name__, str(exc), None)
        record["seconds"] = time.monotonic() - t0
    if rank == 0:
        Path(case["ended"]).touch()  # a slow rank 1 need not sleep on
    record["slept"] = max(slept, default=0.0)  # reads run on threads: several may have slept at once
    record["groups"] = ["default" if g is None or g is dist.group.WORLD else dist.get_backend(g) for g in groups]
    if record["error"] is None:
        with torch.no_grad():
            out = loaded.model(torch.linspace(-1, 1, 2 * HIDDEN).reshape(1, 2, HIDDEN).to(torch.bfloat16))
        record["output"] = out.float()
        record["scale"] = float(loaded.model.layers[0].up.weight._local_tensor.scale.reshape(()))
    else:
        record["model"] = _state(built[-1] if built else None)
    return record


def _walk(rank: int, world: int, cases: list[dict]) -> dict:
    return {case["name"]: _attempt(rank, world, case) for case in cases}


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    good = write_uneven_checkpoint(root / "good")
    other = write_uneven_checkpoint(root / "other", seed=1)  # the same headers, other bytes
    assert (good / S1).read_bytes()[:64] == (other / S1).read_bytes()[:64]

    def copies(name: str, edit=None) -> list[str]:
        out = []
        for rank in range(2):
            d = root / f"{name}-rank{rank}"
            shutil.copytree(good, d)
            if edit is not None:
                edit(rank, d)
            out.append(str(d))
        return out

    def on_rank1(edit):
        return lambda rank, d: edit(d) if rank == 1 else None

    def config_note(d):
        (d / "config.json").write_text(json.dumps({"model_type": "test", "note": "node-b"}))

    def producer(d):
        q = json.loads((d / "hf_quant_config.json").read_text())
        q["producer"]["version"] = "0.47.1"
        (d / "hf_quant_config.json").write_text(json.dumps(q))

    def index_metadata(d):
        weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        write_index(d, weight_map)
        obj = json.loads((d / "model.safetensors.index.json").read_text())
        obj["metadata"] = {"total_size": 1}
        (d / "model.safetensors.index.json").write_text(json.dumps(obj))

    k = slowdown()
    timeout_s, slow_s = TIMEOUT_S * k, SLOW_S * k
    fast = {"timeout_s": timeout_s}
    cases = [
        {"name": "good", "path": str(good)},
        {"name": "shard replaced on rank 1", "paths": copies("replace1"), "fault": "replace", "other": str(other)},
        {
            "name": "shard replaced on every rank",
            "paths": copies("replace-all"),
            "fault": "replace",
            "other": str(other),
            "on": [0, 1],
        },
        {"name": "scale rewritten on every rank", "paths": copies("scale-all"), "fault": "rewrite_scale", "on": [0, 1]},
        {
            "name": "scale rewritten on rank 1, mtime kept",
            "paths": copies("scale-kept"),
            "fault": "nan_scale_keep_mtime",
        },
        {"name": "NaN codes in rank 1's rows", "paths": copies("codes"), "fault": "nan_codes"},
        {"name": "config.json differs on rank 1", "paths": copies("config", on_rank1(config_note))},
        {"name": "hf_quant_config.json differs on rank 1", "paths": copies("quant", on_rank1(producer))},
        {"name": "index differs on rank 1", "paths": copies("index", on_rank1(index_metadata))},
        {"name": "model differs on rank 1, strict=False", "path": str(good), "strict": False, "extra_module_on": 1},
        {
            "name": "rank 1 slow before the agreement",
            "path": str(good),
            "fault": "slow_open",
            "sleep": slow_s,
            "kwargs": fast,
        },
        # Rank 0 gave up while rank 1 still slept: the next load's agreement group waits for it.
        {"name": "good after a slow rank", "path": str(good)},
        {
            "name": "rank 1 slow during the load",
            "path": str(good),
            "fault": "slow_read",
            "sleep": slow_s,
            "kwargs": fast,
        },
        # The wait for the outcome is the base timeout plus the forecast bytes at the assumed rate:
        # ~500 bytes per rank at 150 B/s gives the slow rank ~3 s more than TIMEOUT_S. Rank 0 waits
        # for it, so rank 1 sleeps the whole 2 s (x slowdown).
        {"name": "good after another slow rank", "path": str(good)},
        {
            "name": "rank 1 slow within the forecast",
            "path": str(good),
            "fault": "slow_read",
            "sleep": 2.0 * k,
            "kwargs": fast,
            "slow_storage": 150.0 / k,
        },
        {"name": "good again", "path": str(good)},
    ]
    for i, case in enumerate(cases):
        case["ended"] = str(root / f"ended-{i}")  # rank 0 marks its attempt at the case over
    results = run_ranks(_walk, 2, cases, timeout=240, pg_timeout=60)
    return {"ranks": results, "cases": {c["name"]: c for c in cases}, "timeout_s": timeout_s, "slow_s": slow_s}


def _records(observed, name) -> list[dict]:
    return [ranks[name] for ranks in observed["ranks"]]


def _assert_dead(record: dict) -> None:
    """No module computes, nothing is held."""
    model = record["model"]
    assert model["built"] and model["computing"] == [] and model["held_bytes"] == 0, model


def test_clean_loads_use_the_gloo_side_group_and_agree(observed):
    for name in ("good", "good after a slow rank", "good after another slow rank", "good again"):
        outputs = []
        for record in _records(observed, name):
            assert record["error"] is None, record["error"]
            assert record["groups"] == ["gloo", "gloo"], record["groups"]  # never the default group
            outputs.append(record["output"])
        assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(
    "case, ranks, needle",
    [
        ("shard replaced on rank 1", [1], f"{S1} was replaced after it was validated"),
        ("shard replaced on every rank", [0, 1], f"{S1} was replaced after it was validated"),
        ("scale rewritten on every rank", [0, 1], f"{S3} was rewritten in place after it was validated"),
        (
            "NaN codes in rank 1's rows",
            [1],
            "`layers.0.up.weight` in model-00001-of-00003.safetensors holds 16 FP8 codes that are NaN in E4M3",
        ),
    ],
)
def test_what_changed_after_validation_fails_the_load_on_every_rank(observed, case, ranks, needle):
    texts = []
    for record in _records(observed, case):
        kind, text, _ = record["error"]
        assert kind == "LoadFailedError", record["error"]
        assert text.startswith(f"checkpoint load failed on {len(ranks)} of 2 ranks: "), text
        for rank in ranks:
            # one rank's problem, or the same problem found by both (printed once, `all 2 ranks:`)
            label = f"rank {rank}: " if f"rank {rank}: " in text else "all 2 ranks: "
            assert f"{label}CheckpointError" in text and needle in text.split(label, 1)[1], text
        assert record["seconds"] < bound(REFUSE_WITHIN_S)
        _assert_dead(record)
        texts.append(text)
    assert texts[0] == texts[1]


def test_a_scale_rewritten_in_place_is_never_read_again(observed):
    """The rewrite kept size and mtime, so nothing can tell the file changed: the value that was
    validated is the one loaded, on both ranks, and the output is the clean one."""
    good = _records(observed, "good")
    for rank, record in enumerate(_records(observed, "scale rewritten on rank 1, mtime kept")):
        assert record["error"] is None, record["error"]
        assert record["scale"] == good[rank]["scale"] and torch.equal(record["output"], good[rank]["output"])


@pytest.mark.parametrize(
    "case, needle",
    [
        (
            "config.json differs on rank 1",
            'ranks disagree on config.json: `note` differs: rank 0: (absent); rank 1: "node-b"',
        ),
        (
            "hf_quant_config.json differs on rank 1",
            'ranks disagree on hf_quant_config.json: `producer.version` differs: rank 0: "0.47.0"; rank 1: "0.47.1"',
        ),
        (
            "index differs on rank 1",
            "ranks disagree on model.safetensors.index.json: `metadata.total_size` differs: rank 0: (absent); rank 1: 1",
        ),
        (
            "model differs on rank 1, strict=False",
            "ranks disagree on model structure: `parameter extra.weight` differs: rank 0: (absent); "
            "rank 1: (3, 16) torch.bfloat16",
        ),
    ],
)
def test_ranks_that_read_or_build_different_things_refuse_before_any_change(observed, case, needle):
    verdicts = []
    for record in _records(observed, case):
        kind, text, problems = record["error"]
        assert kind == "CheckpointError", record["error"]
        assert needle in problems, problems
        assert record["seconds"] < bound(REFUSE_WITHIN_S)
        assert record["model"]["on_meta"] and record["model"]["computing"] == []  # untouched, and inert
        verdicts.append(problems)
    assert verdicts[0] == verdicts[1]
    if case.startswith("model"):
        assert any("ranks disagree on load plan" in p and "`missing extra.weight`" in p for p in verdicts[0])


def test_a_rank_slower_than_the_agreement_timeout_is_named_by_every_other_rank(observed):
    early, late = _records(observed, "rank 1 slow before the agreement")
    kind, text, _ = early["error"]
    timeout_s, slow_s = observed["timeout_s"], observed["slow_s"]
    assert kind == "PeerLostError" and f"rank(s) [1] did not arrive within {timeout_s:g} s (the agreement" in text, text
    assert "nothing was changed" in text and timeout_s <= early["seconds"] < slow_s, early["seconds"]
    kind, text, _ = late["error"]
    assert kind == "PeerLostError" and "after rank(s) [0] had given up waiting for it" in text, text
    assert late["seconds"] < slow_s + bound(REFUSE_WITHIN_S)
    assert late["seconds"] - late["slept"] < timeout_s  # once it arrived, it did not wait a timeout of its own
    for record in (early, late):
        assert record["model"]["computing"] == []


def test_a_rank_slow_during_the_load_is_named_and_every_model_is_dead(observed):
    early, late = _records(observed, "rank 1 slow during the load")
    kind, text, _ = early["error"]
    assert kind == "PeerLostError" and text.startswith(
        "checkpoint load failed: rank 0 could not complete the agreement on the outcome of the load"
    ), text
    assert "rank(s) [1] did not arrive within" in text and early["seconds"] < observed["slow_s"], (
        text,
        early["seconds"],
    )
    assert late["error"][0] == "PeerLostError"
    for record in (early, late):
        _assert_dead(record)


def test_the_outcome_wait_is_sized_from_the_read_forecast(observed):
    # Rank 1 is later than TIMEOUT_S, but not later than the forecast allows at slow storage.
    for record in _records(observed, "rank 1 slow within the forecast"):
        assert record["error"] is None, record["error"]
