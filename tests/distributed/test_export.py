"""The static-FP8 exporter and the cached demo pipeline, checked against the format (docs/checkpoint-format.md)."""

from __future__ import annotations

import fnmatch
import json
import multiprocessing
import os
import re
from pathlib import Path

import pytest
import torch
from calibration import bound
from safetensors import safe_open

from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, export_bf16, export_fp8
from fsdp_fp8.generation.demo import DEMO_STEP_POLICY, demo_checkpoint
from fsdp_fp8.models import PRESETS, build_model, init_weights, linear_towers
from fsdp_fp8.runtime.sampler import sample

FIXTURE = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-llama-sharded"
STEM = "diffusion_pytorch_model"


def tiny():
    return init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)


def calibrate(model):
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    sample(model, ids, steps=2, seed=0, num_latent_tokens=5)


def export(model, directory, **kwargs):
    kwargs.setdefault("calibrate", calibrate)
    return export_fp8(model, directory, config=model.config.to_config_dict(), **kwargs)


def read_all(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """Every tensor, its safetensors dtype string, and the file it came from."""
    tensors, dtypes, where = {}, {}, {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                assert key not in tensors, f"`{key}` stored twice"
                tensors[key], where[key] = f.get_tensor(key), path.name
                dtypes[key] = f.get_slice(key).get_dtype()
    return tensors, dtypes, where


def recorded_input_amax(model, names) -> dict[str, torch.Tensor]:
    """Our own hooks, to check the exporter's calibration independently."""
    amax = {}

    def record(name, x):
        amax[name] = torch.maximum(amax.get(name, torch.tensor(0.0)), x.abs().max().float())

    handles = [
        model.get_submodule(n).register_forward_pre_hook(lambda _m, args, n=n: record(n, args[0])) for n in names
    ]
    calibrate(model)
    for h in handles:
        h.remove()
    return amax


def test_codes_and_scales_follow_format(tmp_path):
    model = tiny()
    export(model, tmp_path)
    tensors, dtypes, _ = read_all(tmp_path)
    towers = linear_towers(model)
    quantized = sorted(n for n in towers if not any(fnmatch.fnmatchcase(n, p) for p in DEFAULT_IGNORE))
    assert len(quantized) == 28
    amax = recorded_input_amax(model, quantized)
    for name in quantized:
        w = model.get_submodule(name).weight.detach().float()
        scale = w.abs().max() / 448
        codes = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert dtypes[f"{name}.weight"] == "F8_E4M3"
        assert torch.equal(tensors[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8)), name
        for suffix, expected in (("weight_scale", scale), ("input_scale", amax[name] / 448)):
            key = f"{name}.{suffix}"
            assert dtypes[key] == "F32" and tensors[key].shape == (), key
            assert torch.equal(tensors[key], expected), key
    # Siblings reading one input share the input scale (as in real ModelOpt exports).
    q, v = "layers.0.self_attn.to_q", "layers.0.self_attn.to_v"
    assert torch.equal(tensors[f"{q}.input_scale"], tensors[f"{v}.input_scale"])
    assert not torch.equal(tensors[f"{q}.weight_scale"], tensors[f"{v}.weight_scale"])
    # Everything else is the model's own tensor, in the model's dtype.
    state = model.state_dict()
    for key, value in state.items():
        if not key.endswith(".weight") or key[: -len(".weight")] not in quantized:
            assert dtypes[key] == "BF16" and torch.equal(tensors[key], value), key
    assert set(tensors) == set(state) | {f"{n}.{s}" for n in quantized for s in ("weight_scale", "input_scale")}
    assert dtypes["layers.0.self_attn.add_q_proj.bias"] == "BF16"


def test_ignore_patterns_keep_modules_high_precision(tmp_path):
    model = tiny()
    ignore = ["layers.1*", "lm_head", "embed_tokens", "proj_*", "time_embedder.*"]
    export(model, tmp_path, ignore=ignore)
    tensors, dtypes, _ = read_all(tmp_path)
    assert dtypes["layers.0.mlp.up_proj.weight"] == "F8_E4M3"
    for key in tensors:
        if key.startswith("layers.1."):
            assert dtypes[key] == "BF16" and not key.endswith("_scale"), key
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ignore


def test_json_layout_matches_modelopt(tmp_path):
    export(tiny(), tmp_path, step_policy=DEMO_STEP_POLICY, max_shard_size=40_000)
    fixture_config = json.loads((FIXTURE / "config.json").read_text())
    config_text = (tmp_path / "config.json").read_text()
    config = json.loads(config_text)
    qc, fqc = config["quantization_config"], fixture_config["quantization_config"]
    assert list(qc) == list(fqc) + ["runtime"]
    assert json.dumps(qc["config_groups"]) == json.dumps(fqc["config_groups"])
    assert qc["producer"] == {"name": "fsdp_fp8", "version": "0.1.0"}
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "FP8")
    assert qc["ignore"] == list(DEFAULT_IGNORE)
    assert qc["runtime"] == {"diffusion_step_policy": DEMO_STEP_POLICY}
    assert list(config)[-1] == "quantization_config"
    assert config["_class_name"] == "ReferenceMoTTransformer"
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())
    fhf = json.loads((FIXTURE / "hf_quant_config.json").read_text())
    assert list(hf) == list(fhf) and list(hf["quantization"]) == list(fhf["quantization"])
    assert hf["producer"] == qc["producer"]
    assert hf["quantization"] == {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": None,
        "exclude_modules": list(DEFAULT_IGNORE),
    }
    index = json.loads((tmp_path / f"{STEM}.safetensors.index.json").read_text())
    assert list(index) == ["metadata", "weight_map"]
    assert list(index["metadata"]) == ["total_parameters", "total_size"]
    # Whitespace: both sides are what json.dumps writes with ModelOpt's settings.
    for ours, theirs, indent, tail in (
        ("config.json", "config.json", 4, ""),
        ("hf_quant_config.json", "hf_quant_config.json", 4, ""),
        (f"{STEM}.safetensors.index.json", "model.safetensors.index.json", 2, "\n"),
    ):
        for path in (tmp_path / ours, FIXTURE / theirs):
            text = path.read_text()
            assert text == json.dumps(json.loads(text), indent=indent) + tail, path


def test_sharded_index_is_complete_and_consistent(tmp_path):
    model = tiny()
    export(model, tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / f"{STEM}.safetensors.index.json").read_text())
    tensors, _, where = read_all(tmp_path)
    assert index["weight_map"] == where
    shards = sorted(set(where.values()))
    assert len(shards) > 2 and not (tmp_path / f"{STEM}.safetensors").exists()
    assert all(re.fullmatch(rf"{STEM}-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total_size
    # As ModelOpt counts them: parameters, without the scales.
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("max_shard_size", [None, 40_000])
def test_scales_in_separate_shard(tmp_path, max_shard_size):
    export(tiny(), tmp_path, max_shard_size=max_shard_size, scales_in_separate_shard=True)
    weight_map = json.loads((tmp_path / f"{STEM}.safetensors.index.json").read_text())["weight_map"]
    scales = [k for k in weight_map if k.endswith("_scale")]
    assert len(scales) == 56
    for key in scales:
        weight = key.rsplit(".", 1)[0] + ".weight"
        assert weight_map[key] != weight_map[weight], key
    assert read_all(tmp_path)[2] == weight_map


def test_single_file_without_shard_size(tmp_path):
    export(tiny(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", f"{STEM}.safetensors", "hf_quant_config.json"]


def test_exports_are_byte_identical_and_state_dict_input_agrees(tmp_path):
    model = tiny()
    a = export(model, tmp_path / "a", max_shard_size=40_000, scales_in_separate_shard=True)
    b = export(tiny(), tmp_path / "b", max_shard_size=40_000, scales_in_separate_shard=True)
    tensors, _, _ = read_all(a)
    scales = {k[: -len(".input_scale")]: v for k, v in tensors.items() if k.endswith(".input_scale")}
    c = export_fp8(
        model.state_dict(),
        tmp_path / "c",
        config=model.config.to_config_dict(),
        input_scales=scales,
        max_shard_size=40_000,
        scales_in_separate_shard=True,
    )
    names = sorted(p.name for p in a.iterdir())
    assert len(names) > 3
    for other in (b, c):
        assert sorted(p.name for p in other.iterdir()) == names
        for name in names:
            assert (a / name).read_bytes() == (other / name).read_bytes(), name


def test_bf16_export_is_the_unquantized_model(tmp_path):
    model = tiny()
    export_bf16(model, tmp_path, config=model.config.to_config_dict(), max_shard_size=40_000)
    tensors, dtypes, _ = read_all(tmp_path)
    state = model.state_dict()
    assert set(tensors) == set(state) and set(dtypes.values()) == {"BF16"}
    assert all(torch.equal(tensors[k], v) for k, v in state.items())
    assert not (tmp_path / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert (tmp_path / f"{STEM}.safetensors.index.json").exists()


def test_bad_requests_are_refused(tmp_path):
    model = tiny()
    config = model.config.to_config_dict()
    with pytest.raises(ValueError, match="exactly one"):
        export_fp8(model, tmp_path / "a", config=config)
    with pytest.raises(ValueError, match="lm_head.*no input scale"):
        export_fp8(
            model, tmp_path / "b", config=config, calibrate=calibrate, ignore=["proj_*", "time_embedder*"]
        )  # lm_head is never called by sampling
    with pytest.raises(ValueError, match="`nope` in input_scales"):
        export_fp8(model, tmp_path / "c", config=config, input_scales={"nope": 1.0})
    with pytest.raises(ValueError, match="first_steps"):
        bad = {**DEMO_STEP_POLICY, "first_steps": {"count": -1, "mode": "a16"}}
        export(model, tmp_path / "d", step_policy=bad)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "stale.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError):
        export(model, tmp_path / "e")


def _demo_in_subprocess(cache: str, queue) -> None:
    path = demo_checkpoint(cache)
    queue.put((str(path), os.stat(path).st_ino))


def test_demo_checkpoint_concurrent_idempotent_and_self_healing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_demo_in_subprocess, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=bound(240)) for _ in procs]
        for p in procs:
            p.join(timeout=bound(60))
            assert p.exitcode == 0
    finally:
        for p in procs:  # never leave a hung process behind a failed test
            if p.is_alive():
                p.kill()
    # One build: both callers saw the same directory, never replaced afterwards.
    assert results[0] == results[1]
    path = Path(results[0][0])
    assert os.stat(path).st_ino == results[0][1]
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert (path / "model_index.json").is_file()
    tensors, dtypes, where = read_all(path / "transformer")
    assert len(set(where.values())) >= 3
    assert dtypes["layers.1.mlp_moe_gen.down_proj.weight"] == "F8_E4M3"
    assert dtypes["layers.1.self_attn.to_q.weight"] == "F8_E4M3"
    assert dtypes["proj_in.weight"] == "BF16" and dtypes["time_embedder.linear_1.weight"] == "F32"
    qc = json.loads((path / "transformer" / "config.json").read_text())["quantization_config"]
    assert qc["runtime"]["diffusion_step_policy"] == DEMO_STEP_POLICY

    def contents():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}

    before = contents()

    assert demo_checkpoint(tmp_path) == path and os.stat(path).st_ino == results[0][1]
    # A damaged cache and a crashed build's leftovers are repaired on the next call.
    shard = sorted((path / "transformer").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / f".{path.name}.tmp-crashed").mkdir()
    assert demo_checkpoint(tmp_path) == path
    assert contents() == before  # the build is deterministic: the same bytes again
    assert not (tmp_path / f".{path.name}.tmp-crashed").exists()
