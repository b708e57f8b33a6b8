"""Every way open_checkpoint refuses a checkpoint, each on a small checkpoint written here."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ckpt_writer import (
    edit_header,
    nested_config,
    read_raw,
    set_scalar,
    small_tensors,
    write_checkpoint,
    write_index,
    write_raw,
)

from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.safetensors_header import MAX_HEADER_BYTES

SHARDS = [
    ["layers.0.up.weight", "norm.weight"],
    [
        "layers.0.up.weight_scale",
        "layers.0.up.input_scale",
        "layers.0.down.weight",
        "layers.0.down.weight_scale",
        "layers.0.down.input_scale",
        "lm_head.weight",
    ],
]
S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def refused(path) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    return info.value.problems


def one(problems: list[str], *needles: str) -> str:
    """The single problem mentioning every needle (asserting there is one)."""
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, f"{needles} not found exactly once in {problems}"
    return hits[0]


@pytest.fixture
def single(tmp_path):
    return write_checkpoint(tmp_path, small_tensors())


@pytest.fixture
def sharded(tmp_path):
    return write_checkpoint(tmp_path, small_tensors(), shards=SHARDS)


# --- safetensors headers -------------------------------------------------------------------


def _corrupt(path, edit):
    header, data = read_raw(path / "model.safetensors")
    edit(header)
    write_raw(path / "model.safetensors", header, data)


HEADER_CASES = {
    "unknown dtype": (lambda h: h["norm.weight"].update(dtype="BF8"), ["`norm.weight`", "unknown dtype 'BF8'"]),
    "negative dim": (lambda h: h["norm.weight"].update(shape=[-16]), ["`norm.weight`", "not a list of non-negative"]),
    "float dim": (lambda h: h["norm.weight"].update(shape=[16.0]), ["`norm.weight`", "not a list of non-negative"]),
    "shape not list": (lambda h: h["norm.weight"].update(shape="16"), ["`norm.weight`", "not a list of non-negative"]),
    "bytes != range": (
        lambda h: h["norm.weight"].update(shape=[8, 2, 2]),
        ["`norm.weight`", "needs 64 bytes", "span 32"],
    ),
    "extra field": (lambda h: h["norm.weight"].update(crc=1), ["`norm.weight`", "unknown fields ['crc']"]),
    "missing field": (lambda h: h["norm.weight"].pop("shape"), ["`norm.weight`", "missing fields ['shape']"]),
    "bad offsets": (lambda h: h["norm.weight"].update(data_offsets=[5]), ["`norm.weight`", "data_offsets [5]"]),
    "bad metadata": (lambda h: h.update(__metadata__={"format": 1}), ["model.safetensors", "__metadata__"]),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_bad_header_entry(single, case):
    edit, needles = HEADER_CASES[case]
    _corrupt(single, edit)
    assert "model.safetensors" in one(refused(single), *needles)


def _shift(header, key, delta):
    begin, end = header[key]["data_offsets"]
    header[key]["data_offsets"] = [begin + delta, end + delta]


def test_overlapping_ranges(single):
    header, data = read_raw(single / "model.safetensors")
    last = max(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1)[0]
    _shift(header, last, -2)
    write_raw(single / "model.safetensors", header, data[:-2])
    one(refused(single), f"`{last}`", "overlaps")


def test_gap_between_ranges(single):
    header, data = read_raw(single / "model.safetensors")
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    _shift(header, last, 4)
    write_raw(single / "model.safetensors", header, data + b"\0" * 4)
    one(refused(single), f"`{last}`", "4 unaccounted bytes before it")


def test_truncated_data(single):
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    one(refused(single), "model.safetensors: truncated", "file has")


def test_trailing_bytes(single):
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"xyz")
    one(refused(single), "model.safetensors: 3 trailing bytes")


def test_header_length_larger_than_file(single):
    header, data = read_raw(single / "model.safetensors")
    write_raw(single / "model.safetensors", header, data, header_len=10**6)
    one(refused(single), "model.safetensors: header length 1000000 is larger than the file")


def test_header_length_over_cap(single):
    header, data = read_raw(single / "model.safetensors")
    write_raw(single / "model.safetensors", header, data, header_len=MAX_HEADER_BYTES + 1)
    one(refused(single), "model.safetensors", "exceeds", "cap")


def test_file_shorter_than_length_prefix(single):
    (single / "model.safetensors").write_bytes(b"\x01\x02")
    one(refused(single), "model.safetensors: truncated", "8-byte")


@pytest.mark.parametrize(
    "text, needle",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"a": 1, "a": 2}', "duplicate key `a`"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_header_not_a_json_object(single, text, needle):
    write_raw(single / "model.safetensors", text, b"")
    one(refused(single), "model.safetensors header", needle)


# --- directory layout and index ------------------------------------------------------------


def _remap(path, key, value):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map[key] = value
    write_index(path, weight_map)


def test_index_names_missing_file(sharded):
    _remap(sharded, "norm.weight", "model-00003-of-00002.safetensors")
    found = refused(sharded)
    one(found, "model.safetensors.index.json", "'model-00003-of-00002.safetensors'", "does not exist")


@pytest.mark.parametrize(
    "name, needle",
    [
        ("/etc/passwd.safetensors", "absolute path"),
        ("../x.safetensors", "uses '..'"),
        ("sub/x.safetensors", "not a plain file name"),
        ("pytorch_model.bin", "not a .safetensors file"),
    ],
)
def test_index_names_unsafe_path(sharded, name, needle):
    _remap(sharded, "norm.weight", name)
    one(refused(sharded), "model.safetensors.index.json", repr(name), needle)


def test_symlink_leaving_directory(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", small_tensors(), shards=SHARDS)
    outside = tmp_path / "outside.safetensors"
    os.replace(ckpt / S1, outside)
    os.symlink(outside, ckpt / S1)
    one(refused(ckpt), repr(S1), "symlink", "outside")


def test_symlink_inside_directory_is_followed(tmp_path):
    ckpt = write_checkpoint(tmp_path, small_tensors(), shards=SHARDS)
    os.replace(ckpt / S1, ckpt / "real.safetensors.data")
    os.symlink("real.safetensors.data", ckpt / S1)
    assert "norm.weight" in open_checkpoint(ckpt).high_precision


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{oops", "not valid JSON"),
        ('{"metadata": {}}', "`weight_map` is missing"),
        ('{"weight_map": []}', "`weight_map` is missing"),
        ("[]", "not a JSON object"),
    ],
)
def test_bad_index(sharded, text, needle):
    (sharded / "model.safetensors.index.json").write_text(text)
    one(refused(sharded), "model.safetensors.index.json", needle)


def test_indexed_key_absent_from_its_shard(sharded):
    _remap(sharded, "norm.weight", S2)
    one(refused(sharded), "`norm.weight`", f"maps it to {S2}", "no such tensor", S1)


def test_key_in_two_shards(tmp_path):
    t = small_tensors()
    ckpt = write_checkpoint(tmp_path, t, shards=[SHARDS[0], SHARDS[1] + ["norm.weight"]])
    _remap(ckpt, "norm.weight", S1)
    one(refused(ckpt), "`norm.weight`", "several shards", S1, S2)


def test_shard_key_not_in_index(sharded):
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    del weight_map["lm_head.weight"]
    write_index(sharded, weight_map)
    one(refused(sharded), f"`lm_head.weight` in {S2} is not listed in model.safetensors.index.json")


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    one(refused(tmp_path), "no safetensors checkpoint")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "sd.ckpt"])
def test_pickle_refused_and_never_opened(tmp_path, name, monkeypatch):
    import pickle

    (tmp_path / name).write_bytes(b"not even a pickle")
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    one(refused(tmp_path), "only pickle checkpoint files", name, "never unpickled")


def test_unrecognised_safetensors_name(tmp_path):
    write_checkpoint(tmp_path, small_tensors(), stem="weights")
    one(refused(tmp_path), "['weights.safetensors']", "no model.safetensors")


def test_ambiguous_single_and_index(sharded):
    write_checkpoint(sharded, small_tensors())
    one(refused(sharded), "ambiguous", "model.safetensors.index.json", "'model.safetensors'")


# --- FP8 tensors and scales ----------------------------------------------------------------


def _without(key):
    t = small_tensors()
    del t[key]
    return t


@pytest.mark.parametrize("suffix", ["weight_scale", "input_scale"])
def test_fp8_weight_without_scale(tmp_path, suffix):
    path = write_checkpoint(tmp_path, _without(f"layers.0.up.{suffix}"))
    one(refused(path), "`layers.0.up.weight` in model.safetensors is F8_E4M3", f"`layers.0.up.{suffix}` is missing")


@pytest.mark.parametrize(
    "value, needle",
    [
        (torch.tensor(0.01, dtype=torch.bfloat16), "got BF16 shape ()"),
        (torch.tensor([0.01, 0.02]), "got F32 shape (2,)"),
        (torch.tensor(1, dtype=torch.int32), "got I32 shape ()"),
    ],
)
def test_scale_wrong_dtype_or_size(tmp_path, value, needle):
    t = small_tensors()
    t["layers.0.down.input_scale"] = value
    path = write_checkpoint(tmp_path, t)
    one(refused(path), "`layers.0.down.input_scale` in model.safetensors", "exactly one element", needle)


def test_one_element_scale_of_any_shape_is_accepted(tmp_path):
    t = small_tensors()
    t["layers.0.down.weight_scale"] = torch.tensor([[0.5]])
    ckpt = open_checkpoint(write_checkpoint(tmp_path, t))
    assert ckpt.fp8_modules["layers.0.down"].weight_scale.shape == (1, 1)


@pytest.mark.parametrize("value", [0.0, -0.5, float("inf"), float("nan")])
def test_scale_value_must_be_finite_and_positive(single, value):
    set_scalar(single / "model.safetensors", "layers.0.up.weight_scale", value)
    one(refused(single), "`layers.0.up.weight_scale` in model.safetensors is", "finite and > 0")


def test_fp8_weight_not_2d(tmp_path):
    t = small_tensors()
    t["layers.0.up.weight"] = t["layers.0.up.weight"].reshape(24, 4, 4)
    one(refused(write_checkpoint(tmp_path, t)), "`layers.0.up.weight`", "shape (24, 4, 4)", "2-D")


def test_scales_without_weight(tmp_path):
    t = small_tensors()
    t["orphan.weight_scale"] = torch.tensor(0.1)
    one(refused(write_checkpoint(tmp_path, t)), "`orphan.weight_scale`", "without a `orphan.weight`")


def test_scales_for_high_precision_weight(tmp_path):
    t = small_tensors()
    t["lm_head.input_scale"] = torch.tensor(0.1)
    one(refused(write_checkpoint(tmp_path, t)), "`lm_head.input_scale`", "stored as BF16, not F8_E4M3")


def test_e5m2_weight(tmp_path):
    t = small_tensors()
    t["layers.0.up.weight"] = t["layers.0.up.weight"].float().to(torch.float8_e5m2)
    found = refused(write_checkpoint(tmp_path, t))
    one(found, "`layers.0.up.weight` in model.safetensors is F8_E5M2")


def test_fp8_tensor_that_is_not_a_weight(tmp_path):
    t = small_tensors()
    t["norm.weight"] = t["norm.weight"].to(torch.float8_e4m3fn)
    t["norm.bias"] = torch.zeros(16, dtype=torch.float8_e4m3fn)
    one(refused(write_checkpoint(tmp_path, t)), "`norm.bias`", "not a linear `.weight`")


def test_fp8_without_modelopt_config(tmp_path):
    found = refused(write_checkpoint(tmp_path, small_tensors(), quant=None))
    assert len(found) == 2
    one(found, "`layers.0.up.weight`", "F8_E4M3", "no ModelOpt FP8 quantization config")


def test_foreign_modelopt_tensor(tmp_path):
    t = small_tensors()
    t["layers.0.up.pre_quant_scale"] = torch.ones(16)
    one(refused(write_checkpoint(tmp_path, t)), "`layers.0.up.pre_quant_scale`", "other than static per-tensor FP8")


def test_kv_scales_need_kv_config_and_vice_versa(tmp_path):
    t = {**small_tensors(), "attn.k_proj.k_scale": torch.tensor(1.0), "attn.v_proj.v_scale": torch.tensor(1.0)}
    one(refused(write_checkpoint(tmp_path / "a", t)), "KV-cache scales", "kv_cache_quant_algo is null")
    one(
        refused(write_checkpoint(tmp_path / "b", small_tensors(), hf_quant=nested_config(kv="FP8"))),
        "kv_cache_quant_algo FP8",
        "no `*.k_scale`",
    )
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", t, hf_quant=nested_config(kv="FP8")))
    assert set(ckpt.kv_scales) == {"attn.k_proj.k_scale", "attn.v_proj.v_scale"}
    assert not set(ckpt.kv_scales) & set(ckpt.high_precision)
    t["attn.v_proj.v_scale"] = torch.tensor(-1.0)
    one(
        refused(write_checkpoint(tmp_path / "d", t, hf_quant=nested_config(kv="FP8"))),
        "`attn.v_proj.v_scale`",
        "finite and > 0",
    )


def test_every_problem_reported_at_once(tmp_path):
    t = small_tensors()
    del t["layers.0.up.input_scale"]
    t["layers.0.down.weight_scale"] = torch.tensor(0.0)
    t["bad.weight"] = torch.zeros(2, 2, dtype=torch.float8_e5m2)
    path = write_checkpoint(tmp_path, t, shards=[list(t)[:3], list(t)[3:]])
    edit_header(path / S1, lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype="F7"))
    found = refused(path)
    assert found == sorted(found) and len(found) >= 4
    one(found, "`layers.0.up.input_scale` is missing")
    one(found, "`layers.0.down.weight_scale`", "finite and > 0")
    one(found, "`bad.weight`", "F8_E5M2")
    one(found, "unknown dtype 'F7'")


# --- accepted layouts ----------------------------------------------------------------------


def test_diffusers_pipeline_root_and_sharded_diffusion_names(tmp_path):
    t = small_tensors()
    write_checkpoint(
        tmp_path / "transformer", t, shards=[list(t)[:4], list(t)[4:]], quant="config", stem="diffusion_pytorch_model"
    )
    (tmp_path / "model_index.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.directory == tmp_path / "transformer"
    assert ckpt.index_file == "diffusion_pytorch_model.safetensors.index.json"
    assert set(ckpt.fp8_modules) == {"layers.0.up", "layers.0.down"}


def test_single_diffusion_file(tmp_path):
    ckpt = open_checkpoint(write_checkpoint(tmp_path, small_tensors(), stem="diffusion_pytorch_model"))
    assert list(ckpt.files) == ["diffusion_pytorch_model.safetensors"]


def test_ignored_module_stored_fp8_is_still_fp8(tmp_path, caplog):
    path = write_checkpoint(tmp_path, small_tensors(), hf_quant=nested_config(ignore=["layers.0.u*"]))
    ckpt = open_checkpoint(path)
    assert "layers.0.up" in ckpt.fp8_modules and ckpt.quant.is_ignored("layers.0.up")
    assert "`layers.0.up` matches the ignore list" in caplog.text


def test_plain_checkpoint_is_all_high_precision(tmp_path):
    t = {"a.weight": torch.zeros(3, 2, dtype=torch.bfloat16), "a.weight_scale": torch.tensor(1.0)}
    ckpt = open_checkpoint(write_checkpoint(tmp_path, t, quant=None))
    assert not ckpt.quant.is_modelopt_fp8 and ckpt.fp8_modules == {}
    assert set(ckpt.high_precision) == set(t)


def test_missing_directory():
    with pytest.raises(FileNotFoundError):
        open_checkpoint("/nonexistent/checkpoint")


def _hub_snapshot(tmp_path):
    """A Hugging Face cache repo: files once in blobs/, snapshot entries link to them."""
    repo = tmp_path / "hub" / "models--org--tiny"
    written = write_checkpoint(tmp_path / "export", small_tensors(), shards=SHARDS)
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(written.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        os.replace(f, blob)
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    return repo, snapshot


def test_hub_cache_snapshot_links_into_its_blobs_are_followed(tmp_path):
    _, snapshot = _hub_snapshot(tmp_path)
    assert "norm.weight" in open_checkpoint(snapshot).high_precision


def test_hub_cache_snapshot_link_elsewhere_is_still_refused(tmp_path):
    repo, snapshot = _hub_snapshot(tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    os.replace((snapshot / S1).resolve(), elsewhere)
    (snapshot / S1).unlink()
    os.symlink(elsewhere, snapshot / S1)
    one(refused(snapshot), repr(S1), "symlink", "outside")
