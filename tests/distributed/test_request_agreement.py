"""One request, agreed: under CFG-parallel and Ulysses, the ranks of one request given different
requests through the Python API each raise one error naming the field and the ranks, before any
step (no hang, no abort, no transport error); identical requests still give the 1-rank latent;
``load_pipeline``'s layout arguments are type-checked.

One spawn of 2 ranks loads the demo twice (CFG 2, then SP 2) and runs every case on each.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from ranks import run_ranks  # noqa: E402

SIZE = {"num_frames": 1, "height": 32, "width": 32}
STEPS = 2
BASE = dict(prompt="a red fox", negative_prompt=None, height=32, num_inference_steps=STEPS, guidance_scale=3.0, seed=0)
# field -> (rank 0's value, rank 1's value), a field of the pipeline's call (seed: its generator's)
DIFFER = {
    "prompt": ("a red fox", "a lighthouse in a storm"),
    "negative_prompt": (None, "blurry"),
    "generator": (0, 1),
    "height": (32, 48),
    "num_inference_steps": (STEPS, STEPS + 1),
    "guidance_scale": (3.0, 4.5),
    "image": ("black", "white"),  # a conditioning image's pixels (made in the rank: _value)
    "latents": (0.0, 1.0),  # the initial latents' values (likewise)
    "enable_sound": (False, True),
}


def _value(field: str, value):
    """The pipeline argument for ``DIFFER[field]``'s plain value."""
    from PIL import Image

    if field == "image":
        return Image.new("RGB", (32, 32), value)
    if field == "latents":
        return torch.full((1, 4, 1, 8, 8), value)
    return value


def _call(pipe, **change) -> str:
    """One call of ``pipe`` with ``BASE`` changed by ``change``; the final latent's digest."""
    values = dict(BASE, **change)
    seed = values.pop("seed")
    out = pipe(
        values.pop("prompt"),
        num_frames=1,
        width=32,
        **values,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
    )
    return hashlib.sha256(out.video.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _layout_cases(pipe, rank: int) -> dict:
    """The digest of the agreed request, then each differing field's error text (or what ran)."""
    from fsdp_fp8.interop.request_agreement import RequestMismatchError

    obs = {"agreed": _call(pipe)}
    for field, values in DIFFER.items():
        key = "seed" if field == "generator" else field
        try:
            obs[field] = ("ran", _call(pipe, **{key: _value(field, values[rank])}))
        except RequestMismatchError as exc:
            obs[field] = ("refused", str(exc))
    obs["after"] = _call(pipe)  # the pipeline still serves an agreed request
    return obs


def _observe(rank: int, world: int, root: str) -> dict:
    from fsdp_fp8 import load_pipeline

    obs = {}
    for name, layout in (("cfg", {"cfg_parallel": True}), ("sp", {"sequence_parallel": 2})):
        pipe = load_pipeline(root, device=torch.device("cpu"), **layout)
        pipe.set_progress_bar_config(disable=True)
        obs[name] = _layout_cases(pipe, rank)
    return obs


@pytest.fixture(scope="module")
def observed(demo_root):
    from fsdp_fp8 import load_pipeline

    pipe = load_pipeline(str(demo_root), device=torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    return {"one": _call(pipe), "ranks": run_ranks(_observe, 2, str(demo_root), timeout=600)}


@pytest.mark.parametrize("layout", ["cfg", "sp"])
def test_an_agreed_request_gives_the_one_rank_latent(observed, layout):
    for rank in (0, 1):
        assert observed["ranks"][rank][layout]["agreed"] == observed["one"]
        assert observed["ranks"][rank][layout]["after"] == observed["one"]


@pytest.mark.parametrize("field", sorted(DIFFER))
@pytest.mark.parametrize("layout", ["cfg", "sp"])
def test_a_field_that_differs_is_one_error_on_every_rank_naming_it(observed, layout, field):
    outcomes = [observed["ranks"][rank][layout][field] for rank in (0, 1)]
    assert [kind for kind, _ in outcomes] == ["refused", "refused"], outcomes
    assert outcomes[0][1] == outcomes[1][1]  # one error, the same on both ranks
    text = outcomes[0][1]
    assert f"`{field}` differs within the request of ranks 0, 1" in text
    assert "rank 0: " in text and "rank 1: " in text
    assert text.count("differs") == 1, text  # only the field that differs


def test_the_error_shows_both_values():
    from fsdp_fp8.interop.request_agreement import RequestTeams, _field, mismatch_problems

    prints = [_field(4) + _field("a fox"), _field(5) + _field("a fox")]
    (problem,) = mismatch_problems(["steps", "prompt"], prints, RequestTeams(((0, 1),), 1.0))
    assert problem == "`steps` differs within the request of ranks 0, 1 (rank 0: 4; rank 1: 5)"


def test_requests_of_other_slots_may_differ_and_a_number_is_its_value():
    from fsdp_fp8.interop.request_agreement import fingerprint, mismatch_problems, request_teams

    teams = request_teams(4, 2, 1.0)
    assert teams.teams == ((0, 1), (2, 3))
    a, b = fingerprint({"guidance_scale": 3, "prompt": "a"}), fingerprint({"guidance_scale": 3.0, "prompt": "b"})
    assert a != b
    assert mismatch_problems(["guidance_scale", "prompt"], [a, a, b, b], teams) == []
    assert len(a) == len(fingerprint({"guidance_scale": 3.5, "prompt": "a much longer prompt" * 50}))


@pytest.mark.parametrize(
    "layout, needle",
    [
        ({"cfg_parallel": "false"}, "cfg_parallel must be a bool, got 'false'"),
        ({"cfg_parallel": 1}, "cfg_parallel must be a bool, got 1"),
        ({"sequence_parallel": "2"}, "must be an integer >= 1, got '2'"),
        ({"sequence_parallel": True}, "must be an integer >= 1, got True"),
    ],
)
def test_load_pipeline_refuses_a_layout_argument_of_the_wrong_type(demo_root, layout, needle):
    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.errors import LayoutError

    with pytest.raises(LayoutError, match=needle):
        load_pipeline(str(demo_root), device=torch.device("cpu"), **layout)
