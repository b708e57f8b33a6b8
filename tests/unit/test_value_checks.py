"""Values that pass "finite and positive" but build garbage are refused, naming file, key and value.

Scales: a subnormal float32 (every code dequantizes to about zero: a zero layer that looks
loaded) and one so large that ``448 * scale`` overflows float32. Configs: a non-finite number
anywhere (Python's JSON reads ``1e999`` as inf and accepts ``NaN``), and a model field such as
``rms_norm_eps`` / ``rope_theta`` that is not a number > 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from ckpt_writer import set_scalar
from small_models import FIXTURE, write_uneven_checkpoint

from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.models import MoTConfig

S3 = "model-00003-of-00003.safetensors"  # every scale of the uneven checkpoint


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("layers.0.up.weight_scale", 1e-40, "a subnormal float32"),
        ("layers.1.gate.input_scale", 2e-45, "a subnormal float32"),
        ("layers.0.down.weight_scale", 1e36, "448 * scale overflows float32"),
        ("layers.1.up.input_scale", 3.0e38, "448 * scale overflows float32"),
    ],
)
def test_scales_that_make_garbage_are_refused(tmp_path, key, value, needle):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    set_scalar(d / S3, key, value)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(d)
    (problem,) = info.value.problems
    assert problem.startswith(f"`{key}` in {S3} is ") and needle in problem, problem


def test_the_largest_and_smallest_usable_scales_load(tmp_path):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    tiny, big = 1.1754943508222875e-38, 7.5e35  # the smallest normal float32; 448 * big < float32 max
    set_scalar(d / S3, "layers.0.up.weight_scale", tiny)
    set_scalar(d / S3, "layers.0.down.weight_scale", big)
    with open_checkpoint(d) as ckpt:
        assert ckpt.scales["layers.0.up.weight_scale"] == tiny
        assert math.isclose(ckpt.scales["layers.0.down.weight_scale"], big, rel_tol=1e-7)


def _float32_neighbours_of_the_overflow() -> tuple[float, float]:
    """The largest float32 scale whose ``448 * scale`` float32 rounds to a finite value, and the
    next float32 up, found by float32 arithmetic itself (torch), not by the rule under test."""
    below = torch.tensor(torch.finfo(torch.float32).max / 448, dtype=torch.float32)
    up = torch.tensor(float("inf"), dtype=torch.float32)
    while torch.isinf(below * 448):  # float32 max / 448 may round to a scale that overflows
        below = torch.nextafter(below, -up)
    while not torch.isinf(torch.nextafter(below, up) * 448):
        below = torch.nextafter(below, up)
    return float(below), float(torch.nextafter(below, up))


def test_the_overflow_check_is_float32s_own_rounding_at_the_boundary(tmp_path):
    finite, overflows = _float32_neighbours_of_the_overflow()
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    set_scalar(d / S3, "layers.0.down.weight_scale", finite)
    with open_checkpoint(d) as ckpt:
        assert ckpt.scales["layers.0.down.weight_scale"] == finite
    set_scalar(d / S3, "layers.0.down.weight_scale", overflows)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(d)
    (problem,) = info.value.problems
    assert "448 * scale overflows float32" in problem, problem


def _llama(tmp_path, text_edit) -> str:
    d = tmp_path / "llama"
    shutil.copytree(FIXTURE, d)
    (d / "config.json").write_text(text_edit((d / "config.json").read_text()))
    return d


@pytest.mark.parametrize(
    "field, spelled, shown",
    [
        ("rms_norm_eps", "0", "is 0; it must be a number > 0"),
        ("rms_norm_eps", "-1e-06", "is -1e-06; it must be a number > 0"),
        ("rope_parameters.rope_theta", "1e999", "is inf; numbers must be finite"),
        ("rope_parameters.rope_theta", "NaN", "is nan; numbers must be finite"),
        ("rope_parameters.rope_theta", '"10000"', "is '10000'; it must be a number > 0"),
    ],
)
def test_config_fields_the_model_is_built_from_must_be_finite_and_positive(tmp_path, field, spelled, shown):
    def edit(text):
        obj = json.loads(text)
        *outer, leaf = field.split(".")
        node = obj
        for part in outer:
            node = node[part]
        assert leaf in node  # the fixture really has the field
        node[leaf] = "@"
        return json.dumps(obj).replace('"@"', spelled)

    with pytest.raises(CheckpointError) as info:
        open_checkpoint(_llama(tmp_path, edit))
    assert info.value.problems == [f"config.json: field `{field}` {shown}"]


def test_a_non_finite_number_anywhere_in_a_config_is_named_by_its_path(tmp_path):
    def edit(text):
        obj = json.loads(text)
        obj["rope_scaling"] = {"factor": "@"}
        return json.dumps(obj).replace('"@"', "-Infinity")

    with pytest.raises(CheckpointError) as info:
        open_checkpoint(_llama(tmp_path, edit))
    assert info.value.problems == ["config.json: field `rope_scaling.factor` is -inf; numbers must be finite"]


@pytest.mark.parametrize(
    "field, value", [("rms_eps", float("nan")), ("rms_eps", math.inf), ("rope_theta", math.inf), ("rope_theta", 0.0)]
)
def test_reference_model_config_refuses_non_finite_and_non_positive_fields(field, value):
    base = MoTConfig(
        hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=88, vocab_size=100, latent_channels=6
    )
    with pytest.raises(ValueError, match=f"`{field}` must be a finite number > 0, got {value!r}"):
        MoTConfig(**{**base.__dict__, field: value})


@pytest.mark.parametrize(
    "path",
    ["in place", "in place, 2-byte requests", "staged", "in place, O_DIRECT, 2-byte requests", "staged, O_DIRECT"],
)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_codes_that_are_nan_in_e4m3_are_refused_after_the_read(tmp_path, monkeypatch, code, path):
    """ModelOpt saturates to +-448 and never writes the NaN patterns: the loader checks the codes
    it has just read, in the same pass, and the load fails naming the tensor and the count.
    In place, the reader's workers check each request as it lands (2-byte requests: the three
    codes arrive in different reads and are counted together); staged (through the ring, as onto
    an accelerator), the codes are checked where they end up."""
    import functools

    from ckpt_writer import read_raw
    from small_models import uneven_model_fn

    from fsdp_fp8 import LoadFailedError, ModelUnusableError, load_model
    from fsdp_fp8.load import reader
    from fsdp_fp8.reading.read_options import ReadOptions

    options = ReadOptions()
    if path == "staged":
        monkeypatch.setattr(reader, "_load_local", functools.partial(reader._load_local, stage_cpu=True))
    if "2-byte" in path:
        options = ReadOptions(request_bytes=2)
    if "O_DIRECT" in path:  # (a file system refusing it refuses the load: test_direct_reads covers that)
        options = dataclasses.replace(options, direct=True)

    d = write_uneven_checkpoint(tmp_path / "ckpt")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = d / index["layers.1.down.weight"]
    header, _ = read_raw(shard)
    n = int.from_bytes(shard.read_bytes()[:8], "little")
    begin = header["layers.1.down.weight"]["data_offsets"][0]
    with open(shard, "r+b") as f:  # three codes of row 0
        f.seek(8 + n + begin)
        f.write(bytes([code, 0x10, code, code]))
    built = []
    with pytest.raises(LoadFailedError) as info:
        load_model(
            lambda c: built.append(uneven_model_fn(c)) or built[-1], d, device=torch.device("cpu"), read_options=options
        )
    (problem,) = info.value.problems
    assert (
        problem.startswith("rank 0: CheckpointError: ")
        and (f"`layers.1.down.weight` in {shard.name} holds 3 FP8 codes that are NaN in E4M3") in problem
    ), problem
    with pytest.raises(ModelUnusableError):
        built[0].layers[1].down(torch.zeros(1, 7, dtype=torch.bfloat16))
