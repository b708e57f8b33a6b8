"""``--attention-backend`` / ``load_pipeline(attention_backend=...)``: diffusers' registry names,
one that cannot run here refused before the load naming those that can, and the chosen one on
every attention processor, the Ulysses one included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")


def test_the_launchers_names_are_diffusers_registry():
    from fsdp_fp8.generation.values import ATTENTION_BACKENDS
    from fsdp_fp8.interop.attention_backend import backend_names

    assert ATTENTION_BACKENDS == backend_names()


def _refusal(capsys, *argv: str) -> str:
    from fsdp_fp8.cli.arguments import parse_run_args

    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's refusals")
def test_a_backend_that_cannot_run_here_is_refused_before_the_load_naming_those_that_can(capsys):
    err = _refusal(capsys, "--attention-backend", "flash")
    assert "--attention-backend: attention backend 'flash' cannot run on cpu here" in err
    assert "flash-attn" in err and "usable here: " in err and "native" in err.split("usable here: ")[1]
    hub = _refusal(capsys, "--attention-backend", "flash_hub")
    assert "downloaded from the Hugging Face Hub, and fsdp_fp8 downloads nothing" in hub
    assert "invalid choice: 'fastest'" in _refusal(capsys, "--attention-backend", "fastest")


def test_load_pipeline_refuses_an_unknown_backend_before_the_load(demo_root):
    from fsdp_fp8 import load_pipeline

    with pytest.raises(ValueError, match="attention backend 'fastest' is not one of diffusers'"):
        load_pipeline(str(demo_root), device=torch.device("cpu"), attention_backend="fastest")


def test_every_processor_takes_the_backend_the_ulysses_one_too(demo_root):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.interop.ulysses import Ulysses, attention_modules, install_ulysses

    active = _AttentionBackendRegistry.get_active_backend()
    pipe = load_pipeline(str(demo_root), device=torch.device("cpu"), attention_backend="_native_math")
    assert _AttentionBackendRegistry.get_active_backend() == active  # every other model's is unchanged
    pipe.set_progress_bar_config(disable=True)
    modules = attention_modules(pipe.transformer)
    assert modules and {m.processor._attention_backend for m in modules} == {AttentionBackendName._NATIVE_MATH}
    out = pipe("a fox", num_frames=1, height=32, width=32, num_inference_steps=2, output_type="latent")
    assert torch.isfinite(out.video).all()
    install_ulysses(pipe.transformer, Ulysses(None, 0, 1))
    assert {type(m.processor).__name__ for m in modules} == {"UlyssesCosmos3AttnProcessor"}
    assert {m.processor._attention_backend for m in modules} == {AttentionBackendName._NATIVE_MATH}
