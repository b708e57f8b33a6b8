"""CFG-parallel: the two guidance passes of each step on the two ranks of a pair, latents
bit-identical to the sequential run.

The reference is what ``Cosmos3OmniPipeline`` itself does on one process: two batch-1 passes
per step, cond then uncond (it never batches them together), which is also what each rank of
a pair computes. Two pipelines: the embedded demo's, and one whose transformer is the real
ModelOpt 0.47 export (tests/fixtures, with the published step policy added) beside the demo's
VAE and scheduler and a character tokenizer that fits the fixture's 64-token vocabulary.

One spawn per world size records what the tests judge; world size 1 is this process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import LAUNCH_SIZE, PIPE_SIZE  # noqa: E402
from pipelines import digest as _digest  # noqa: E402
from ranks import run_ranks  # noqa: E402

# 7 steps under the published policy: one W8A8 step (CPU's torch._scaled_mm is slow: one shows it)
STEPS = 7
EXPECTED_TRACE = "W8A16 x3 / W8A8 x1 / W8A16 x3"
PROMPTS = ("a red fox", "a lighthouse in a storm")


def _generate(root: str, prompt: str, cfg_parallel: bool) -> dict:
    from fsdp_fp8 import load_pipeline, routing_of
    from fsdp_fp8.interop.cfg_parallel import CfgPair
    from fsdp_fp8.testing.collective_counts import counted

    pipe = load_pipeline(root, device=torch.device("cpu"), cfg_parallel=cfg_parallel)
    pipe.set_progress_bar_config(disable=True)
    forwards = []  # the forwards this rank really ran (FSDP's pre-forward hook runs with each)
    pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    with counted(CfgPair, "_exchange") as exchanges:
        out = pipe(
            prompt,
            **PIPE_SIZE,
            num_inference_steps=STEPS,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    routing = routing_of(pipe.transformer)
    return {
        "digest": _digest(out.video),
        "ours": [c.__name__ for c in type(pipe.transformer).__mro__ if c.__module__.startswith("fsdp_fp8")],
        "forwards": len(forwards),
        "trace": routing.summary(),
        "exchanges": exchanges.calls,
    }


def _launch(root: str, report: Path, *extra: str, rank: int = 0) -> dict | None:
    from fsdp_fp8.cli.runner import main

    argv = ["--checkpoint", root, *LAUNCH_SIZE, "--steps", str(STEPS), *extra, "--report", str(report)]
    assert main(argv) == 0
    return json.loads(report.read_text()) if rank == 0 else None  # rank 0 writes it


def _observe(rank: int, world: int, demo_root: str, fixture_root: str, prompts_file: str, reports: str) -> dict:
    obs: dict = {}
    if world == 1:
        for name, root in (("demo", demo_root), ("fixture", fixture_root)):
            obs[name] = [_generate(root, p, cfg_parallel=False) for p in PROMPTS]
        obs["launch"] = _launch(demo_root, Path(reports, "one.json"))
        obs["launch_prompts"] = _launch(demo_root, Path(reports, "one-prompts.json"), "--prompts", prompts_file)
        return obs
    pair = rank // 2
    for name, root in (("demo", demo_root), ("fixture", fixture_root)):
        obs[name] = _generate(root, PROMPTS[pair], cfg_parallel=True)  # world 4: 2 prompts x CFG 2
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    with mock.patch.dict(os.environ, env):
        args = ("--cfg-parallel", "--prompts", prompts_file)
        obs["launch_prompts"] = _launch(demo_root, Path(reports, f"{world}-prompts.json"), *args, rank=rank)
        if world == 4:  # HSDP 2 x 2 and CFG pairs
            hsdp = ("--cfg-parallel", "--replicas", "2")
            obs["launch_hsdp"] = _launch(demo_root, Path(reports, "4-hsdp.json"), *hsdp, rank=rank)
    return obs


@pytest.fixture(scope="module")
def observed(tmp_path_factory, roots):
    reports = tmp_path_factory.mktemp("reports")
    prompts = reports / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = (*roots, str(prompts), str(reports))
    out = {1: [_observe(0, 1, *args)]}
    out.update({w: run_ranks(_observe, w, *args, timeout=600) for w in (2, 4)})
    return out


@pytest.mark.parametrize("pipeline", ["demo", "fixture"])
@pytest.mark.parametrize("world", [2, 4])
def test_cfg_parallel_latents_equal_the_sequential_run(observed, world, pipeline):
    sequential = observed[1][0][pipeline]
    assert sequential[0]["digest"] != sequential[1]["digest"]  # the two prompts differ
    assert sequential[0]["forwards"] == 2 * STEPS
    for rank, obs in enumerate(observed[world]):
        got = obs[pipeline]
        assert got["digest"] == sequential[rank // 2]["digest"]  # pair k ran prompt k
        assert got["trace"] == sequential[rank // 2]["trace"] == EXPECTED_TRACE
        # step 0 runs both passes (it records the uncond inputs); every later step one per rank
        assert got["forwards"] == 2 + (STEPS - 1)
        assert got["exchanges"] == STEPS - 1
        assert got["ours"] == ["PipelinedFSDPCosmos3OmniTransformer"]  # one class of ours, whatever runs
    assert sequential[0]["ours"] == ["PipelinedCosmos3OmniTransformer"]  # one process: not sharded


@pytest.mark.parametrize("world", [2, 4])
def test_launcher_cfg_parallel_with_prompts_equals_the_one_rank_run(observed, world):
    one = observed[1][0]["launch_prompts"]
    report = observed[world][0]["launch_prompts"]
    assert report["cfg_parallel"] is True and one["cfg_parallel"] is False
    want = [(r["index"], r["prompt"], r["latent_sha256"], r["precision_trace"]) for r in one["outputs"]]
    got = [(r["index"], r["prompt"], r["latent_sha256"], r["precision_trace"]) for r in report["outputs"]]
    assert got == want  # each prompt once, from the cond rank of the pair that ran it
    assert {r["rank"] for r in report["outputs"]} == ({0} if world == 2 else {0, 2})


def test_launcher_cfg_parallel_on_hsdp_replicas(observed):
    report = observed[4][0]["launch_hsdp"]
    assert report["mesh"] == [2, 2] and report["cfg_parallel"] is True
    assert report["latent_sha256"] == observed[1][0]["launch"]["latent_sha256"]
    assert report["precision_trace"] == EXPECTED_TRACE


def test_an_odd_world_size_is_refused_before_loading(roots, tmp_path):
    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.cli.arguments import parse_run_args

    with pytest.raises(ValueError, match="needs an even world size, got 1"):
        load_pipeline(roots[0], device=torch.device("cpu"), cfg_parallel=True)
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "3"}), pytest.raises(SystemExit) as info:
        parse_run_args(["--cfg-parallel"])
    assert info.value.code == 2


def test_inputs_that_are_not_the_recorded_ones_are_refused_before_any_exchange():
    from fsdp_fp8.interop.cfg_parallel import CfgPair

    pair = CfgPair(group=None, rank=1)  # no group: an exchange would fail loudly, none must run
    ids, positions, latent, timesteps = torch.arange(3), torch.zeros(3, 3), torch.ones(4), torch.full((4,), 500.0)
    uncond_ids = ids[:2]

    def call(name, step, **kwargs):
        pair.current = (name, step)
        return pair.call(lambda **kw: ([kw["vision_tokens"][0] * 2], None, None), (), kwargs)

    per_step = {"vision_tokens": [latent], "vision_timesteps": timesteps}
    call("cond", 0, input_ids=ids, position_ids=positions, **per_step)
    call("uncond", 0, input_ids=uncond_ids, position_ids=positions, **per_step)
    with pytest.raises(RuntimeError, match=r"cond pass of step 1 got other step-invariant inputs .*input_ids"):
        call("cond", 1, input_ids=ids.clone(), position_ids=positions, **per_step)
    with pytest.raises(RuntimeError, match="did not follow its cond pass"):
        call("uncond", 1, input_ids=uncond_ids, position_ids=positions, **per_step)
