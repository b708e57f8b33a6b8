"""Settings every rank must share, agreed at load: two ranks handed ``load_pipeline`` different
settings each raise the same ``ArgumentError`` naming the setting and both values, before the
pipeline's files are read or a mesh is built (no hang, no run apart). An agreed load:
test_request_agreement.py and test_launcher.py. The launcher's and serve's agreement of their run
settings (before their mesh) is the same exchange, checked here on its own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(300)

from ranks import run_ranks  # noqa: E402

# setting -> (rank 0's keyword arguments, rank 1's)
DIFFER = {
    "attention_backend": ({"attention_backend": "native"}, {"attention_backend": "flex"}),
    "cfg_parallel": ({}, {"cfg_parallel": True}),
    # one rank's value does not parse: still the agreement's error, on both ranks, not a hang
    "cache": ({"cache": "seacache"}, {"cache": "seacache:x"}),
}


def _refusals(rank: int, world: int, root: str) -> dict:
    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.compose import pipeline
    from fsdp_fp8.errors import ArgumentError

    read, built = [], []
    real_read, real_mesh = pipeline.read_model_index, pipeline.build_mesh
    pipeline.read_model_index = lambda *a: read.append(a) or real_read(*a)
    pipeline.build_mesh = lambda *a: built.append(a) or real_mesh(*a)
    out = {}
    for setting, by_rank in DIFFER.items():
        try:
            load_pipeline(root, device=torch.device("cpu"), **by_rank[rank])
            out[setting] = ("loaded", None)
        except ArgumentError as exc:
            out[setting] = (type(exc).__name__, str(exc))
    out["read"], out["built"] = len(read), len(built)
    out["run"] = _run_settings(rank, root)
    out["each"] = _each_run_setting(rank, root)
    return out


# Rank 1's value of each setting the launcher and serve agree on (rank 0 keeps the defaults).
RANK_1_VALUES = {
    "cfg_parallel": True,
    "ulysses": 2,
    "replicas": 2,
    "attention_backend": "flex",
    "vae_tiling": "on",
    "cache": "seacache",
    "resident": "all",
    "resident_budget": 10**9,
    "safety_check": "off",
    "timeout": 123.0,
}


def _each_run_setting(rank: int, root: str) -> dict:
    """Each agreed setting in turn differing on rank 1 alone (the run settings, the step policy and
    the checkpoint): what each rank raised."""
    import dataclasses
    import tempfile

    from fsdp_fp8.errors import ArgumentError
    from fsdp_fp8.generation.loading import agree_on_run_settings
    from fsdp_fp8.generation.values import RunSettings

    cases = {name: ({name: value} if rank else {}, root, "auto") for name, value in RANK_1_VALUES.items()}
    cases["step_policy"] = ({}, root, "off" if rank else "auto")
    with tempfile.TemporaryDirectory() as elsewhere:
        cases["checkpoint"] = ({}, elsewhere if rank else root, "auto")
        out = {}
        for name, (changed, path, policy) in cases.items():
            settings = dataclasses.replace(RunSettings(), **changed)
            try:
                agree_on_run_settings(settings, path, policy)
                out[name] = ("agreed", None)
            except ArgumentError as exc:
                out[name] = (type(exc).__name__, str(exc))
    return out


def _run_settings(rank: int, root: str) -> tuple[str, str | None]:
    """The launcher's and serve's agreement (before their mesh): rank 1 given other run settings."""
    from fsdp_fp8.errors import ArgumentError
    from fsdp_fp8.generation.loading import agree_on_run_settings
    from fsdp_fp8.generation.values import RunSettings

    settings = RunSettings(vae_tiling="on", resident="all", cache="seacache") if rank else RunSettings()
    try:
        agree_on_run_settings(settings, root, "auto")
        return ("agreed", None)
    except ArgumentError as exc:
        return (type(exc).__name__, str(exc))


@pytest.fixture(scope="module")
def refusals(demo_root):
    return run_ranks(_refusals, 2, str(demo_root), timeout=240)


@pytest.mark.parametrize("setting", sorted(DIFFER))
def test_a_setting_that_differs_is_one_error_on_every_rank_naming_it(refusals, setting):
    outcomes = [refusals[rank][setting] for rank in (0, 1)]
    assert [kind for kind, _ in outcomes] == ["ArgumentError"] * 2, outcomes
    assert outcomes[0][1] == outcomes[1][1]  # the same error on both ranks
    text = outcomes[0][1]
    assert f"{setting} differs between ranks: rank 0 " in text and "; rank 1 " in text, text
    assert text.count("differs between ranks") == 1, text  # only the setting that differs


def test_the_error_shows_both_values(refusals):
    text = refusals[0]["attention_backend"][1]
    assert "attention_backend differs between ranks: rank 0 'native'; rank 1 'flex'" in text
    assert "cfg_parallel differs between ranks: rank 0 False; rank 1 True" in refusals[1]["cfg_parallel"][1]
    assert "cache differs between ranks: rank 0 'seacache'; rank 1 'seacache:x'" in refusals[1]["cache"][1]


def test_the_launchers_run_settings_are_agreed_the_same_way(refusals):
    assert refusals[0]["run"] == refusals[1]["run"]
    kind, text = refusals[0]["run"]
    assert kind == "ArgumentError", text
    assert "vae_tiling differs between ranks: rank 0 'auto'; rank 1 'on'" in text
    assert "resident differs between ranks: rank 0 'none'; rank 1 'all'" in text
    assert "cache differs between ranks: rank 0 'off'; rank 1 'seacache'" in text
    assert text.count("differs between ranks") == 3, text


def test_nothing_is_read_and_no_mesh_is_built_before_the_refusal(refusals):
    assert [(refusals[rank]["read"], refusals[rank]["built"]) for rank in (0, 1)] == [(0, 0), (0, 0)]


def test_the_values_cover_every_setting_the_ranks_agree_on():
    """A setting added to the agreement needs its case here."""
    from fsdp_fp8.generation.values import RUN_SETTINGS_TO_AGREE

    assert sorted(RANK_1_VALUES) == sorted(RUN_SETTINGS_TO_AGREE)


@pytest.mark.parametrize("setting", [*RANK_1_VALUES, "step_policy", "checkpoint"])
def test_each_agreed_setting_differing_on_one_rank_is_refused_on_both_naming_it(refusals, setting):
    outcomes = [refusals[rank]["each"][setting] for rank in (0, 1)]
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ArgumentError", outcomes
    text = outcomes[0][1]
    assert f"{setting} differs between ranks: rank 0 " in text and text.count("differs between ranks") == 1, text
