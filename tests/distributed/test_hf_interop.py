"""Real ModelOpt 0.47 exports loaded into transformers / diffusers models, sharded.

The fixtures are ModelOpt's own output for tiny random models (tests/fixtures/
make_hf_fixtures.py). One spawn per world size (world size 1: this process, no process
group) loads every fixture with ``load_model(None, dir)`` (the class resolved from
config.json), runs the launcher's ``main`` on two of them, and records what the tests below
judge: the gathered state against the files, the output digests, the tie, the rotary
buffers. Importing transformers and diffusers dominates the cost. Needs the ``hf`` extra.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from calibration import bound

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from ranks import run_ranks  # noqa: E402
from small_models import load_files  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
CAUSAL = {
    "qwen2-fp16-bias": FIXTURES / "modelopt-0.47-qwen2-fp16-bias",
    "llama-tied": FIXTURES / "modelopt-0.47-llama-tied",
    "llama-fp8-kv": FIXTURES / "modelopt-0.47-llama-fp8-kv",
    "llama-sharded": FIXTURES / "modelopt-0.47-llama-sharded",
}
DIFFUSERS = {"flux-transformer": FIXTURES / "modelopt-0.47-flux-transformer"}
MOE = FIXTURES / "modelopt-0.47-qwen3-moe"
WORLD_SIZES = (1, 2, 4)
PROMPT = [[1, 2, 3, 4, 5, 6, 7]]
NEW_TOKENS = 3


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _mismatches(gathered: dict, directory: Path, unused: tuple[str, ...]) -> list[str]:
    files = {k: v for k, v in load_files(directory).items() if k not in unused}
    problems = [f"missing {k}" for k in sorted(set(files) - set(gathered))]
    problems += [f"extra {k}" for k in sorted(set(gathered) - set(files))]
    return problems + [
        f"bytes differ: {k}" for k in sorted(set(files) & set(gathered)) if not _same_bytes(gathered[k], files[k])
    ]


LAUNCHED = ("llama-tied", "flux-transformer")


@contextlib.contextmanager
def _warnings_of(logger_name: str):
    """The messages ``logger_name`` logs at WARNING or above inside the block."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _observe(rank: int, world: int, report_dir: str) -> dict:
    from torch.distributed.tensor import DTensor

    from fsdp_fp8 import gather_state_dict, load_model
    from fsdp_fp8.interop.hf_run import diffusers_forward, diffusers_inputs, greedy_generate

    obs = {}
    for name, path in {**CAUSAL, **DIFFUSERS}.items():
        with _warnings_of("fsdp_fp8.load.plan") as warned:
            loaded = load_model(None, path, device=torch.device("cpu"))
        model = loaded.model
        o = {
            "kv_warnings": sum("present but unused" in m for m in warned),
            "kind": loaded.spec.kind,
            "fp8": len(loaded.fp8_linears),
            "kv_unused": loaded.plan.kv_scales,
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()) if world > 1 else None,
        }
        gathered = gather_state_dict(model)
        o["mismatches"] = _mismatches(gathered, path, loaded.plan.kv_scales) if rank == 0 else None
        with torch.no_grad():
            if o["kind"] == "causal_lm":
                o["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
                o["inv_freq"] = model.model.rotary_emb.inv_freq.clone()
                o["logits"] = model(input_ids=torch.tensor(PROMPT), use_cache=False).logits.float()
                o["generated"], o["digest"] = greedy_generate(model, torch.tensor(PROMPT), NEW_TOKENS)
            else:
                o["output"] = model(**diffusers_inputs(model, 0, loaded.spec.dtype))[0].float()
                o["shape"], o["digest"] = diffusers_forward(model, 0, loaded.spec.dtype)
        obs[name] = o
    from fsdp_fp8.cli.runner import main

    # As torchrun would: main() prints and writes the report on RANK 0 only (the group is
    # already up, so main does not init one). World size 1 runs in the pytest process without
    # a group and leaves the environment as it found it.
    # the launcher reads RANK / WORLD_SIZE; patch.dict restores the environment whatever happens
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}):
        ids = ",".join(str(i) for i in PROMPT[0])
        for name in LAUNCHED:
            report = Path(report_dir, f"{name}-{world}.json")
            path = CAUSAL.get(name) or DIFFUSERS[name]
            argv = [
                "--checkpoint",
                str(path),
                "--prompt-ids",
                ids,
                "--new-tokens",
                str(NEW_TOKENS),
                "--report",
                str(report),
            ]
            assert main(argv) == 0
            obs[name]["launched"] = json.loads(report.read_text()) if rank == 0 else None
    return obs


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    reports = str(tmp_path_factory.mktemp("reports"))
    out = {1: [_observe(0, 1, reports)]}
    out.update({w: run_ranks(_observe, w, reports, timeout=240) for w in WORLD_SIZES if w > 1})
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_export_loads_and_gathers_back_to_the_files_bit_for_bit(observed, world):
    for name, o in observed[world][0].items():
        assert o["mismatches"] == [], name  # every file tensor but the unused KV-cache scales
        assert len(o["kv_unused"]) == (4 if name == "llama-fp8-kv" else 0), name
        assert all(k.endswith((".k_scale", ".v_scale")) for k in o["kv_unused"])
        assert o["fp8"] == (26 if name == "flux-transformer" else 14), name
        if world > 1:
            assert all(r[name]["sharded"] for r in observed[world]), name


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_unused_kv_scales_warning_is_logged_once_per_job_by_rank_0(observed, world):
    counts = [rank_obs["llama-fp8-kv"]["kv_warnings"] for rank_obs in observed[world]]
    assert counts == [1] + [0] * (world - 1)
    assert all(
        rank_obs[name]["kv_warnings"] == 0 for rank_obs in observed[world] for name in rank_obs if "kv" not in name
    )


@pytest.mark.parametrize("world", (2, 4))
def test_output_digests_are_identical_at_every_world_size(observed, world):
    reference = observed[1][0]
    for rank_obs in observed[world]:
        for name, o in rank_obs.items():
            assert o["digest"] == reference[name]["digest"], (name, world)
            if o["kind"] == "causal_lm":
                assert o["generated"] == reference[name]["generated"], name
                assert torch.equal(o["logits"], reference[name]["logits"]), name


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_tied_head_stays_tied(observed, world):
    for rank_obs in observed[world]:
        assert rank_obs["llama-tied"]["tied"] is True
        assert rank_obs["qwen2-fp16-bias"]["tied"] is False


def test_tied_head_is_not_reported_missing(caplog):
    """The checkpoint has no `lm_head.weight` (it is the embedding): with strict=False, which
    reports what stays unfilled instead of refusing, nothing is missing and nothing warns."""
    from fsdp_fp8 import load_model, open_checkpoint

    path = CAUSAL["llama-tied"]
    assert "lm_head.weight" not in open_checkpoint(path).tensors
    with caplog.at_level(logging.WARNING, logger="fsdp_fp8"):
        loaded = load_model(None, path, device=torch.device("cpu"), strict=False)
    assert (loaded.plan.missing, loaded.plan.unexpected) == ((), ())
    assert "uninitialized" not in caplog.text
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def _reference(name: str, path: Path):
    """The same model in float32 from transformers / diffusers directly, holding the
    dequantized weights ``w.float() * weight_scale``."""
    files = load_files(path)
    state = {}
    for key, value in files.items():
        if key.endswith(("_scale",)):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = value.float() * files[key.removesuffix(".weight") + ".weight_scale"]
        state[key] = value.float()
    if name in DIFFUSERS:
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(path))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = ["lm_head.weight"] if name == "llama-tied" else []
    assert sorted(missing) == tied and unexpected == [], (missing, unexpected)
    return model.float().eval()


@pytest.mark.parametrize("name", [*CAUSAL, *DIFFUSERS])
def test_output_matches_a_dequantize_then_matmul_reference(observed, name):
    from fsdp_fp8.interop.hf_run import diffusers_inputs

    model = _reference(name, CAUSAL.get(name) or DIFFUSERS[name])
    got = observed[1][0][name]
    with torch.no_grad():
        if name in DIFFUSERS:
            expected = model(**diffusers_inputs(model, 0, torch.float32))[0]
            got = got["output"]
        else:
            # Rotary buffers built under meta_init equal transformers' own initialisation.
            assert torch.equal(got["inv_freq"], model.model.rotary_emb.inv_freq)
            expected = model(input_ids=torch.tensor(PROMPT), use_cache=False).logits
            got = got["logits"]
    assert not torch.equal(got, expected)  # activations really go through FP8
    scale = expected.abs().max().item()
    # FP8 E4M3 activations carry ~2^-4 relative error per GEMM input; a few layers deep.
    torch.testing.assert_close(got, expected, atol=0.1 * scale, rtol=0.1)
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99


# --- single process: KV-cache scales, MoE, resolution errors --------------------------------


def test_kv_scales_load_weights_and_are_reported_unused_with_a_warning(caplog):
    from fsdp_fp8 import load_model

    with caplog.at_level(logging.WARNING, logger="fsdp_fp8.load.plan"):
        loaded = load_model(None, CAUSAL["llama-fp8-kv"], device=torch.device("cpu"))
    assert loaded.plan.kv_scales == tuple(
        sorted(f"model.layers.{i}.self_attn.{p}_proj.{p}_scale" for i in range(2) for p in "kv")
    )
    assert "present but unused" in caplog.text and "k_proj.k_scale" in caplog.text
    assert len(loaded.fp8_linears) == 14


def test_kv_scales_are_refused_under_strict_kv_scales():
    from fsdp_fp8 import CheckpointError, load_model

    with pytest.raises(CheckpointError, match=r"4 FP8 KV-cache scales .*refusing under strict_kv_scales"):
        load_model(None, CAUSAL["llama-fp8-kv"], device=torch.device("cpu"), strict_kv_scales=True)


def test_kv_scales_load_into_a_model_that_has_a_place_for_them():
    """An attention that quantizes its KV cache (vLLM keeps the scales on the attention):
    key_map renames ModelOpt's `k_proj.k_scale` and the scales load like any tensor."""
    from fsdp_fp8 import load_model
    from fsdp_fp8.interop.architectures import resolve_model_spec

    def with_kv_buffers(config):
        model = resolve_model_spec(config).model_fn(config)
        for layer in model.model.layers:
            layer.self_attn.register_buffer("k_scale", torch.zeros(()))
            layer.self_attn.register_buffer("v_scale", torch.zeros(()))
        return model

    def key_map(key):
        return key.replace(".k_proj.k_scale", ".k_scale").replace(".v_proj.v_scale", ".v_scale")

    path = CAUSAL["llama-fp8-kv"]
    loaded = load_model(with_kv_buffers, path, key_map=key_map, device=torch.device("cpu"), strict_kv_scales=True)
    files = load_files(path)
    assert loaded.plan.kv_scales == ()
    attn = loaded.model.model.layers[1].self_attn
    assert _same_bytes(attn.k_scale, files["model.layers.1.self_attn.k_proj.k_scale"])
    assert _same_bytes(attn.v_scale, files["model.layers.1.self_attn.v_proj.v_scale"])
    # The scales load from the values checked at open: what the load reads is the plan's load_bytes
    # (the progress total), KV-cache scales not among them.
    assert loaded.report.bytes_read == loaded.plan.load_bytes(1, 0)


@pytest.mark.parametrize("strict", (True, False))
def test_moe_with_fused_experts_is_refused_whole(strict):
    from fsdp_fp8 import CheckpointError, load_model

    with pytest.raises(CheckpointError) as info:
        load_model(None, MOE, device=torch.device("cpu"), strict=strict)
    message = str(info.value)
    assert "12 per-expert FP8 linears (`model.layers.0.mlp.experts.0.down_proj.weight`, ...)" in message
    assert "`model.layers.0.mlp.experts` is a Qwen3MoeExperts with fused expert parameters" in message
    assert "`gate_up_proj` (4, 64, 32)" in message


def test_unknown_class_and_missing_library_name_the_class_and_the_extra(monkeypatch):
    from fsdp_fp8.interop import hf_build as hf
    from fsdp_fp8.interop.architectures import resolve_model_spec

    with pytest.raises(ValueError, match=r"has no model class 'NoSuchForCausalLM'"):
        resolve_model_spec({"architectures": ["NoSuchForCausalLM"], "model_type": "llama"})
    with pytest.raises(ValueError, match=r"names no model class"):
        resolve_model_spec({"hidden_size": 4})

    def no_library(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(hf.importlib, "import_module", no_library)
    with pytest.raises(
        ValueError,
        match=r"'FluxTransformer2DModel' comes from diffusers, which is not "
        r"installed .*pip install 'fsdp_fp8\[hf\]'",
    ):
        resolve_model_spec({"_class_name": "FluxTransformer2DModel"})


def test_importing_fsdp_fp8_imports_neither_transformers_nor_diffusers():
    code = (
        "import sys, fsdp_fp8, fsdp_fp8.load.loaded, fsdp_fp8.compose.model, fsdp_fp8.cli.runner, fsdp_fp8.interop.architectures, fsdp_fp8.interop.hf_build, "
        "fsdp_fp8.interop.hf_run; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'diffusers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=bound(120))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_launcher_reports_the_library_digest_at_every_world_size(observed, world):
    reference = observed[1][0]
    for name in LAUNCHED:
        result = observed[world][0][name]["launched"]
        assert result["world_size"] == world and result["architecture"] in (
            "LlamaForCausalLM",
            "FluxTransformer2DModel",
        )
        if name in CAUSAL:
            assert result["prompt_ids"] == PROMPT[0]
            assert result["generated_ids"] == reference[name]["generated"]
            assert result["logits_sha256"] == reference[name]["digest"]
        else:
            assert result["output_sha256"] == reference[name]["digest"]
            assert tuple(result["output_shape"]) == reference[name]["shape"]
