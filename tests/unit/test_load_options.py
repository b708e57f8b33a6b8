"""``LoadOptions``: one frozen, self-checked value for every setting of a load, and the keyword
convenience that builds it; the launcher hands its ``--timeout`` to every agreement through it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from fsdp_fp8.format.timeouts import MAX_TIMEOUT_S
from fsdp_fp8.fp8.kernels import KernelOptions
from fsdp_fp8.load.options import LoadOptions, load_options
from fsdp_fp8.reading.read_options import ReadOptions


def test_defaults_are_fsdp2s_and_the_device_is_resolved_once():
    options = LoadOptions()
    assert options.device == torch.device("cpu")  # no CUDA here: default_device()
    assert options.fsdp_options() == {}  # nothing differs from FSDP2's own defaults
    assert options.timeout_s == 300.0 and options.kernels == KernelOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strict = False


def test_only_the_fsdp_settings_that_differ_from_fsdp2s_defaults_reach_fully_shard():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    options = LoadOptions(mp_policy=mp, reshard_after_forward=False)
    assert options.fsdp_options() == {"mp_policy": mp, "reshard_after_forward": False}
    offload = LoadOptions(offload_policy=CPUOffloadPolicy())
    assert offload.fsdp_options() == {"offload_policy": offload.offload_policy}
    assert not offload.on_host  # no process group here: nothing is offloaded


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e300, 0, -5, "10", True])
def test_a_timeout_that_is_not_a_bounded_number_of_seconds_is_refused(value):
    with pytest.raises(ValueError, match=r"`timeout_s` must be (> 0|<= 86,400 seconds|a number of seconds)"):
        LoadOptions(timeout_s=value)
    assert LoadOptions(timeout_s=MAX_TIMEOUT_S).timeout_s == MAX_TIMEOUT_S


def test_every_wrong_setting_is_named_at_once():
    with pytest.raises(ValueError) as info:
        LoadOptions(device=3, strict="yes", read_options={"threads": 2}, kernels=None)
    text = str(info.value)
    for needle in ("`device` is a int", "`strict` is a str", "`read_options` is a dict", "`kernels` is a NoneType"):
        assert needle in text, text


def test_keyword_settings_build_or_replace_the_value_and_unknown_ones_are_named():
    base = LoadOptions(strict=False)
    changed = load_options(base, timeout_s=30.0, read_options=ReadOptions(threads=1))
    assert (changed.strict, changed.timeout_s, changed.read_options.threads) == (False, 30.0, 1)
    assert load_options(base) is base and load_options(base, device=None) is base  # None keeps the value
    with pytest.raises(TypeError, match="unknown load setting.*agreement_timeout_s.*the settings are device"):
        load_options(agreement_timeout_s=5)


def test_the_launchers_timeout_reaches_the_loads_options():
    from fsdp_fp8.cli.arguments import parse_run_args
    from fsdp_fp8.cli.runner import load_options_of

    options = load_options_of(parse_run_args(["--timeout", "42"], "launch/infer.py"))
    assert options.timeout_s == 42.0 and options.mesh is None
