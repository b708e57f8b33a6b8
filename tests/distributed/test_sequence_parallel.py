"""Ulysses attention for Cosmos 3: the generation tokens of one pass split over a Ulysses group,
composed with FSDP2's FP8 sharding and CFG-parallel, latents bit-identical to the
one-rank sequential run.

The pipelines are test_cfg_parallel's: the embedded demo's (4 query heads, 2 key/value heads)
and one around the real ModelOpt 0.47 export (2 query heads, 1 key/value head: ranks share it).
Three sizes: the demo's default image (16 generation tokens), a multi-frame video (144 tokens)
and a 12-token image (shorter than a rank's 16 rows: it stays whole on the group's first rank),
2 steps each (step 1 is a CFG pair's exchange). The demo runs its step policy (every step W8A16);
the fixture W8A8 in its generation tower at every step, the rows Ulysses splits, and its reasoner,
whose text every rank keeps whole, W8A16 (W8A8 there is most of the work: CPU's slow
``torch._scaled_mm`` on ~170 text rows a pass, and no split to show). One spawn per world size
records what the tests judge.
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

from pipelines import digest as _digest  # noqa: E402
from ranks import run_ranks  # noqa: E402

from fsdp_fp8.format.step_policy import PUBLISHED_POLICY  # noqa: E402
from fsdp_fp8.runtime.parallel_layout import AttentionHeads, ParallelLayout, head_problems, layout_problems  # noqa: E402

STEPS = 2
# The fixture's: its generation tower W8A8 at every step (the split rows, whose bits are the point),
# its reasoner W8A16 (the text stays whole on every rank of a Ulysses group)
GENERATION_W8A8 = {
    **PUBLISHED_POLICY,
    "first_steps": {"count": 0, "mode": "a16"},
    "last_steps": {"count": 0, "mode": "a16"},
}
IMAGE = {"num_frames": 1, "height": 32, "width": 32}  # latent 8 x 8, patch 2: 16 generation tokens
VIDEO = {"num_frames": 9, "height": 64, "width": 48}  # latent 3 x 16 x 12: 144 generation tokens
# latent 6 x 8: 12 generation tokens, fewer than a rank's 16 rows: whole on the group's first rank
# (halves of 6 rows change torch._scaled_mm's bits on the fixture's 32-wide projections)
TINY = {"num_frames": 1, "height": 24, "width": 32}
SIZES = {"image": IMAGE, "video": VIDEO, "tiny": TINY}
SIZES_AT = {2: SIZES, 4: ("image", "video")}  # a pass kept whole is one group's matter: 2 ranks show it
PROMPTS = ("a red fox", "a lighthouse in a storm")


def _pipeline(root: str, cfg_parallel: bool = False, ulysses: int = 1, policy: str | dict = "auto"):
    """One loaded pipeline, run at every size and prompt of a layout (a user's pipeline serves
    many calls; each call is judged on its own counts)."""
    from fsdp_fp8 import load_pipeline

    pipe = load_pipeline(
        root,
        device=torch.device("cpu"),
        cfg_parallel=cfg_parallel,
        ulysses=ulysses,
        step_policy=policy,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.forwards = []
    pipe.transformer.register_forward_pre_hook(lambda *_: pipe.forwards.append(1))
    return pipe


def _generate(pipe, prompt: str, size: dict) -> dict:
    from fsdp_fp8 import routing_of
    from fsdp_fp8.fp8.linear import Float8StaticLinear
    from fsdp_fp8.interop.ulysses import Ulysses
    from fsdp_fp8.testing.collective_counts import counted

    groups = {id(m.shared): m.shared for m in pipe.transformer.modules() if isinstance(m, Float8StaticLinear)}
    groups.pop(id(None), None)
    generation = {id(m.shared) for m in routing_of(pipe.transformer).generation}
    towers = ["generation" if key in generation else "reasoner" for key in groups]

    def counts() -> tuple[int, list[int]]:
        return len(pipe.forwards), [g.quantizations for g in groups.values()]

    before = counts()
    with counted(Ulysses, "_all_to_all") as all_to_alls:
        out = pipe(
            prompt,
            **size,
            num_inference_steps=STEPS,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    after = counts()
    forwards = after[0] - before[0]
    return {
        "digest": _digest(out.video),
        "forwards": forwards,
        # each sibling group's quantizations of its one input per forward, by tower: SP changes no count
        "quantizations": sorted((t, (a - b) // forwards) for t, a, b in zip(towers, after[1], before[1])),
        "all_to_alls": all_to_alls.calls,
        "ours": [c.__name__ for c in type(pipe.transformer).__mro__ if c.__module__.startswith("fsdp_fp8")],
    }


def _launch(root: str, report: Path, *extra: str, rank: int = 0) -> dict | None:
    from fsdp_fp8.cli.runner import main

    argv = ["--checkpoint", root, "--frames", "1", "--height", "32", "--width", "32", "--steps", str(STEPS)]
    assert main([*argv, *extra, "--report", str(report)]) == 0
    return json.loads(report.read_text()) if rank == 0 else None


def _observe(rank: int, world: int, demo: str, fixture: str, prompts_file: str, reports: str) -> dict:
    obs: dict = {}
    pipelines = {"demo": demo, "fixture": fixture}
    # the demo with its step policy (2 steps: every step W8A16), the fixture's generation tower W8A8
    policies = {"demo": "auto", "fixture": GENERATION_W8A8}
    if world == 1:
        for name, root in pipelines.items():
            pipe = _pipeline(root, policy=policies[name])
            for label, size in SIZES.items():
                obs[f"{name} {label}"] = [_generate(pipe, p, size) for p in PROMPTS[: 2 if label == "image" else 1]]
        obs["launch"] = _launch(demo, Path(reports, "one.json"))
        obs["launch_prompts"] = _launch(demo, Path(reports, "one-prompts.json"), "--prompts", prompts_file)
        return obs
    layouts = {2: [("sp", False, 2)], 4: [("cfg sp", True, 2), ("sp", False, 4)]}[world]
    for key, cfg, sp in layouts:
        request = ParallelLayout(world, cfg_parallel=cfg, ulysses=sp).coordinates(rank).request
        for name, root in pipelines.items():
            if sp > 2 and name == "fixture":
                continue  # its 2 query heads split 2 ways at most
            pipe = _pipeline(root, cfg, sp, policies[name])
            for label, size in SIZES.items():
                if label in SIZES_AT[world]:
                    obs[f"{key} {name} {label}"] = _generate(pipe, PROMPTS[request], size)
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    with mock.patch.dict(os.environ, env):
        sp_args = ("--ulysses", "2")
        if world == 2:
            sp_args = ("--sequence-parallel", "2")  # the option's older name, still taken
            obs["launch"] = _launch(demo, Path(reports, "2.json"), *sp_args, rank=rank)
        else:
            prompts = ("--prompts", prompts_file)
            obs["launch_prompts"] = _launch(demo, Path(reports, "4-prompts.json"), *sp_args, *prompts, rank=rank)
            hsdp = ("--cfg-parallel", "--replicas", "2")
            obs["launch_hsdp"] = _launch(demo, Path(reports, "4-hsdp.json"), *sp_args, *hsdp, rank=rank)
    return obs


@pytest.fixture(scope="module")
def observed(tmp_path_factory, roots):  # noqa: F811 - the fixture imported above
    reports = tmp_path_factory.mktemp("reports")
    prompts = reports / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = (*roots, str(prompts), str(reports))
    out = {1: [_observe(0, 1, *args)]}
    out.update({w: run_ranks(_observe, w, *args, timeout=600) for w in (2, 4)})
    return out


CASES = [
    (2, "sp", 2, False),  # (world, key, degree, cfg)
    (4, "cfg sp", 2, True),
    (4, "sp", 4, False),
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("pipeline", ["demo", "fixture"])
@pytest.mark.parametrize(("world", "key", "degree", "cfg"), CASES)
def test_ulysses_latents_equal_the_sequential_run(observed, world, key, degree, cfg, pipeline, size):
    if degree > 2 and pipeline == "fixture":
        pytest.skip("the fixture's 2 query heads split 2 ways at most")
    if size not in SIZES_AT[world]:
        pytest.skip(f"the {size} size runs at 2 ranks only")
    sequential = observed[1][0][f"{pipeline} {size}"]
    if size == "image":
        assert sequential[0]["digest"] != sequential[1]["digest"]  # the two prompts differ
    for rank, obs in enumerate(observed[world]):
        layout = ParallelLayout(world, cfg_parallel=cfg, ulysses=degree)
        got = obs[f"{key} {pipeline} {size}"]
        want = sequential[layout.coordinates(rank).request]
        assert got["digest"] == want["digest"], (rank, layout)
        # W8A8 (the fixture's generation tower): each sibling group quantized its input once per
        # forward, as on one rank; W8A16 (the demo, the fixture's reasoner) never
        w8a8 = {"generation": int(pipeline == "fixture"), "reasoner": 0}
        assert got["quantizations"] == want["quantizations"] == [(t, w8a8[t]) for t, _ in got["quantizations"]]
        assert {t for t, _ in got["quantizations"]} == {"generation", "reasoner"}
        # two all-to-alls per layer and forward (q/k/v in, the output back)
        assert got["all_to_alls"] == 2 * 2 * got["forwards"]
        assert got["ours"] == ["PipelinedFSDPCosmos3OmniTransformer"]


def test_the_launcher_with_ulysses_equals_the_one_rank_run(observed):
    one = observed[1][0]["launch"]
    report = observed[2][0]["launch"]  # at 4 ranks: with --prompts and with CFG pairs, below
    assert report["parallelism"] == "Ulysses 2"
    assert report["latent_sha256"] == one["latent_sha256"]
    assert report["precision_trace"] == one["precision_trace"]


def test_the_launcher_spreads_prompts_over_the_request_groups(observed):
    one = observed[1][0]["launch_prompts"]
    report = observed[4][0]["launch_prompts"]
    assert report["parallelism"] == "Ulysses 2"
    want = [(r["index"], r["latent_sha256"]) for r in one["outputs"]]
    assert [(r["index"], r["latent_sha256"]) for r in report["outputs"]] == want
    assert {r["rank"] for r in report["outputs"]} == {0, 2}  # the first rank of each group writes


def test_the_launcher_composes_cfg_pairs_ulysses_groups_and_hsdp_replicas(observed):
    report = observed[4][0]["launch_hsdp"]
    assert report["mesh"] == [2, 2] and report["parallelism"] == "CFG 2 x Ulysses 2"
    assert report["latent_sha256"] == observed[1][0]["launch"]["latent_sha256"]


def test_the_layout_puts_ulysses_innermost_then_cfg_then_requests():
    layout = ParallelLayout(8, cfg_parallel=True, ulysses=4)
    assert layout.coordinates(5) == (0, 1, 1) and layout.requests == 1 and not layout.writes(5)
    assert [r for r in range(8) if layout.coordinates(r).cfg == 0] == [0, 1, 2, 3]  # one Ulysses group
    assert [layout.coordinates(r).ulysses for r in range(8)] == [0, 1, 2, 3] * 2  # pairs (0, 4) ... (3, 7)
    assert layout.describe() == "CFG 2 x Ulysses 4" and layout.work_sizes() == (1, 2, 4)
    pairs = ParallelLayout(4, cfg_parallel=True)
    assert [pairs.coordinates(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [ParallelLayout(8, ulysses=2).coordinates(r).request for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ParallelLayout(8, replicas=2).weight_sizes() == (2, 4)


@pytest.mark.parametrize(
    ("world", "cfg", "degree", "replicas", "needle"),
    [
        (6, False, 4, 1, "a world of 6 ranks cannot be cut into Ulysses groups of 4: 4 must divide 6"),
        (4, True, 4, 1, "CFG pairs of Ulysses groups of 4 (8 ranks per request): 8 must divide 4"),
        (3, True, 1, 1, "CFG-parallel runs ranks in pairs: it needs an even world size, got 3"),
        (4, False, 0, 1, "the Ulysses degree must be >= 1, got 0"),
        (4, False, 1, 3, "replicas 3 does not divide the world size 4"),
    ],
)
def test_a_world_the_layout_cannot_cut_is_named(world, cfg, degree, replicas, needle):
    from fsdp_fp8 import LayoutError

    assert any(needle in p for p in layout_problems(world, cfg, degree, replicas))
    with pytest.raises(LayoutError, match="cannot be cut|even world size|>= 1|does not divide"):
        ParallelLayout(world, cfg_parallel=cfg, ulysses=degree, replicas=replicas)


def test_a_degree_the_heads_cannot_take_names_both_counts():
    config = {"num_attention_heads": 64, "num_key_value_heads": 8}
    assert head_problems(AttentionHeads.of(config), 4) == head_problems(AttentionHeads.of(config), 8) == []
    shared = AttentionHeads.of({"num_attention_heads": 2, "num_key_value_heads": 1})
    assert head_problems(shared, 2) == []  # ranks share the kv head
    (problem,) = head_problems(AttentionHeads.of(config, "T/config.json"), 3)
    assert "64 query heads and 8 key/value heads (T/config.json)" in problem and "Ulysses degree of 3" in problem
    (problem,) = head_problems(AttentionHeads.of({"num_attention_heads": 24, "num_key_value_heads": 8}), 16)
    assert "24 query heads and 8 key/value heads" in problem  # 16 divides neither the heads nor 24
    with pytest.raises(ValueError, match="Ulysses degree of 3 cannot split"):  # the layout checks them once
        ParallelLayout(6, ulysses=3, heads=AttentionHeads.of(config))


def test_load_pipeline_refuses_a_degree_before_loading(roots):  # noqa: F811
    from fsdp_fp8 import load_pipeline

    with pytest.raises(ValueError, match="Ulysses groups of 2: 2 must divide 1"):
        load_pipeline(roots[0], device=torch.device("cpu"), sequence_parallel=2)
    with pytest.raises(ValueError, match="name one degree"):
        load_pipeline(roots[0], device=torch.device("cpu"), sequence_parallel=2, ulysses=4)


@pytest.mark.parametrize("size", [2, 4])
def test_every_ranks_rows_through_an_fp8_linear_give_the_one_rank_bits(size):
    """W8A8 on CPU: a GEMM of a few rows can round differently from the same rows of a larger
    one (``torch._scaled_mm``), so a rank's slice is at least 16 rows, or the whole pass."""
    from small_models import random_fp8_linear

    from fsdp_fp8.interop.ulysses import Ulysses

    lin, g = random_fp8_linear(32, 96, "cpu")
    for length in (6, 12, 20, 30, 37, 64):
        x = torch.randn(length, 32, generator=g).to(torch.bfloat16)
        rotary = (torch.empty(0), torch.empty(0), torch.zeros(length, 4), torch.zeros(length, 4))
        parts = []
        for position in range(size):
            _, rows, _ = Ulysses(None, position, size).shard(torch.empty(0), x, rotary)
            parts.append(lin(rows))
        assert torch.equal(torch.cat(parts)[:length], lin(x)), length


# --- the transformer alone: other head counts, the separately normalised text key, W8A8 and W8A16
# in the generation tower (the reasoner's text stays whole on every rank: W8A16, in both modes)

LATENTS = {"45 tokens, 3 frames": (3, 10, 6), "22 tokens": (1, 4, 22), "12 tokens": (1, 6, 8)}
MODELS = {  # the demo's transformer with other heads, and with use_und_k_norm_for_gen
    "8 heads, 4 kv": dict(num_attention_heads=8, num_key_value_heads=4),
    "k norm for gen": dict(qk_norm_for_text=False, use_und_k_norm_for_gen=True),
}


def _transformer_outputs(rank: int, world: int, paths: dict, degree: int) -> dict:
    """Each model's vision prediction per latent and generation-tower mode, the transformer run
    through its one subclass of ours with a Ulysses group of ``degree`` (1: none)."""
    from fsdp_fp8 import Float8StaticLinear, install_step_policy, load_model, share_quantized_inputs
    from fsdp_fp8.interop.cosmos import latent_shape, pack_inputs
    from fsdp_fp8.interop.forward_state import PipelineState, attach_pipeline_state
    from fsdp_fp8.interop.ulysses import Ulysses, install_ulysses
    from fsdp_fp8.runtime.parallel_layout import ParallelLayout
    from fsdp_fp8.runtime.parallel_mesh import build_mesh

    out = {}
    for name, path in paths.items():
        loaded = load_model(None, path, device=torch.device("cpu"))
        model = loaded.model
        share_quantized_inputs(model)
        ulysses = None
        if degree > 1:
            ulysses = Ulysses.of(build_mesh(ParallelLayout(world, ulysses=degree), "cpu"))
            install_ulysses(model, ulysses)
        attach_pipeline_state(model, PipelineState(install_step_policy(model, None), ulysses=ulysses))
        for mode in ("native", "a16"):
            for n, m in model.named_modules():
                if isinstance(m, Float8StaticLinear):
                    # W8A8 on rows no rank splits shows nothing (CPU's torch._scaled_mm is slow)
                    m.mode = "a16" if loaded.towers[n] == "reasoner" else mode
            for label, latent in LATENTS.items():
                g = torch.Generator().manual_seed(len(label))
                ids = torch.randint(0, model.config.vocab_size, (7,), generator=g)
                x = torch.randn(latent_shape(model.config, *latent), generator=g).to(torch.bfloat16)
                with torch.no_grad():
                    out[(name, mode, label)] = model(**pack_inputs(model.config, ids, x, 500.0))[0][0]
    return out


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    from fsdp_fp8.generation.demo import TRANSFORMER_CONFIG
    from fsdp_fp8.testing.cosmos3_checkpoint import write_cosmos3_checkpoint

    paths = {}
    for name, changes in MODELS.items():
        config = {**TRANSFORMER_CONFIG, "vocab_size": 256, **changes}
        paths[name] = str(write_cosmos3_checkpoint(tmp_path_factory.mktemp(name.replace(" ", "-")), config))
    return {
        1: _transformer_outputs(0, 1, paths, 1),
        2: run_ranks(_transformer_outputs, 2, paths, 2, timeout=600),
        4: run_ranks(_transformer_outputs, 4, paths, 4, timeout=600),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_the_transformer_split_over_a_ulysses_group_gives_the_one_rank_bits(transformers, world):
    """Both modes of the generation tower, three sizes (uneven rows, fewer than 16 per rank), 8
    query / 4 key-value heads and a text key normalised apart for the generation pathway
    (``k_norm_und_for_gen``)."""
    one = transformers[1]
    for rank, got in enumerate(transformers[world]):
        assert got.keys() == one.keys()
        differ = sorted(key for key in one if not torch.equal(got[key], one[key]))
        assert differ == [], (rank, differ)
