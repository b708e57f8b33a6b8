"""Action jobs' inputs, before any load: the raw action file (``.npy``, ``.json``, ``.csv``) read to
the same rows whichever the format, and every careless file or option combination refused in one
line naming the file or option (``fsdp_fp8.generation.actions``)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.generation.actions import ACTION_MODES, RESOLUTION_TIERS, action_problems, read_actions

ROWS = [[0.1, -0.2], [0.3, 0.0], [0.5, 0.5]]
MODEL = {"action_gen": True, "action_dim": 10}


@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "a.npy", np.array(ROWS, dtype=np.float32))
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "a.csv").write_text("".join(",".join(map(str, r)) + "\n" for r in ROWS))
    return tmp_path


def test_the_three_formats_read_the_same_rows(files):
    npy, as_json, as_csv = (read_actions(files / f"a.{s}") for s in ("npy", "json", "csv"))
    assert as_json == as_csv == ROWS
    assert np.allclose(npy, ROWS) and len(npy) == 3 and len(npy[0]) == 2


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("empty.csv", "", "holds no actions"),
        ("empty.json", "[]", "holds no actions"),
        ("ragged.csv", "1,2\n3\n", "is ragged: rows of 1, 2 values (row 1 has 1, row 0 has 2)"),
        ("ragged.json", "[[1, 2], [3]]", "is ragged"),
        ("nan.json", "[[1, NaN]]", "row 0 value 1 is nan; actions must be finite"),
        ("inf.csv", "1,inf\n", "row 0 value 1 is inf; actions must be finite"),
        ("text.csv", "1,two\n", "row 0 value 1 is 'two', not a number"),
        ("flat.json", "[1, 2]", "is not a JSON list of lists of numbers"),
        ("actions.txt", "1,2\n", "has the suffix '.txt'; actions are read from .npy, .json, .csv"),
    ],
)
def test_a_careless_file_is_one_line_naming_it(tmp_path, name, text, said):
    (tmp_path / name).write_text(text)
    with pytest.raises(ArgumentError) as refused:
        read_actions(tmp_path / name)
    [problem] = refused.value.problems  # one line
    assert said in problem and str(tmp_path / name) in problem and "\n" not in problem


def test_a_npy_that_is_no_matrix_or_a_pickle_is_refused(tmp_path):
    np.save(tmp_path / "flat.npy", np.zeros(3))
    with pytest.raises(ValueError, match="holds a 1-D array of shape"):
        read_actions(tmp_path / "flat.npy")
    np.save(tmp_path / "objects.npy", np.array([[{"a": 1}]], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="cannot be read|not real numbers|pickle"):
        read_actions(tmp_path / "objects.npy")


def _values(**given):
    fields = dict(action="forward_dynamics", domain="pusht", chunk_size=4, actions=None, resolution_tier=None)
    fields |= dict(image="first.png", frames=None, height=None, width=None, prompts=None)
    return types.SimpleNamespace(**(fields | given))


def test_widths_domains_and_missing_options_are_named(files):
    assert action_problems(_values(actions=str(files / "a.json")), MODEL, "config.json") == []
    wide = action_problems(_values(actions=str(files / "a.json"), domain="umi"), MODEL, "config.json")
    assert wide == [f"--actions {files / 'a.json'} has 2 values per action; --domain umi takes 10"]
    narrow_model = action_problems(_values(actions=str(files / "a.json")), {**MODEL, "action_dim": 1}, "cfg")
    assert narrow_model == [f"--actions {files / 'a.json'} has 2 values per action; cfg has `action_dim` 1"]
    unknown = action_problems(_values(domain="martian", actions=str(files / "a.json")), MODEL, "cfg")
    assert len(unknown) == 1 and unknown[0].startswith("--domain 'martian' is not one of diffusers' action domains")
    missing = action_problems(_values(domain=None, chunk_size=None, image=None, frames=5), MODEL, "cfg")
    assert any("needs --domain" in p for p in missing) and any("needs --chunk-size" in p for p in missing)
    assert any("give --image" in p for p in missing) and any("leave out --frames" in p for p in missing)
    assert action_problems(_values(actions=str(files / "a.json")), {"action_gen": False}, "cfg") == [
        "--action: cfg has no `action_gen`: its transformer takes no actions"
    ]
    assert action_problems(_values(action=None, chunk_size=None), MODEL, "cfg") == [
        "--domain: options of an action job; give --action too"
    ]


def test_the_tiers_and_modes_are_diffusers_own():
    from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as cosmos

    assert sorted(int(t) for t in cosmos._ACTION_RESOLUTION_BINS) == list(RESOLUTION_TIERS)
    assert set(ACTION_MODES) <= set(cosmos.CosmosActionCondition.__annotations__["mode"].__args__)


def test_the_action_projections_are_other_to_the_step_policy():
    """diffusers' action projections are domain-aware embeddings (one weight per domain), no
    linear: never FP8, and no step switches them; a linear among them would be "other"."""
    from diffusers import Cosmos3OmniTransformer
    from torch import nn

    from fsdp_fp8.generation.demo import ACTION_CONFIG, TRANSFORMER_CONFIG
    from fsdp_fp8.runtime.towers import OTHER, cosmos3_towers

    model = Cosmos3OmniTransformer(vocab_size=300, **{**TRANSFORMER_CONFIG, **ACTION_CONFIG})
    action = {n: m for n, m in model.named_modules() if n.startswith("action_")}
    assert {"action_proj_in", "action_proj_out"} <= set(action)
    assert not any(isinstance(m, nn.Linear) for m in action.values())
    assert all(tower == OTHER for name, tower in cosmos3_towers(model).items() if name.startswith("action_"))
    assert isinstance(model.action_proj_in.fc, nn.Embedding)


def test_each_mode_takes_its_own_inputs(files):
    actions = str(files / "a.json")
    assert action_problems(_values(action="policy"), MODEL, "cfg") == []
    assert action_problems(_values(action="policy", actions=actions), MODEL, "cfg") == [
        "--actions drives forward_dynamics; --action policy predicts the actions itself"
    ]
    assert action_problems(_values(action="inverse_dynamics", image=None, video="clip"), MODEL, "cfg") == []
    assert action_problems(_values(action="inverse_dynamics"), MODEL, "cfg") == [
        "--action inverse_dynamics infers the actions between a clip's frames: give --video"
    ]
    assert action_problems(_values(actions=actions, image=None, video="clip"), MODEL, "cfg") == []
    assert action_problems(_values(), MODEL, "cfg") == ["--action forward_dynamics needs --actions"]
