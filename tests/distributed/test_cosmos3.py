"""Cosmos 3 end to end: a real ModelOpt export of diffusers' ``Cosmos3OmniTransformer`` and the
``Cosmos3OmniPipeline`` around it, sharded, with the step policy on the right towers.

The fixture (tests/fixtures/make_hf_fixtures.py, ``cosmos3-transformer``) is ModelOpt 0.47's own
export with ``FP8_DEFAULT_CFG``: besides both towers, ``proj_in`` and ``time_embedder.*`` are
FP8 too, so "never switched" is tested on real FP8 linears. ModelOpt writes no step policy;
the tests that need one add the published policy to a copy of ``config.json`` (as the
official builds carry it). The pipeline is the embedded demo's (``fsdp_fp8.generation.demo``).

One spawn per world size (world size 1: this process) records what the tests judge.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("diffusers")
# The module's spawns (world sizes 2 and 4, each rank importing diffusers) are set up by the
# first test that asks for them; on a shared, loaded machine that alone can pass the default 300 s.
pytestmark = pytest.mark.timeout(900)

from pipelines import COSMOS3_FIXTURE as FIXTURE  # noqa: E402
from pipelines import LAUNCH_SIZE, PIPE_SIZE, with_policy  # noqa: E402, F401
from pipelines import digest as _digest  # noqa: E402
from ranks import run_ranks  # noqa: E402
from small_models import load_files  # noqa: E402

FLUX = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-flux-transformer"
WORLD_SIZES = (1, 2, 4)
# 7 steps under the published policy: one W8A8 step in the middle (CPU's torch._scaled_mm is slow)
STEPS, CHECKED_STEPS = 7, (0, 3, 6)  # first, the middle one, last
COND, UNCOND = torch.arange(5), torch.arange(7) + 9  # und rows 5 / 7; gen rows 4 (latent 4x4, patch 2)
LATENT = (1, 4, 1, 4, 4)
EXPECTED_TRACE = "W8A16 x3 / W8A8 x1 / W8A16 x3"


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


# --- the wiring check: which sequence each FP8 linear receives, and its precision per step ----


def wiring_mismatches(model, policy, towers) -> tuple[dict, list[str]]:
    """Install ``towers``, run a STEPS-step CFG loop, and compare each FP8 linear's precision at
    the checked steps with what the *observed* tower says it must be.

    A linear's tower is observed, not named: one called inside a decoder layer on as many rows
    as that call's understanding sequence is the reasoner's, on as many as its generation
    sequence the generation tower's (the lengths differ by construction); one called outside
    every decoder layer is in neither tower.
    """
    from fsdp_fp8 import Float8StaticLinear, denoising_step, install_step_policy
    from fsdp_fp8.interop.cosmos import denoise

    install_step_policy(model, policy, towers)
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Float8StaticLinear)}
    running: list[tuple[int, int]] = []  # (und rows, gen rows) of the decoder layer now running
    kinds: dict[str, set] = {n: set() for n in fp8}
    modes: dict[tuple[int, str], set] = {}
    step = [None]
    handles = []
    for layer in model.layers:
        handles.append(layer.register_forward_pre_hook(lambda _m, a: running.append((a[0].shape[0], a[1].shape[0]))))
        handles.append(layer.register_forward_hook(lambda *_: running.pop() and None))  # None: keep the output
    for name, module in fp8.items():

        def record(mod, args, name=name):
            rows = args[0].reshape(-1, mod.in_features).shape[0]
            if not running:
                kinds[name].add("other")
            else:
                und, gen = running[-1]
                kinds[name].add("und" if rows == und else "gen" if rows == gen else f"? {rows} rows")
            modes.setdefault((step[0], name), set()).add(mod.mode)

        handles.append(module.register_forward_pre_hook(record))

    class Step:
        def __init__(self, i, n):
            self.inner = denoising_step(model, i, n)
            step[0] = i

        def __enter__(self):
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    try:
        denoise(model, COND, UNCOND, steps=STEPS, seed=0, guidance=3.0, shape=LATENT, step_context=Step)
    finally:
        for h in handles:
            h.remove()
    problems = [f"`{n}` was seen as {sorted(k)}" for n, k in kinds.items() if len(k) != 1]
    for name, kind in kinds.items():
        kind = next(iter(kind))
        for s in CHECKED_STEPS:
            want = {"und": policy.reasoner, "gen": policy.precision(s, STEPS), "other": "native"}.get(kind)
            got = modes.get((s, name))
            if got != {want}:
                problems.append(f"`{name}` ({kind}) ran {sorted(got or [])} at step {s}, expected {want}")
    return {n: next(iter(k)) for n, k in kinds.items() if len(k) == 1}, problems


def swapped(towers: dict) -> dict:
    return {n: {"reasoner": "generation", "generation": "reasoner"}.get(t, t) for n, t in towers.items()}


def _observe(rank: int, world: int, policy_dir: str, pipeline_root: str, report_dir: str) -> dict:
    from fsdp_fp8 import gather_state_dict, load_model
    from fsdp_fp8.cli.runner import main
    from fsdp_fp8.format.step_policy import parse_step_policy
    from fsdp_fp8.interop.cosmos import seeded_inputs

    obs: dict = {}
    loaded = load_model(None, FIXTURE, device=torch.device("cpu"))
    gathered = gather_state_dict(loaded.model)
    obs["mismatches"] = None
    if rank == 0:
        files = load_files(FIXTURE)
        obs["mismatches"] = (
            [f"missing {k}" for k in sorted(set(files) - set(gathered))]
            + [f"extra {k}" for k in sorted(set(gathered) - set(files))]
            + [
                f"bytes differ: {k}"
                for k in sorted(set(files) & set(gathered))
                if not _same_bytes(gathered[k], files[k])
            ]
        )
    obs["fp8"], obs["towers"] = len(loaded.fp8_linears), loaded.towers
    with torch.no_grad():
        out = loaded.model(**seeded_inputs(loaded.model.config, torch.bfloat16, torch.Generator().manual_seed(0)))
    obs["output"] = out[0][0].float()
    if world > 2:  # HSDP through the launcher: 2 replica groups of 2 ranks
        with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
            report = Path(report_dir, f"transformer-{world}-hsdp.json")
            argv = ["--checkpoint", policy_dir, "--steps", str(STEPS), "--replicas", "2", "--report", str(report)]
            assert main(argv) == 0
            obs["launched_hsdp"] = json.loads(report.read_text()) if rank == 0 else None
            report = Path(report_dir, f"pipeline-{world}-hsdp.json")
            argv = ["--checkpoint", pipeline_root, *LAUNCH_SIZE, "--steps", str(STEPS), "--replicas", "2"]
            argv += ["--report", str(report)]
            assert main(argv) == 0
            obs["pipeline_hsdp"] = json.loads(report.read_text()) if rank == 0 else None
        return obs

    policy_loaded = load_model(None, policy_dir, device=torch.device("cpu"))
    policy = parse_step_policy(policy_loaded.checkpoint.quant.step_policy)
    obs["observed"], obs["wiring"] = wiring_mismatches(policy_loaded.model, policy, policy_loaded.towers)
    _, obs["wiring_swapped"] = wiring_mismatches(policy_loaded.model, policy, swapped(policy_loaded.towers))

    from fsdp_fp8 import load_pipeline, routing_of

    pipe = load_pipeline(pipeline_root, device=torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    generation = routing_of(pipe.transformer).generation[0]
    calls = []
    handle = generation.register_forward_pre_hook(lambda m, a: calls.append(m.mode))
    out = pipe(
        "a red fox",
        **PIPE_SIZE,
        num_inference_steps=STEPS,
        guidance_scale=3.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    handle.remove()
    obs["pipe_digest"], obs["pipe_calls"] = _digest(out.video), calls
    obs["pipe_trace"] = list(routing_of(pipe.transformer).trace)

    # the launcher reads RANK / WORLD_SIZE; patch.dict restores the environment whatever happens
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}):
        report = Path(report_dir, f"transformer-{world}.json")
        assert main(["--checkpoint", policy_dir, "--steps", str(STEPS), "--report", str(report)]) == 0
        obs["launched"] = json.loads(report.read_text()) if rank == 0 else None
        if world == 1:  # the reference for the HSDP run of the demo pipeline
            report = Path(report_dir, "pipeline-1.json")
            argv = ["--checkpoint", pipeline_root, *LAUNCH_SIZE, "--steps", str(STEPS), "--report", str(report)]
            assert main(argv) == 0
            obs["pipeline"] = json.loads(report.read_text())
    return obs


@pytest.fixture(scope="module")
def pipeline_root(demo_root):
    return demo_root


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return with_policy(FIXTURE, tmp_path_factory.mktemp("policy") / "cosmos3")


@pytest.fixture(scope="module")
def observed(tmp_path_factory, policy_dir, pipeline_root):
    reports = str(tmp_path_factory.mktemp("reports"))
    args = (str(policy_dir), str(pipeline_root), reports)
    out = {1: [_observe(0, 1, *args)]}
    out.update({w: run_ranks(_observe, w, *args, timeout=300) for w in WORLD_SIZES if w > 1})
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fixture_gathers_back_to_the_files_bit_for_bit(observed, world):
    assert observed[world][0]["mismatches"] == []
    assert observed[world][0]["fp8"] == 31  # 14 per tower + proj_in + time_embedder.linear_1/2


@pytest.mark.parametrize("world", (2, 4))
def test_transformer_output_is_identical_at_every_world_size(observed, world):
    for rank_obs in observed[world]:
        assert torch.equal(rank_obs["output"], observed[1][0]["output"])


def test_output_matches_a_dequantize_then_matmul_reference(observed):
    from diffusers import Cosmos3OmniTransformer

    from fsdp_fp8.interop.cosmos import seeded_inputs

    files = load_files(FIXTURE)
    state = {
        k: (
            v.float() * files[k.removesuffix(".weight") + ".weight_scale"]
            if v.dtype == torch.float8_e4m3fn
            else v.float()
        )
        for k, v in files.items()
        if not k.endswith("_scale")
    }
    config = {k: v for k, v in Cosmos3OmniTransformer.load_config(FIXTURE).items() if k != "quantization_config"}
    model = Cosmos3OmniTransformer.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == [] and unexpected == []
    inputs = seeded_inputs(model.config, torch.bfloat16, torch.Generator().manual_seed(0))
    inputs["vision_tokens"] = [t.float() for t in inputs["vision_tokens"]]  # the same values, in float32
    with torch.no_grad():
        expected = model(**inputs)[0][0]
    got = observed[1][0]["output"]
    assert not torch.equal(got, expected)  # activations really go through FP8
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=0.1 * scale, rtol=0.1)
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("world", (1, 2))
def test_each_fp8_linear_runs_its_observed_towers_precision_at_first_middle_and_last_step(observed, world):
    for rank_obs in observed[world]:
        assert rank_obs["wiring"] == []
        seen = rank_obs["observed"]
        assert sorted(set(seen.values())) == ["gen", "other", "und"]
        # The map agrees with what the hooks saw, linear by linear (the evidence in docs/interop.md).
        names = {"und": "reasoner", "gen": "generation", "other": "other"}
        assert {n: names[k] for n, k in seen.items()} == {n: t for n, t in rank_obs["towers"].items() if n in seen}


@pytest.mark.parametrize("world", (1, 2))
def test_swapping_the_two_towers_in_the_map_is_caught(observed, world):
    for rank_obs in observed[world]:
        problems = rank_obs["wiring_swapped"]
        assert problems and all("(und)" in p or "(gen)" in p for p in problems)


@pytest.mark.parametrize("world", (1, 2))
def test_pipeline_seven_steps_with_cfg_same_digest_and_the_published_trace(observed, world):
    from fsdp_fp8.format.step_policy import describe_trace

    reference = observed[1][0]
    for rank_obs in observed[world]:
        assert rank_obs["pipe_digest"] == reference["pipe_digest"]
        assert describe_trace(rank_obs["pipe_trace"]) == EXPECTED_TRACE
        # Both guidance passes of each step ran the generation tower at that step's precision.
        calls = rank_obs["pipe_calls"]
        assert set(rank_obs["pipe_trace"]) == {"W8A16", "W8A8"}  # the launcher's words, not the policy's
        assert [{"a16": "W8A16", "native": "W8A8"}[c] for c in calls] == [
            p for p in rank_obs["pipe_trace"] for _ in range(2)
        ]


@pytest.mark.parametrize("world", (1, 2))
def test_launcher_runs_a_transformer_directory_alone(observed, world):
    report = observed[world][0]["launched"]
    assert report["precision_trace"] == EXPECTED_TRACE
    assert report["latent_sha256"] == observed[1][0]["launched"]["latent_sha256"]


def test_launcher_with_two_replicas_on_four_ranks_equals_the_1d_runs(observed):
    report = observed[4][0]["launched_hsdp"]
    assert report["mesh"] == [2, 2] and report["world_size"] == 4
    assert report["precision_trace"] == EXPECTED_TRACE
    assert report["latent_sha256"] == observed[1][0]["launched"]["latent_sha256"]
    pipeline = observed[4][0]["pipeline_hsdp"]  # the demo pipeline, through the launcher
    assert pipeline["mesh"] == [2, 2] and pipeline["precision_trace"] == EXPECTED_TRACE
    assert pipeline["latent_sha256"] == observed[1][0]["pipeline"]["latent_sha256"]
    # One replica group (ranks 0, 1) reads the whole transformer, as one process does.
    read = [row["bytes_read"] for row in pipeline["ranks"]]
    assert read[0] + read[1] >= observed[1][0]["pipeline"]["ranks"][0]["bytes_read"] and read[:2] == read[2:]
    # Each rank reads what the rank at its shard coordinate reads in a 2-rank run.
    two = [row["bytes_read"] for row in observed[2][0]["launched"]["ranks"]]
    assert [row["bytes_read"] for row in report["ranks"]] == two + two


# --- single process: the tower map's refusals --------------------------------------------


def test_a_policy_that_needs_towers_on_a_class_with_none_is_refused(tmp_path):
    from fsdp_fp8 import CheckpointError, load_model

    flux = with_policy(FLUX, tmp_path / "flux")
    with pytest.raises(CheckpointError, match="no known tower map") as info:
        load_model(None, flux, device=torch.device("cpu"))
    assert "towers=" in str(info.value) and "FluxTransformer2DModel" in str(info.value)
    # The same checkpoint loads once the user says which linear is in which tower.
    loaded = load_model(
        None,
        flux,
        device=torch.device("cpu"),
        towers=lambda m: {n: "generation" for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)},
    )
    assert set(loaded.towers.values()) == {"generation"}


def test_a_policy_whose_towers_agree_needs_no_map(tmp_path):
    from fsdp_fp8 import load_model
    from fsdp_fp8.format.step_policy import PUBLISHED_POLICY

    plain = copy.deepcopy(PUBLISHED_POLICY)
    plain["first_steps"]["count"] = plain["last_steps"]["count"] = 0
    plain["reasoner"] = "native"
    loaded = load_model(None, with_policy(FLUX, tmp_path / "flux", plain), device=torch.device("cpu"))
    assert loaded.towers is None


def test_a_tower_map_that_misses_an_fp8_linear_is_refused(policy_dir):
    from fsdp_fp8 import CheckpointError, load_model
    from fsdp_fp8.runtime.towers import cosmos3_towers

    def partial(model):
        return {k: v for k, v in cosmos3_towers(model).items() if k != "layers.1.mlp_moe_gen.down_proj"}

    with pytest.raises(CheckpointError, match="`layers.1.mlp_moe_gen.down_proj` is in no tower"):
        load_model(None, policy_dir, device=torch.device("cpu"), towers=partial)


def test_diffusers_own_classification_swaps_the_attention_projections():
    """The evidence docs/interop.md cites: diffusers 0.42's mixed-precision helper labels
    to_q/k/v/out "generation" and add_q/k/v_proj/to_add_out "reasoner", against what the hooks
    observe (test above); its MLP labels agree with ours."""
    mixed = pytest.importorskip("diffusers.pipelines.cosmos.mixed_precision")
    classify = getattr(mixed, "_classify_cosmos3_linear", None)
    if classify is None:
        pytest.skip("this diffusers has no _classify_cosmos3_linear")
    from diffusers import Cosmos3OmniTransformer

    from fsdp_fp8.runtime.towers import cosmos3_towers

    ours = cosmos3_towers(Cosmos3OmniTransformer.from_config(Cosmos3OmniTransformer.load_config(FIXTURE)))
    differ = sorted(n for n, t in ours.items() if t != "other" and classify(n) != t)
    assert differ == sorted(n for n in ours if ".self_attn." in n)


def test_load_pipeline_refuses_what_it_would_have_to_guess_or_run(tmp_path, pipeline_root):
    from fsdp_fp8 import load_pipeline

    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_pipeline(FIXTURE, device=torch.device("cpu"))
    custom = tmp_path / "custom"
    shutil.copytree(pipeline_root, custom)
    index = json.loads((custom / "model_index.json").read_text())
    index["vae"] = ["my_vae_package", "MyVAE"]
    (custom / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="`vae` comes from module 'my_vae_package'"):
        load_pipeline(custom, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="`transformer`"):
        load_pipeline(pipeline_root, device=torch.device("cpu"), transformer=None)
    with pytest.raises(ValueError, match="never runs code"):
        load_pipeline(pipeline_root, device=torch.device("cpu"), trust_remote_code=True)


def test_a_pipeline_transformer_called_outside_a_denoising_step_is_refused(pipeline_root):
    from fsdp_fp8 import denoising_step, load_pipeline
    from fsdp_fp8.interop.cosmos import seeded_inputs

    model = load_pipeline(pipeline_root, device=torch.device("cpu")).transformer
    inputs = seeded_inputs(model.config, torch.bfloat16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="outside a denoising step"):
            model(**inputs)  # the policy could not be applied: refused, not run at W8A8
        with denoising_step(model, 3, STEPS) as precision:  # the middle step: W8A8
            model(**inputs)
    assert precision == "W8A8"


def test_a_loaded_pipeline_carries_no_attribute_of_ours_and_is_freed_when_dropped(pipeline_root):
    import gc
    import weakref

    from fsdp_fp8 import load_pipeline, loaded_of, routing_of

    pipe = load_pipeline(pipeline_root, device=torch.device("cpu"))
    model = pipe.transformer
    assert loaded_of(pipe).model is model
    assert routing_of(model).generation  # the policy's routing, kept beside the model
    objects = {"pipe": pipe} | {f"transformer.{n}".rstrip("."): m for n, m in model.named_modules()}
    ours = {
        name: sorted(k for k in vars(obj) if k.startswith("fsdp_fp8") or k == "cache_context")
        for name, obj in objects.items()
    }
    assert {n: keys for n, keys in ours.items() if keys} == {}
    refs = [weakref.ref(pipe), weakref.ref(model)]
    del pipe, model, objects
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


def test_outputs_are_files_an_image_or_video_reader_opens(tmp_path):
    from PIL import Image

    from fsdp_fp8.cli.outputs import check_output
    from fsdp_fp8.generation.engine import save_frames
    from fsdp_fp8.generation.results import output_path

    frames = [Image.new("RGB", (16, 16), (40 * i, 255 - 40 * i, 90)) for i in range(3)]
    save_frames(frames[:1], tmp_path / "one.png", fps=24)
    save_frames(frames, tmp_path / "three.png", fps=24)
    with Image.open(tmp_path / "one.png") as one, Image.open(tmp_path / "three.png") as three:
        assert (one.format, one.size, getattr(one, "n_frames", 1)) == ("PNG", (16, 16), 1)
        assert (three.format, three.n_frames) == ("PNG", 3)  # an animated PNG, every frame kept
        three.seek(2)
        assert three.convert("RGB").getpixel((0, 0)) == (80, 175, 90)
    assert output_path(str(tmp_path / "out.png"), 7, many=True).name == "out-007.png"
    assert output_path(str(tmp_path / "out.png"), 7, many=False).name == "out.png"
    with pytest.raises(ValueError, match=r"\.png .* or \.mp4"):
        check_output(str(tmp_path / "out.gif"))
    with pytest.raises(ValueError, match="does not exist"):
        check_output(str(tmp_path / "missing" / "out.png"))
    try:
        import imageio_ffmpeg
    except ImportError:
        with pytest.raises(ValueError, match="imageio-ffmpeg"):
            check_output(str(tmp_path / "out.mp4"))  # refused before anything is loaded
        return
    check_output(str(tmp_path / "out.mp4"))
    save_frames(frames, tmp_path / "out.mp4", fps=24)
    frames_read, _seconds = imageio_ffmpeg.count_frames_and_secs(str(tmp_path / "out.mp4"))  # ffmpeg decodes it
    assert frames_read == 3
