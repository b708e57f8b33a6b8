"""The memory forecast against what a run really holds: the demo Cosmos 3 pipeline (a real
``Cosmos3OmniPipeline`` around a ModelOpt-layout FP8 transformer) at two sizes, on 1 process and
on 2 FSDP ranks, alone and as a Ulysses group (``sequence_parallel=2``, the older name of ``ulysses``). The measured peak is the live tensor storage on the CPU during the denoising
loop (``fsdp_fp8.testing.live_bytes``), from the first transformer forward to the last step's
end; the VAE's encode before the loop is a separate phase the forecast leaves out."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from ranks import run_ranks  # noqa: E402

SIZES = ((128, 128, 9), (128, 256, 17))  # (height, width, frames): 967 and 2,759 tokens with the text
TOLERANCE = 0.15


def _measure(rank: int, world: int, root: str, sequence_parallel: int = 1) -> list[dict]:
    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.runtime.forecast import forecast_checkpoint
    from fsdp_fp8.testing.live_bytes import LiveBytes, module_tensors

    pipe = load_pipeline(root, device=torch.device("cpu"), sequence_parallel=sequence_parallel)
    pipe.set_progress_bar_config(disable=True)
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    out = []
    for height, width, frames in SIZES:
        loop: dict = {}
        with LiveBytes("cpu", module_tensors(*modules)) as live:

            def start(_module, _args, kwargs):
                if "text" not in loop:
                    loop["text"] = kwargs["und_len"]
                    live.reset_peak()

            def end(_pipe, _i, _t, _kwargs):
                loop["peak"] = max(loop.get("peak", 0), loop.get("before", 0), live.peak)
                return {}

            def stack_start(_module, _args):  # the decoder stack's own peak, kept apart
                if "text" in loop:
                    loop["before"] = max(loop.get("before", 0), live.peak)
                    live.reset_peak()

            def stack_end(_module, _args, _out):
                if "text" in loop:
                    loop["stack"] = max(loop.get("stack", 0), live.peak)

            layers = pipe.transformer.layers
            hooks = [layers[0].register_forward_pre_hook(stack_start), layers[-1].register_forward_hook(stack_end)]
            hook = pipe.transformer.register_forward_pre_hook(start, with_kwargs=True)
            pipe(
                "a red fox",
                num_frames=frames,
                height=height,
                width=width,
                num_inference_steps=2,
                guidance_scale=3.0,
                generator=torch.Generator().manual_seed(0),
                output_type="latent",
                callback_on_step_end=end,
            )
            hook.remove()
            for h in hooks:
                h.remove()
        forecast = forecast_checkpoint(
            root,
            world,
            height=height,
            width=width,
            frames=frames,
            text_tokens=loop["text"],
            ulysses=sequence_parallel,
        )
        out.append(
            {
                "measured": loop["peak"],
                "stack": loop["stack"],
                "forecast": forecast.device_bytes,
                "terms": forecast.lines(),
            }
        )
    return out


@pytest.fixture(scope="module")
def measured(demo_root):
    root = str(demo_root)
    return {
        1: [_measure(0, 1, root)],
        2: run_ranks(_measure, 2, root, timeout=600),
        "Ulysses 2": run_ranks(_measure, 2, root, 2, timeout=600),
    }


@pytest.mark.parametrize("run", [1, 2, "Ulysses 2"])
def test_forecast_is_within_15_percent_of_the_measured_peak_at_two_sizes(measured, run):
    rows = [r for rank in measured[run] for r in rank]
    assert len(rows) == len(SIZES) * len(measured[run])
    for row in rows:
        error = row["forecast"] / row["measured"] - 1
        assert abs(error) <= TOLERANCE, f"{error:+.1%}\n" + "\n".join(row["terms"])
    # the larger size really is dominated by activations, not weights: 2.85x the tokens, about
    # 2.9x the peak (a peak of weights would barely grow)
    assert rows[-1]["measured"] > 2.5 * rows[0]["measured"]


def test_a_sequence_groups_decoder_stack_holds_less_than_one_ranks(measured):
    """The stack on half the generation rows (the demo's peak is its time embedding, whole on
    every rank: the forecast says so, and the stack's own peak is what sequence parallelism cuts)."""
    for alone, split in zip(measured[2][0], measured["Ulysses 2"][0]):
        assert split["stack"] < alone["stack"], (split["stack"], alone["stack"])


@pytest.mark.parametrize(("budget_layers", "kept"), [(4, 0), (5, 1), (6, 3)])
def test_resident_auto_keeps_what_the_runs_rule_keeps_within_the_budget(budget_layers, kept):
    """inspect's --resident auto: the run's own choice (``choose_resident``) within the budget. Three
    layers of S bytes, prefetch on: a layer is kept while the kept ones, it and room for the two
    largest still streamed (each twice: the flat buffer and its copy) fit, so layer 0 needs 5 S,
    layer 1 6 S, and layer 2, the last, nothing more: 4 S keeps none, 5 S one, 6 S all three."""
    from fsdp_fp8.runtime.forecast import Tensor, TransformerShape, VideoSize, forecast

    shape = TransformerShape(64, 128, 4, 2, 16, 2, 4, 2)
    tensors = [Tensor(f"layers.{i}.mlp.up_proj.weight", (128, 64), 1) for i in range(3)]
    layer = 128 * 64
    auto = forecast(
        tensors, shape, VideoSize(64, 64, 1, 4, 4), 2, resident="auto", resident_budget=budget_layers * layer
    )
    terms = {t.name: t for t in auto.terms}
    assert terms["resident layers"].device_bytes == kept * layer if kept else "resident layers" not in terms
    with pytest.raises(ValueError, match="resident 'auto' needs resident_budget"):
        forecast(tensors, shape, VideoSize(64, 64, 1, 4, 4), 2, resident="auto")


def test_inspect_takes_the_runs_resident_choices_and_asks_auto_for_a_budget(demo_root, capsys):
    from fsdp_fp8.cli.commands import main

    base = ["inspect", str(demo_root), "--world-size", "2", "--height", "64", "--width", "64"]
    for extra, said in (
        (["--resident", "auto"], "--resident auto needs --resident-budget BYTES"),
        (["--resident-budget", "1GiB"], "--resident-budget applies to --resident auto"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main([*base, *extra])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert main([*base, "--resident", "auto", "--resident-budget", "1GiB"]) == 0
    assert "kept gathered" in capsys.readouterr().out  # 1 GiB holds the demo's two layers


def test_the_terms_are_named_and_add_up():
    from fsdp_fp8.runtime.forecast import Tensor, TransformerShape, VideoSize, forecast

    shape = TransformerShape(64, 128, 4, 2, 16, 2, 4, 2)
    tensors = [Tensor(f"layers.{i}.mlp.up_proj.weight", (128, 64), 1) for i in range(2)]
    tensors += [Tensor("embed_tokens.weight", (100, 64), 2)]
    one = forecast(tensors, shape, VideoSize(64, 64, 1, 4, 4), 2)
    names = [t.name for t in one.terms]
    assert names[:3] == ["sharded weights", "root unit, gathered", "decoder layers in flight"]
    assert one.device_bytes == sum(t.device_bytes for t in one.terms)
    assert dict((t.name, t.device_bytes) for t in one.terms)["decoder layers in flight"] == 2 * 128 * 64
    off = forecast(tensors, shape, VideoSize(64, 64, 1, 4, 4), 2, offload="cpu")
    assert off.host_bytes == one.terms[0].device_bytes and off.device_bytes < one.device_bytes
    resident = forecast(tensors, shape, VideoSize(64, 64, 1, 4, 4), 2, resident="all")
    assert "resident layers" in [t.name for t in resident.terms]
    with pytest.raises(ValueError, match="even world size, got 3"):
        forecast(tensors, shape, VideoSize(64, 64, 1), 3, cfg_parallel=True)


def _forecast_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("memory forecast per GPU"))


def test_inspect_counts_an_action_jobs_tokens_as_the_real_pipeline_builds_them(demo_cache, capsys):
    """The real pipeline (the action demo, policy, one step without guidance) measured at its
    transformer's call: its generation tokens (``sequence_length - und_len``) and its action tokens
    against inspect's count for a first frame of that size: one the tier's canvas downscales (no
    multiple of the VAE's factor; its content no whole latent pixel), one it keeps (never upscaled)."""
    import re

    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.cli.commands import main
    from fsdp_fp8.generation.demo import action_demo_checkpoint

    root = str(action_demo_checkpoint(demo_cache))
    pipe = load_pipeline(root, device=torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def call(_module, _args, kwargs):
        seen.update(generation=kwargs["sequence_length"] - kwargs["und_len"], actions=kwargs["action_token_shapes"])

    hook = pipe.transformer.register_forward_pre_hook(call, with_kwargs=True)
    job = dict(mode="policy", chunk_size=4, domain_name="pusht", resolution_tier=256)
    options = ["--action", "policy", "--chunk-size", "4", "--resolution-tier", "256"]
    for height, width in ((42, 369), (50, 70)):
        first = Image.new("RGB", (width, height), (10, 120, 200))
        pipe("the arm", action=CosmosActionCondition(**job, image=first), num_inference_steps=1, guidance_scale=1.0,
             generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
        assert main(["inspect", root, *options, "--height", str(height), "--width", str(width)]) == 0
        found = re.search(r"\(policy, 5 frames, 4 actions\): \d+ text \+ (\d+) vision \+ (\d+) action tokens$",
                          _forecast_line(capsys.readouterr().out))  # fmt: skip
        assert found is not None
        vision, actions = int(found[1]), int(found[2])
        assert (vision + actions, [(actions, 1, 1)]) == (seen["generation"], seen["actions"]), (height, width)
    hook.remove()


def test_inspect_names_a_distilled_schedule_and_refuses_action_options_it_cannot_forecast(
    demo_root, demo_cache, capsys
):
    from fsdp_fp8.cli.commands import main
    from fsdp_fp8.generation.demo import distilled_checkpoint

    assert main(["inspect", str(distilled_checkpoint(demo_cache)), "--height", "32", "--width", "32"]) == 0
    assert "world size 1 (an image, distilled, 4 steps): " in _forecast_line(capsys.readouterr().out)
    for extra, said in (
        (["--action", "policy"], "--action policy needs --chunk-size"),
        (["--action", "policy", "--chunk-size", "4", "--frames", "5"], "leave out --frames"),
        (["--chunk-size", "4"], "--chunk-size: the forecast of an action job; give --action too"),
        (["--action", "policy", "--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["inspect", str(demo_root), *extra])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, extra
    assert main(["inspect", str(demo_root), "--action", "policy", "--chunk-size", "4"]) == 1  # no action_gen
    assert "has no `action_gen`: its transformer takes no actions (policy asked)" in capsys.readouterr().err
