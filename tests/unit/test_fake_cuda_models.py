"""The layouts real models hand their FP8 linears, replayed on fake CUDA.

A real CPU forward of every model the suite runs (the Llama, Qwen 2, Flux and Cosmos 3 fixtures
under tests/fixtures, the Cosmos 3 demo's transformer, the reference MoT) records each FP8
linear's input as (shape, stride, dtype) with a forward pre-hook. Each linear then runs again on
fake CUDA (tests/fake_cuda.py) with its own weight's inner layouts and exactly those inputs, in
W8A8 and W8A16, under CUDA's ``_scaled_mm`` rules. A whole forward cannot run faked: the diffusers
Cosmos 3 forward indexes tensors by data (``hidden_states[text_indexes] = ...``), which needs values.
A linear whose shape ``_scaled_mm`` refuses on CUDA (tiny fixtures: a dimension not a multiple of
16) must be named by ``cuda_shape_problems``, the loader's refusal on CUDA, and replays in W8A16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_cuda import fake_cuda, on_fake_cuda
from torch import nn

from fsdp_fp8.fp8.linear import Float8StaticLinear, cuda_shape_problems

FIXTURES = Path(__file__).parents[1] / "fixtures"
CAUSAL = ("modelopt-0.47-qwen2-fp16-bias", "modelopt-0.47-llama-tied", "modelopt-0.47-llama-fp8-kv")
DIFFUSERS = ("modelopt-0.47-flux-transformer", "modelopt-0.47-cosmos3-transformer")


def _record(model: nn.Module, run) -> dict[str, set[tuple]]:
    """name -> {(shape, stride, dtype)} of each FP8 linear's input during ``run(model)``."""
    seen: dict[str, set[tuple]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, Float8StaticLinear):

            def hook(_m, args, name=name):
                x = args[0]
                seen.setdefault(name, set()).add((tuple(x.shape), x.stride(), x.dtype))

            handles.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return seen


def _causal(model):
    model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), use_cache=False)


def _diffusers(dtype):
    from fsdp_fp8.interop.hf_run import diffusers_inputs

    return lambda model: model(**diffusers_inputs(model, 0, dtype))


def _mot(model):
    from fsdp_fp8.testing.mot_checkpoint import mot_prompt_ids

    state = model.reason(mot_prompt_ids())
    model.denoise(torch.randn(1, 8, model.config.latent_channels).to(torch.bfloat16), torch.full((1,), 0.5), state)


def _loaded(path: Path, run_for):
    """Load ``path`` on CPU and record its linears' inputs in one forward. The linears run W8A16 for
    it (the CPU ``_scaled_mm`` is slow; either mode hands the next layer the same layout)."""
    from fsdp_fp8 import load_model

    loaded = load_model(None, path, device=torch.device("cpu"))
    for m in loaded.model.modules():
        if isinstance(m, Float8StaticLinear):
            m.mode = "a16"
    return loaded.model, _record(loaded.model, run_for(loaded))


def _exported(model: nn.Module, config: dict, directory: Path) -> Path:
    """``model`` exported to static FP8 with a fixed input scale (calibration changes no layout)."""
    from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, export_fp8
    from fsdp_fp8.format.quant_config import matches_ignore

    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not matches_ignore(n, DEFAULT_IGNORE)]
    return export_fp8(model, directory, config=config, input_scales=dict.fromkeys(names, 0.05))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """model name -> (model, name -> recorded input layouts)."""
    pytest.importorskip("diffusers")
    import json

    from fsdp_fp8.generation.demo import demo_components
    from fsdp_fp8.testing.mot_checkpoint import mot_model

    out = {name: _loaded(FIXTURES / name, lambda _l: _causal) for name in CAUSAL}
    for name in DIFFUSERS:
        out[name] = _loaded(FIXTURES / name, lambda l: _diffusers(l.spec.dtype))
    demo = demo_components()["transformer"]  # the demo pipeline's transformer, as it exports it
    path = _exported(demo, json.loads(demo.to_json_string()), tmp_path_factory.mktemp("demo") / "transformer")
    out["cosmos3-demo"] = _loaded(path, lambda l: _diffusers(l.spec.dtype))
    mot = mot_model()
    path = _exported(mot, mot.config.to_config_dict(), tmp_path_factory.mktemp("mot") / "ckpt")
    out["reference-mot"] = _loaded(path, lambda _l: _mot)
    return out


def _target(lin: Float8StaticLinear):
    from types import SimpleNamespace

    return SimpleNamespace(module="x", in_features=lin.in_features, out_features=lin.out_features)


@pytest.mark.parametrize(
    "model_name", [*CAUSAL, *DIFFUSERS, "cosmos3-demo", "reference-mot"], ids=lambda n: n.replace("modelopt-0.47-", "")
)
def test_every_recorded_input_layout_runs_under_cudas_rules(recorded, model_name):
    model, seen = recorded[model_name]
    modules = dict(model.named_modules())
    assert seen, f"{model_name}: the forward reached no FP8 linear"
    problems = []
    with fake_cuda() as rules:
        for name, inputs in sorted(seen.items()):
            real = modules[name]
            w8a8 = not cuda_shape_problems([_target(real)])
            lin = Float8StaticLinear(
                real.in_features, real.out_features, real.bias is not None, real.compute_dtype, "cuda"
            )
            lin.weight = nn.Parameter(on_fake_cuda(real.weight), requires_grad=False)
            if real.bias is not None:
                lin.bias = nn.Parameter(on_fake_cuda(real.bias), requires_grad=False)
            for shape, stride, dtype in sorted(inputs, key=str):
                for mode in ("native", "a16") if w8a8 else ("a16",):
                    lin.mode = mode
                    x = torch.empty_strided(shape, stride, dtype=dtype, device="cuda")
                    before = rules.scaled_mm
                    try:
                        with torch.no_grad():
                            y = lin(x)
                    except Exception as e:
                        problems.append(f"`{name}` {mode} {shape} stride {stride} {dtype}: {type(e).__name__}: {e}")
                        continue
                    if tuple(y.shape) != (*shape[:-1], real.out_features) or y.dtype != dtype:
                        problems.append(f"`{name}` {mode} {shape}: output {tuple(y.shape)} {y.dtype}")
                    if mode == "native" and x.numel() and rules.scaled_mm != before + 1:
                        problems.append(f"`{name}` {mode} {shape}: no _scaled_mm")
    assert not problems, f"{model_name}: {len(problems)} of its linears' inputs fail on CUDA:\n" + "\n".join(problems)
