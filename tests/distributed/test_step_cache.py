"""The step cache (``--cache seacache``, ``load_pipeline(cache=...)``) across ranks: a request's
cached latents at 2 ranks (two requests on one shard group), CFG 2 and Ulysses 2 equal its own
one-rank cached latents; the cache really skips decoder stacks and changes the output; requests on
one shard group that are made to decide differently at every step keep their own outputs, and no
rank hangs.

The demo pipeline, and a real ModelOpt 0.47 export beside the demo's VAE (test_cfg_parallel's
fixture pipeline), at 9 steps under a step policy of the test's (``POLICY``): steps 0-3 and 5-8
W8A16, step 4 W8A8 (one W8A8 step: CPU's ``torch._scaled_mm`` is slow), so an eager cache computes
step 3 for the limit of two reused steps in a row, and steps 4 and 5 for the rule that a step
reuses only residuals of its own precision. One spawn per world size records what the tests
judge; world size 1 is this process. The launcher's runs keep the checkpoints' own policy.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import digest as _digest  # noqa: E402
from ranks import run_ranks  # noqa: E402

from fsdp_fp8.format.step_policy import PUBLISHED_POLICY  # noqa: E402

STEPS = 9
# The published policy with 4 first and 4 last W8A16 steps: at 9 steps, one W8A8 step (4)
POLICY = {**PUBLISHED_POLICY, "first_steps": {"count": 4, "mode": "a16"}, "last_steps": {"count": 4, "mode": "a16"}}
PRECISIONS = ["W8A16"] * 4 + ["W8A8"] + ["W8A16"] * 4
# an eager cache: 0 first, 3 after two reused, 4 and 5 where the precision changes, 8 last
EAGER_COMPUTED = [0, 3, 4, 5, 8]
IMAGE = {"num_frames": 1, "height": 32, "width": 32}  # 16 generation tokens: whole on one rank
VIDEO = {"num_frames": 5, "height": 32, "width": 32}  # 32 generation tokens: 16 a rank under Ulysses 2
PROMPTS = ("a red fox", "a lighthouse in a storm")
EAGER = 1e9  # a threshold the budget never reaches: reuse wherever the rules allow
NEVER = 0.0  # a budget always spent: compute every step
DEFAULT = 0.25  # diffusers' own (SeaCacheConfig().threshold)


def _pipeline(root: str, cache, cfg_parallel: bool = False, ulysses: int = 1):
    from fsdp_fp8 import load_pipeline

    pipe = load_pipeline(
        root, device=torch.device("cpu"), cache=cache, cfg_parallel=cfg_parallel, ulysses=ulysses, step_policy=POLICY
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.stacks = []  # the decoder stacks this rank really ran (its first block's forwards)
    pipe.transformer.layers[0].register_forward_pre_hook(lambda *_: pipe.stacks.append(1))
    return pipe


def _generate(pipe, prompt: str, size: dict, threshold: float | None = None, fail_at: int | None = None) -> dict:
    from diffusers.hooks import sea_cache
    from diffusers.hooks.sea_cache import SeaCacheConfig

    from fsdp_fp8.testing.collective_counts import pipeline_state

    indicators = []  # diffusers' indicator at each step, as digests: the same bits at any layout

    def recorded(config, metadata):
        if metadata.step_index == fail_at:  # diffusers' indicator fails on this rank at this step
            raise RuntimeError("no indicator (a test's failure)")
        out = build(config, metadata)
        indicators.append([_digest(t) for t in out or ()])
        return out

    cache = pipeline_state(pipe.transformer).cache
    if cache is not None and threshold is not None:  # this rank's own threshold (the forced case)
        cache.config = SeaCacheConfig(threshold=threshold)
    trace, stacks = ((len(cache.trace), cache.ran_for_peers) if cache else (0, 0)), len(pipe.stacks)
    build = sea_cache._build_indicator
    with mock.patch.object(sea_cache, "_build_indicator", recorded):
        out = pipe(
            prompt,
            **size,
            num_inference_steps=STEPS,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    return {
        "indicators": indicators,
        "digest": _digest(out.video),
        "computed": [i for i, c in enumerate(cache.trace[trace[0] :]) if c] if cache else None,
        "ran_for_peers": cache.ran_for_peers - trace[1] if cache else 0,
        "stacks": len(pipe.stacks) - stacks,
    }


def _observe(rank: int, world: int, root: str, fixture: str) -> dict:
    obs: dict = {}
    if world == 1:
        real = _pipeline(fixture, "seacache")  # the real ModelOpt export, eager: reuse certain
        for p in PROMPTS:
            obs[("fixture", p)] = _generate(real, p, IMAGE, EAGER)
        cached = _pipeline(root, "seacache")
        obs[("plain", PROMPTS[1])] = _generate(_pipeline(root, None), PROMPTS[1], IMAGE)
        for p in PROMPTS:
            obs[("cached", p)] = _generate(cached, p, IMAGE, DEFAULT)
        obs[(EAGER, PROMPTS[0])] = _generate(cached, PROMPTS[0], IMAGE, EAGER)
        obs[(NEVER, PROMPTS[1])] = _generate(cached, PROMPTS[1], IMAGE, NEVER)
        obs[("cached video", PROMPTS[0])] = _generate(cached, PROMPTS[0], VIDEO, DEFAULT)
        obs[("indicator fails", PROMPTS[0])] = _generate(cached, PROMPTS[0], IMAGE, EAGER, fail_at=1)
        return obs
    # 2 ranks: two requests on one shard group, first as the cache decides, then made to disagree
    pipe = _pipeline(root, "seacache")
    obs["fsdp"] = _generate(pipe, PROMPTS[rank], IMAGE, DEFAULT)
    obs["forced"] = _generate(pipe, PROMPTS[rank], IMAGE, (EAGER, NEVER)[rank])
    pair = _pipeline(root, "seacache", cfg_parallel=True)
    obs["cfg"] = _generate(pair, PROMPTS[0], IMAGE)
    # eager: step 1 reuses step 0's residuals, which both ranks of the pair made for both passes
    obs["cfg eager"] = _generate(pair, PROMPTS[0], IMAGE, EAGER)
    # only rank 1's indicator fails at step 1: it votes compute, and its pair computes with it
    obs["cfg indicator fails"] = _generate(pair, PROMPTS[0], IMAGE, EAGER, fail_at=1 if rank else None)
    obs["ulysses"] = _generate(_pipeline(root, "seacache", ulysses=2), PROMPTS[0], VIDEO)
    obs["fixture fsdp"] = _generate(_pipeline(fixture, "seacache"), PROMPTS[rank], IMAGE, EAGER)
    obs["fixture cfg"] = _generate(_pipeline(fixture, "seacache", cfg_parallel=True), PROMPTS[0], IMAGE, EAGER)
    obs["fixture ulysses"] = _generate(_pipeline(fixture, "seacache", ulysses=2), PROMPTS[0], IMAGE, EAGER)
    return obs


@pytest.fixture(scope="module")
def observed(roots):  # noqa: F811 - the fixture imported above
    return {1: _observe(0, 1, *roots), 2: run_ranks(_observe, 2, *roots, timeout=600)}


def test_the_cache_skips_decoder_stacks_and_changes_the_output(observed):
    one = observed[1]
    plain = one[("plain", PROMPTS[1])]
    assert plain["stacks"] == 2 * STEPS  # cond + uncond at every step
    for p in PROMPTS:
        cached = one[("cached", p)]
        assert 0 < len(cached["computed"]) < STEPS, cached
        assert cached["stacks"] == 2 * len(cached["computed"])  # a reused step runs no block
    assert one[("cached", PROMPTS[1])]["digest"] != plain["digest"]
    assert one[(NEVER, PROMPTS[1])]["digest"] == plain["digest"]  # a cache that never reuses changes no bit


def test_a_step_reuses_only_residuals_of_its_own_precision(observed):
    # steps 0-3 and 5-8 W8A16, 4 W8A8: at most 2 reused in a row (step 3), the first and the last step
    # computed, and steps 4 and 5 computed because the last computed step ran at the other precision
    from fsdp_fp8.format.cache_option import computed_steps_range

    eager = observed[1][(EAGER, PROMPTS[0])]["computed"]
    assert eager == EAGER_COMPUTED
    # inspect's forecast (the fewest steps the rules allow) is what an eager cache computes
    assert computed_steps_range(PRECISIONS) == (len(eager), STEPS)


ALONE = {
    "fsdp": "cached",
    "cfg": "cached",
    "cfg eager": EAGER,
    "cfg indicator fails": "indicator fails",
    "ulysses": "cached video",
    "fixture fsdp": "fixture",
    "fixture cfg": "fixture",
    "fixture ulysses": "fixture",
}


@pytest.mark.parametrize("layout", list(ALONE))
def test_a_request_keeps_its_one_rank_cached_latents_at_any_layout(observed, layout):
    one = observed[1]
    for rank, obs in enumerate(observed[2]):
        prompt = PROMPTS[rank] if layout.endswith("fsdp") else PROMPTS[0]
        alone = one[(ALONE[layout], prompt)]
        assert obs[layout]["digest"] == alone["digest"], (layout, rank)
        assert obs[layout]["computed"] == alone["computed"], (layout, rank)
        # the indicator is built from the call's whole latents, never from a rank's rows
        if layout != "cfg indicator fails":
            assert obs[layout]["indicators"] == alone["indicators"] and len(alone["indicators"]) == STEPS
        assert len(alone["computed"]) < STEPS  # some steps reused
    if layout == "cfg indicator fails":  # step 1 computed on both ranks, not reused as eager would
        assert 1 in alone["computed"] and 1 not in one[(EAGER, PROMPTS[0])]["computed"]
    if layout == "cfg":  # each rank of the pair runs one pass per computed step (both at step 0)
        assert [o["cfg"]["stacks"] for o in observed[2]] == [len(alone["computed"]) + 1] * 2


def test_requests_made_to_disagree_keep_their_own_outputs_without_a_hang(observed):
    eager, never = (obs["forced"] for obs in observed[2])
    assert eager["digest"] == observed[1][(EAGER, PROMPTS[0])]["digest"]
    assert never["digest"] == observed[1][(NEVER, PROMPTS[1])]["digest"]
    assert eager["computed"] == EAGER_COMPUTED and never["computed"] == list(range(STEPS))
    # the eager request's rank ran the blocks of every step it reused, for its neighbour's all-gathers
    reused = STEPS - len(EAGER_COMPUTED)
    assert eager["ran_for_peers"] == 2 * reused and eager["stacks"] == never["stacks"] == 2 * STEPS


# --- the launcher: CFG 2 x Ulysses 2 and HSDP replicas with two prompts, at 4 ranks

LAUNCH_STEPS = ("--steps", "6", "--cache", "seacache")  # 6 steps: every one W8A16 under the demo's policy
LAUNCH_VIDEO = ("--frames", "5", "--height", "32", "--width", "32")  # 32 generation tokens: 16 a rank under Ulysses 2
LAUNCH_IMAGE = ("--frames", "1", "--height", "32", "--width", "32")


def _launch(root: str, report: str, *extra: str, rank: int = 0) -> dict | None:
    import json

    from fsdp_fp8.cli.runner import main

    assert main(["--checkpoint", root, *LAUNCH_STEPS, *extra, "--report", report]) == 0
    return json.loads(Path(report).read_text()) if rank == 0 else None  # rank 0 writes it


def _launch_all(rank: int, world: int, root: str, fixture: str, prompts: str, reports: str) -> dict:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}
    cfg_ulysses = ("--cfg-parallel", "--ulysses", "2") if world > 1 else ()
    layouts = {
        "cfg ulysses": (root, *LAUNCH_VIDEO, *cfg_ulysses),
        "replicas": (root, *LAUNCH_IMAGE, "--prompts", prompts, *(("--replicas", "2") if world > 1 else ())),
        # the real ModelOpt export's pipeline, eager (its 6 steps would reuse little at the default)
        "fixture cfg ulysses": (fixture, *LAUNCH_VIDEO, *cfg_ulysses, "--cache", f"seacache:{EAGER:g}"),
    }
    with mock.patch.dict(os.environ, env):
        return {
            k: _launch(path, f"{reports}/{world}-{k}.json", *args, rank=rank) for k, (path, *args) in layouts.items()
        }


@pytest.fixture(scope="module")
def launched(tmp_path_factory, roots):  # noqa: F811 - the fixture imported above
    reports = tmp_path_factory.mktemp("reports")
    prompts = reports / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = (*roots, str(prompts), str(reports))
    return {1: _launch_all(0, 1, *args), 4: run_ranks(_launch_all, 4, *args, timeout=600)[0]}


@pytest.mark.parametrize("layout", ["cfg ulysses", "replicas", "fixture cfg ulysses"])
def test_the_launcher_reports_each_requests_cached_steps_and_its_one_rank_latent(launched, layout):
    one, four = launched[1][layout]["outputs"], launched[4][layout]["outputs"]
    assert [(o["prompt"], o["latent_sha256"], o["step_cache"]) for o in four] == [
        (o["prompt"], o["latent_sha256"], o["step_cache"]) for o in one
    ]
    said = f"seacache {EAGER:g}" if layout.startswith("fixture") else "seacache 0.25"
    assert all(o["step_cache"].startswith(f"{said}: computed ") for o in one), one
    assert any("reused 0" not in o["step_cache"] for o in one), one  # the cache did skip passes


def test_the_cache_bench_reports_passes_wall_and_difference_in_one_run(capsys):
    from bench import cache

    assert cache.main(["--steps", "10", "--frames", "1", "--height", "32", "--width", "32"]) == 0
    out = capsys.readouterr().out
    assert "decisions        seacache 0.25: computed" in out
    stacks = out.split("decoder stacks   ")[1].split()
    assert int(stacks[0]) < int(stacks[2]) == 20, out  # fewer decoder stacks than 2 per step
    assert "denoising wall" in out and "PSNR" in out
