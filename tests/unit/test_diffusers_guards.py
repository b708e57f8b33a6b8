"""What fsdp_fp8's parallel paths rely on in diffusers 0.42 (Cosmos 3), stated as tests on the real
classes, and each guard shown to fail on a monkeypatched copy where the fact no longer holds (an
upgrade that renames the processor, adds a per-step input or keeps the scheduler's timesteps is
refused, never computed silently wrong)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler  # noqa: E402
from diffusers.models.transformers import transformer_cosmos3  # noqa: E402

from fsdp_fp8.interop import cfg_parallel, ulysses  # noqa: E402


def _cosmos3_copy(**changes) -> types.SimpleNamespace:
    """The three classes ``interop.ulysses`` reads from diffusers' module, some replaced."""
    names = ("Cosmos3AttnProcessor", "Cosmos3PackedMoTAttention", "Cosmos3OmniTransformer")
    return types.SimpleNamespace(**{n: getattr(transformer_cosmos3, n) for n in names} | changes)


# --- Ulysses: the attention processor (by type) and the transformer's two seams


def test_the_ulysses_processor_repeats_diffusers_own_call_and_the_seams_exist():
    assert ulysses.diffusers_problems() == []


def test_a_renamed_processor_argument_a_new_default_processor_or_a_lost_seam_is_named():
    class Renamed(transformer_cosmos3.Cosmos3AttnProcessor):
        def __call__(self, attn, und_seq, gen_seq, rotary_emb, attention_mask=None):
            return super().__call__(attn, und_seq, gen_seq, rotary_emb)

    call, default = ulysses.diffusers_problems(_cosmos3_copy(Cosmos3AttnProcessor=Renamed))
    assert "Renamed.__call__ takes" in call and "attention_mask" in call
    assert "default processor is Cosmos3AttnProcessor, not" in default  # the layers would not hold it

    class Attention(transformer_cosmos3.Cosmos3PackedMoTAttention):
        _default_processor_cls = object

    (problem,) = ulysses.diffusers_problems(_cosmos3_copy(Cosmos3PackedMoTAttention=Attention))
    assert "default processor is object" in problem

    class NoSeams(nn.Module):
        pass

    problems = ulysses.diffusers_problems(_cosmos3_copy(Cosmos3OmniTransformer=NoSeams))
    assert problems == ["NoSeams has no seam `_cp_shard_fn`", "NoSeams has no seam `_cp_gather_fn`"]


def _attention_layers(n: int = 2) -> nn.Module:
    return nn.ModuleList(transformer_cosmos3.Cosmos3PackedMoTAttention(32, 8, 4, 2, False, 1e-6) for _ in range(n))


def test_attention_layers_are_found_by_type_and_a_foreign_processor_is_refused():
    from fsdp_fp8 import ArgumentError

    assert ulysses.install_ulysses(_attention_layers(), ulysses.Ulysses(None, 0, 1)) == 2

    class Cosmos3AttnProcessor:  # the same name, another class: never taken for diffusers' own
        def __call__(self, attn, und_seq, gen_seq, rotary_emb):
            raise AssertionError("not run")

    layers = _attention_layers()
    layers[1].set_processor(Cosmos3AttnProcessor())
    with pytest.raises(ArgumentError, match="processor Cosmos3AttnProcessor, not diffusers' Cosmos3AttnProcessor"):
        ulysses.install_ulysses(layers, ulysses.Ulysses(None, 0, 1))

    class Renamed(transformer_cosmos3.Cosmos3AttnProcessor):  # a processor diffusers renamed, found all the same
        pass

    layers = _attention_layers()
    layers[0].set_processor(Renamed())
    with pytest.raises(ArgumentError, match="processor Renamed, not diffusers' Cosmos3AttnProcessor"):
        ulysses.install_ulysses(layers, ulysses.Ulysses(None, 0, 1))
    with pytest.raises(ArgumentError, match="no Cosmos3PackedMoTAttention"):
        ulysses.install_ulysses(nn.Linear(2, 2), ulysses.Ulysses(None, 0, 1))


# --- CFG-parallel: which keywords change per step


def test_every_transformer_keyword_is_per_step_or_step_invariant_and_the_pipeline_takes_each_latents():
    assert cfg_parallel.diffusers_problems(Cosmos3OmniPipeline, Cosmos3OmniTransformer) == []
    forward = set(inspect.signature(Cosmos3OmniTransformer.forward).parameters)
    assert set(cfg_parallel.PER_STEP) <= forward and set(cfg_parallel.STEP_INVARIANT) <= forward


def test_a_new_transformer_keyword_or_a_lost_pipeline_latents_is_named():
    class NewInput(Cosmos3OmniTransformer):
        def forward(self, *args, vision_mask=None, **kwargs):  # a per-step tensor fsdp_fp8 does not know
            return super().forward(*args, **kwargs)

    forward = inspect.signature(Cosmos3OmniTransformer.forward)
    params = [*forward.parameters.values()][:-1]  # keep return_dict last
    mask = inspect.Parameter("vision_mask", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
    NewInput.forward.__signature__ = forward.replace(parameters=[*params, mask, forward.parameters["return_dict"]])
    (problem,) = cfg_parallel.diffusers_problems(Cosmos3OmniPipeline, NewInput)
    assert "NewInput.forward takes `vision_mask`" in problem

    class NoSound(Cosmos3OmniPipeline):
        def __call__(self, prompt=None, latents=None, action_latents=None):
            raise AssertionError("not run")

    (problem,) = cfg_parallel.diffusers_problems(NoSound, Cosmos3OmniTransformer)
    assert "NoSound.__call__ takes no `sound_latents`" in problem


def test_a_modular_pipelines_blocks_take_each_latents():
    """``Cosmos3OmniModularPipeline`` takes everything as ``**kwargs``: its blocks' inputs are the
    per-step latents' keywords."""
    import diffusers

    blocks = diffusers.Cosmos3OmniBlocks()
    modular = diffusers.Cosmos3OmniModularPipeline
    assert cfg_parallel.diffusers_problems(modular, Cosmos3OmniTransformer, blocks) == []
    problems = cfg_parallel.diffusers_problems(modular, Cosmos3OmniTransformer, diffusers.Cosmos3DistilledBlocks())
    assert [p.split(":")[0] for p in problems] == [
        f"Cosmos3OmniModularPipeline's blocks (Cosmos3DistilledBlocks) take no `{latents}`"
        for latents in ("sound_latents", "action_latents")
    ]


# --- the step boundary: each call of the pipeline is one request, whatever its scheduler


class _KeepsTimesteps(UniPCMultistepScheduler):
    """A scheduler whose ``set_timesteps`` refills one ``timesteps`` tensor in place: nothing in
    it tells one request from the next."""

    def set_timesteps(self, *args, **kwargs):
        kept = getattr(self, "timesteps", None)
        super().set_timesteps(*args, **kwargs)
        if isinstance(kept, torch.Tensor) and kept.shape == self.timesteps.shape:
            self.timesteps = kept.copy_(self.timesteps)


def _run(pipe, steps: int, seed: int = 0) -> torch.Tensor:
    out = pipe(
        "a red fox",
        num_frames=1,
        height=32,
        width=32,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
    )
    return out.video


def test_a_scheduler_swapped_after_loading_is_followed(demo_root):
    """The diffusers idiom ``pipe.scheduler = X.from_config(pipe.scheduler.config, flow_shift=...)``
    after the load: each call is still one request (its step's precision recorded once), even with
    a scheduler that reuses its timesteps object, and the new shift is the one that runs."""
    from fsdp_fp8 import load_pipeline, routing_of

    pipe = load_pipeline(demo_root, device=torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    before = _run(pipe, 3)
    pipe.scheduler = _KeepsTimesteps.from_config(pipe.scheduler.config, flow_shift=5.0)
    trace = routing_of(pipe.transformer).trace
    start = len(trace)
    _run(pipe, 1, seed=0), _run(pipe, 1, seed=1)
    assert len(trace) - start == 2  # two requests of one step each: two steps
    assert not torch.equal(before, _run(pipe, 3))  # the shifted schedule ran


def test_two_one_step_requests_are_two_steps(demo_root):
    """Both requests run step (0, 1): the pipeline's own call tells the second from the first,
    so the trace records two steps, the step policy's precision for each."""
    from fsdp_fp8 import load_pipeline, routing_of

    pipe = load_pipeline(demo_root, device=torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    for seed in (0, 1):
        generator = torch.Generator().manual_seed(seed)
        pipe(
            "a red fox",
            num_frames=1,
            height=32,
            width=32,
            num_inference_steps=1,
            generator=generator,
            output_type="latent",
        )
    assert len(routing_of(pipe.transformer).trace) == 2


# --- the step cache: diffusers' SeaCache pieces, and why its own hook is not used


def test_the_step_cache_finds_diffusers_seacache_pieces_and_its_hook_still_refuses_fsdp():
    from diffusers.hooks import sea_cache

    from fsdp_fp8.interop import step_cache

    assert step_cache.diffusers_problems() == []
    assert step_cache.cache_problems("Cosmos3OmniTransformer") == []
    # the reason fsdp_fp8 takes the indicator and gate but not `enable_cache`: under FSDP the hook
    # computes every step; when this goes, the hook may serve FSDP itself (issue 48)
    assert "cannot safely bypass FSDP-managed transformer blocks" in inspect.getsource(sea_cache)
    assert sea_cache.SeaCacheConfig().threshold == 0.25  # the default the docs quote


def test_a_missing_seacache_piece_or_a_transformer_without_the_decoder_stack_is_named(monkeypatch):
    from diffusers.hooks import sea_cache

    from fsdp_fp8.interop import step_cache

    monkeypatch.delattr(sea_cache, "_build_indicator")
    assert step_cache.diffusers_problems() == [f"{step_cache.SEA_CACHE} has no `_build_indicator`"]
    problems = step_cache.cache_problems("AutoencoderKLWan")
    assert "the step cache runs on Cosmos 3 transformers" in problems[-1] and "AutoencoderKLWan" in problems[-1]


def test_regional_compile_finds_blocks_by_class_name_which_fully_shard_renames():
    """The reason ``--compile regional`` is refused (generation.values.compile_problems): when
    diffusers matches blocks another way, this goes red and the refusal must be looked at again."""
    from diffusers import ModelMixin

    source = inspect.getsource(ModelMixin.compile_repeated_blocks)
    assert "submod.__class__.__name__ in repeated_blocks" in source
    assert Cosmos3OmniTransformer._repeated_blocks == ["Cosmos3VLTextMoTDecoderLayer"]


# --- Modular pipelines (distilled roots): the blocks take what fsdp_fp8 passes, its step end in the loop


def test_the_distilled_blocks_take_every_input_fsdp_fp8_passes_and_end_each_step_with_ours(tmp_path):
    from diffusers import Cosmos3DistilledModularPipeline

    from fsdp_fp8.interop.modular import STEP_END, blocks_of, blocks_problems, denoising_loops

    index = {"_blocks_class_name": "Cosmos3DistilledBlocks", "distilled_sigmas": [1.0, 0.5]}
    blocks = blocks_of(Cosmos3DistilledModularPipeline, index, tmp_path)
    assert blocks_problems(blocks, tmp_path) == []
    loops = denoising_loops(blocks)
    assert len(loops) == 1 and list(loops[0].sub_blocks)[-1] == STEP_END
    # the fixed schedule is the config diffusers' own step reads (`Cosmos3DistilledSetTimestepsStep`)
    assert {"distilled_sigmas", "is_distilled"} <= {spec.name for spec in blocks.expected_configs}


def test_blocks_that_no_longer_take_an_input_are_named(tmp_path):
    from fsdp_fp8.interop.modular import blocks_problems

    lost = types.SimpleNamespace(inputs=[types.SimpleNamespace(name="prompt")])
    problems = blocks_problems(lost, tmp_path)
    assert len(problems) == 14 and any("no longer take `guidance_scale`" in p for p in problems)


def test_an_unknown_blocks_class_is_refused(tmp_path):
    from diffusers import Cosmos3DistilledModularPipeline

    from fsdp_fp8.errors import ArgumentError
    from fsdp_fp8.interop.modular import blocks_of

    with pytest.raises(ArgumentError, match="`_blocks_class_name` 'os.system' is not pipeline blocks of diffusers"):
        blocks_of(Cosmos3DistilledModularPipeline, {"_blocks_class_name": "os.system"}, tmp_path)
