"""Each quantization-config spelling is accepted; each config that says something else is refused."""

from __future__ import annotations

import copy
import json

import pytest
from ckpt_writer import config_json_quant, flat_config, nested_config, small_tensors, write_checkpoint

from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.quant_config import CONFIG_JSON, FLAT, NESTED
from fsdp_fp8.format.step_policy import PUBLISHED_POLICY

POLICY = PUBLISHED_POLICY  # a valid policy, carried as is


@pytest.mark.parametrize(
    "quant, spellings, producer",
    [
        ("nested", (NESTED,), "modelopt 0.47.0"),
        ("flat", (FLAT,), None),
        ("config", (CONFIG_JSON,), "modelopt 0.47.0"),
        ("both", (NESTED, CONFIG_JSON), "modelopt 0.47.0"),
    ],
)
def test_spelling_accepted(tmp_path, quant, spellings, producer):
    ckpt = open_checkpoint(write_checkpoint(tmp_path, small_tensors(), quant=quant))
    assert ckpt.quant.is_modelopt_fp8
    assert ckpt.quant.spellings == spellings
    assert ckpt.quant.producer == producer
    assert ckpt.quant.ignore == ("lm_head",)
    assert set(ckpt.fp8_modules) == {"layers.0.up", "layers.0.down"}


def test_no_config_is_plain(tmp_path):
    t = {"w.weight": small_tensors()["norm.weight"]}
    ckpt = open_checkpoint(write_checkpoint(tmp_path, t, quant=None))
    assert not ckpt.quant.is_modelopt_fp8 and ckpt.quant.spellings == ()


def test_step_policy_and_kv_carried_raw(tmp_path):
    q = config_json_quant(kv=True, policy=dict(POLICY))
    t = {**small_tensors(), "a.k_proj.k_scale": __import__("torch").tensor(1.0)}
    ckpt = open_checkpoint(write_checkpoint(tmp_path, t, quant=None, config={"quantization_config": q}))
    assert ckpt.quant.step_policy == POLICY
    assert ckpt.quant.kv_cache_quant_algo == "FP8"


def _refused(tmp_path, **kw) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(write_checkpoint(tmp_path, small_tensors(), **kw))
    return info.value.problems


def _nested(edit):
    c = nested_config()
    edit(c)
    return c


def _cfg(edit):
    q = config_json_quant()
    edit(q)
    return {"quantization_config": q}


GROUP = lambda q: q["config_groups"]["group_0"]  # noqa: E731

BAD_HF = {
    "nested NVFP4": (lambda c: c["quantization"].update(quant_algo="NVFP4"), "`quantization.quant_algo` is 'NVFP4'"),
    "nested per-channel": (
        lambda c: c["quantization"].update(quant_algo="FP8_PER_CHANNEL_PER_TOKEN"),
        "`quantization.quant_algo` is 'FP8_PER_CHANNEL_PER_TOKEN'",
    ),
    "nested no algo": (lambda c: c["quantization"].pop("quant_algo"), "`quantization.quant_algo` is missing"),
    "nested kv int8": (
        lambda c: c["quantization"].update(kv_cache_quant_algo="INT8"),
        "`quantization.kv_cache_quant_algo` is 'INT8'",
    ),
    "nested group_size": (
        lambda c: c["quantization"].update(group_size=128),
        "`quantization.group_size` is not understood",
    ),
    "nested exclude not list": (
        lambda c: c["quantization"].update(exclude_modules="lm_head"),
        "`quantization.exclude_modules` must be a list",
    ),
    "nested other producer": (
        lambda c: c["producer"].update(name="llmcompressor"),
        "`producer.name` is 'llmcompressor'",
    ),
    "nested producer type": (lambda c: c.update(producer="modelopt"), "`producer` must be"),
    "nested quantization type": (lambda c: c.update(quantization=["FP8"]), "`quantization` must be an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_HF))
def test_bad_hf_quant_config(tmp_path, case):
    edit, needle = BAD_HF[case]
    found = _refused(tmp_path, hf_quant=_nested(edit))
    assert any(p.startswith("hf_quant_config.json: field") and needle in p for p in found), found


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c.update(quant_method="gptq"), "`quant_method` is 'gptq'"),
        (lambda c: c.update(quant_algo="INT8_SQ"), "`quant_algo` is 'INT8_SQ'"),
        (lambda c: c.update(ignore=["x"]), "`exclude_modules` and `ignore` disagree"),
    ],
)
def test_bad_flat(tmp_path, edit, needle):
    c = flat_config()
    edit(c)
    assert any(p.startswith("hf_quant_config.json") and needle in p for p in _refused(tmp_path, hf_quant=c))


BAD_CONFIG = {
    "method fp8": (lambda q: q.update(quant_method="fp8"), "`quantization_config.quant_method` is 'fp8'"),
    "method compressed": (
        lambda q: q.update(quant_method="compressed-tensors"),
        "quant_method` is 'compressed-tensors'",
    ),
    "algo nvfp4": (lambda q: q.update(quant_algo="NVFP4"), "`quantization_config.quant_algo` is 'NVFP4'"),
    "dynamic act": (
        lambda q: GROUP(q)["input_activations"].update(dynamic=True),
        "`quantization_config.config_groups.group_0.input_activations.dynamic` is True",
    ),
    "4 bits": (lambda q: GROUP(q)["weights"].update(num_bits=4), "group_0.weights.num_bits` is 4"),
    "bits as str": (lambda q: GROUP(q)["weights"].update(num_bits="8"), "group_0.weights.num_bits` is '8'"),
    "dynamic as int": (lambda q: GROUP(q)["weights"].update(dynamic=0), "group_0.weights.dynamic` is 0"),
    "int type": (lambda q: GROUP(q)["weights"].update(type="int"), "group_0.weights.type` is 'int'"),
    "per channel": (lambda q: GROUP(q)["weights"].update(strategy="channel"), "group_0.weights.strategy` is 'channel'"),
    "block size": (
        lambda q: GROUP(q)["weights"].update(block_structure=[128, 128]),
        "group_0.weights.block_structure` is not understood",
    ),
    "weight only": (lambda q: GROUP(q).pop("input_activations"), "group_0.input_activations` is missing"),
    "groups not dict": (lambda q: q.update(config_groups=[1]), "`quantization_config.config_groups` must be"),
    "kv int8": (
        lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "int", "dynamic": False}),
        "`quantization_config.kv_cache_scheme.type` is 'int'",
    ),
    "runtime list": (lambda q: q.update(runtime=[]), "`quantization_config.runtime` must be an object"),
    "runtime unknown": (
        lambda q: q.update(runtime={"other": 1}),
        "`quantization_config.runtime.other` is not understood",
    ),
    "policy not dict": (lambda q: q.update(runtime={"diffusion_step_policy": "a16"}), "diffusion_step_policy` must be"),
    "unknown key": (lambda q: q.update(weight_block_size=[128, 128]), "`quantization_config.weight_block_size` is not"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG))
def test_bad_config_json(tmp_path, case):
    edit, needle = BAD_CONFIG[case]
    found = _refused(tmp_path, quant=None, config=_cfg(edit))
    assert any(p.startswith("config.json: field") and needle in p for p in found), found


def test_quantization_config_not_an_object(tmp_path):
    found = _refused(tmp_path, quant=None, config={"quantization_config": "fp8"})
    assert found == ["config.json: field `quantization_config` must be an object, got 'fp8'"]


@pytest.mark.parametrize("name", ["hf_quant_config.json", "config.json"])
def test_malformed_json(tmp_path, name):
    write_checkpoint(tmp_path, small_tensors(), quant="both")
    (tmp_path / name).write_text('{"quant_algo": "FP8",')
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    assert any(p.startswith(f"{name} is not valid JSON") for p in info.value.problems)


def test_hf_quant_config_of_unknown_shape(tmp_path):
    found = _refused(tmp_path, hf_quant={"format": "fp8"})
    assert any("hf_quant_config.json: has neither" in p for p in found)


@pytest.mark.parametrize(
    "field, nested_edit, needle",
    [
        ("ignore", lambda c: c["quantization"].update(exclude_modules=["lm_head", "router"]), "ignore/exclude_modules"),
        ("kv", lambda c: c["quantization"].update(kv_cache_quant_algo="FP8"), "kv cache algorithm"),
        ("producer", lambda c: c["producer"].update(version="0.35.1"), "producer"),
    ],
)
def test_spellings_that_disagree(tmp_path, field, nested_edit, needle):
    found = _refused(tmp_path, quant="config", hf_quant=_nested(nested_edit))
    assert any(f"{NESTED} and {CONFIG_JSON} disagree on {needle}" in p for p in found), found


def test_ignore_order_does_not_matter(tmp_path):
    q = config_json_quant(ignore=["b", "a"])
    ckpt = open_checkpoint(
        write_checkpoint(
            tmp_path, small_tensors(), config={"quantization_config": q}, hf_quant=nested_config(ignore=["a", "b"])
        )
    )
    assert set(ckpt.quant.ignore) == {"a", "b"}


def test_fixture_configs_round_trip(tmp_path):
    """The fixture's own two spellings, copied, are accepted; flipping one field in either is not."""
    from small_models import FIXTURE

    hf = json.loads((FIXTURE / "hf_quant_config.json").read_text())
    cfg = json.loads((FIXTURE / "config.json").read_text())
    open_checkpoint(write_checkpoint(tmp_path / "ok", small_tensors(), config=cfg, hf_quant=hf))
    bad = copy.deepcopy(cfg)
    bad["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = True
    with pytest.raises(CheckpointError, match="input_activations.dynamic"):
        open_checkpoint(write_checkpoint(tmp_path / "bad", small_tensors(), config=bad, hf_quant=hf))


def test_a_malformed_step_policy_is_refused_when_the_checkpoint_is_opened(tmp_path):
    """Not later, by the launcher, after a whole sharded load."""
    from ckpt_writer import config_json_quant, small_tensors, write_checkpoint

    from fsdp_fp8.errors import CheckpointError
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.format.step_policy import PUBLISHED_POLICY

    policy = {**PUBLISHED_POLICY, "schema_version": 2, "bogus": 1}
    ckpt = write_checkpoint(
        tmp_path,
        small_tensors(),
        quant="config",
        config={"model_type": "test", "quantization_config": config_json_quant(policy=policy)},
    )
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(ckpt)
    text = str(err.value)
    assert "config.json: quantization_config.runtime.`diffusion_step_policy.schema_version` must be 1" in text
    assert "bogus" in text
    good = write_checkpoint(
        tmp_path / "good",
        small_tensors(),
        quant="config",
        config={"model_type": "test", "quantization_config": config_json_quant(policy=PUBLISHED_POLICY)},
    )
    assert open_checkpoint(good).quant.step_policy == PUBLISHED_POLICY
