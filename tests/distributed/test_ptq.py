"""Runtime quantization (fsdp_fp8.runtime.ptq): TorchAO fp8 on the reference MoT, and every refusal.

FP8 tolerance, from first principles. E4M3 keeps 3 mantissa bits, so rounding to it has
unit roundoff u = 2**-4 (relative error at most u); for values spread over a binade the
rounding error is uniform in +-ulp/2, so its RMS relative size is at most u / sqrt(3). A
quantized linear rounds both operands of every product x_i * w_i, and with independent
errors the output's relative RMS error is then at most sqrt(2) * u / sqrt(3) ~= 0.051
(bf16 output rounding, 2**-9, is negligible). That bounds one linear. Through the model,
errors of linears in series add in quadrature when the network neither amplifies nor
cancels them, which ``init_weights`` arranges (N(0, 1/fan_in) weights, residual branches
scaled, RMSNorm): the final output's relative error is at most sqrt(D) times the one-linear
bound, D the number of quantized linears in series on the longest path to that output.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from calibration import bound
from ranks import run_ranks
from torch import nn

from fsdp_fp8.export.modelopt import export_bf16, export_fp8
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.models import PRESETS, build_model, init_weights
from fsdp_fp8.runtime import ptq
from fsdp_fp8.runtime.ptq import check_ptq_checkpoint, check_ptq_world_size, linear_weight_bytes, quantize_model

# torch 2.10 / 2.11's CPU _scaled_mm takes per-tensor scales only: per_row is refused there
# (test_per_row_on_a_cpu_kernel_without_row_scales_is_refused forces that path on any torch).
ROW_SCALES = pytest.mark.skipif(
    not ptq.cpu_scaled_mm_takes_row_scales(),
    reason=f"torch {torch.__version__}'s CPU _scaled_mm takes no per-row scales",
)
GRANULARITIES = [pytest.param("per_row", marks=ROW_SCALES), "per_tensor"]
# Where a test is about selection, not scales: the default where this torch's CPU runs it.
ANY_GRANULARITY = "per_row" if ptq.cpu_scaled_mm_takes_row_scales() else "per_tensor"

ROOT = Path(__file__).resolve().parents[2]
U_E4M3 = 2.0**-4
ONE_LINEAR = math.sqrt(2) * U_E4M3 / math.sqrt(3)
# The tiny preset with every dimension a multiple of 16, as FP8 GEMMs require.
CONFIG = dataclasses.replace(PRESETS["tiny"], intermediate_size=96, latent_channels=16, vocab_size=112)
# ModelOpt's own default: embedders and heads stay in high precision.
EXCLUDE = r"^(proj_in|proj_out|time_embedder|lm_head)\b"


def mot():
    return init_weights(build_model(CONFIG, device="cpu"), seed=0)


def outputs(model):
    """The two outputs of the MoT: the denoiser's velocity and the reasoner's logits."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 7), generator=gen)
    latents = torch.randn(1, 9, CONFIG.latent_channels, generator=gen)
    with torch.no_grad():
        state = model.reason(ids)
        return model.denoise(latents, torch.tensor([0.3]), state).float(), model.logits(state).float()


def rel_error(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def weights(model):
    return {n: p for n, p in model.named_parameters()}


# --- quantizing -----------------------------------------------------------------------


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_one_linear_is_within_the_e4m3_bound(granularity):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, dtype=torch.bfloat16)
    x = torch.randn(4, 32, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = linear(x)
        quantize_model(linear, "fp8", granularity=granularity)
        err = rel_error(linear(x), ref)
    assert err < ONE_LINEAR, err
    assert err > ONE_LINEAR / 4, err  # really quantized: no high-precision fallback


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_quantizes_the_selected_linears_of_the_mot_within_tolerance(granularity):
    from torchao.quantization import Float8Tensor

    base = mot()
    ref = outputs(base)
    model = copy.deepcopy(base)
    before = weights(model)
    bytes_before = linear_weight_bytes(model)
    names = quantize_model(model, "fp8", exclude=EXCLUDE, granularity=granularity)

    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    want = sorted(n for n in linears if not re.search(EXCLUDE, n))
    assert names == want and len(names) == 14 * CONFIG.num_layers
    for name, module in linears.items():
        if name in names:
            w = module.weight
            assert isinstance(w, Float8Tensor) and w.qdata.dtype == torch.float8_e4m3fn
            rows = w.shape[0] if granularity == "per_row" else 1
            assert tuple(w.scale.shape) == (rows, 1), (name, w.scale.shape)
        else:
            assert module.weight is before[f"{name}.weight"]  # untouched, not even copied
    # 1 byte per element instead of 2, plus one float32 scale per row or per tensor.
    quantized_elems = sum(linears[n].weight.numel() for n in names)
    scales = sum(linears[n].weight.scale.numel() for n in names)
    assert linear_weight_bytes(model) == bytes_before - quantized_elems + 4 * scales

    # Longest chains of quantized linears in series: denoise runs q/k/v -> to_add_out ->
    # gate/up -> down per layer (proj_in/out and the time embedder excluded); the logits
    # see the reasoner's to_q/k/v -> to_out -> mlp in each layer.
    depth = 4 * CONFIG.num_layers
    bound = math.sqrt(depth) * ONE_LINEAR
    for out, r in zip(outputs(model), ref):
        assert torch.isfinite(out).all()
        err = rel_error(out, r)
        assert ONE_LINEAR / 4 < err < bound, (err, bound)


def test_every_linear_when_nothing_is_excluded():
    model = mot()
    names = quantize_model(model, "fp8", granularity=ANY_GRANULARITY)
    assert len(names) == sum(isinstance(m, nn.Linear) for m in model.modules()) == 33


@ROW_SCALES
def test_cpu_weights_are_what_torchao_quantize_builds(monkeypatch):
    """On CPU we bypass only quantize_'s CUDA-capability assert; the tensor is TorchAO's own."""
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    for granularity, g in (("per_row", PerRow()), ("per_tensor", PerTensor())):
        ours = nn.Linear(64, 32, dtype=torch.bfloat16)
        theirs = copy.deepcopy(ours)
        quantize_model(ours, "fp8", granularity=granularity)
        with monkeypatch.context() as m:
            m.setattr(quant_api, "_check_hardware_support", lambda _g: None)
            quantize_(theirs, Float8DynamicActivationFloat8WeightConfig(granularity=g, set_inductor_config=False))
        a, b = ours.weight, theirs.weight
        assert type(a) is type(b)
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
        for attr in ("block_size", "mm_config", "act_quant_kwargs", "kernel_preference", "dtype"):
            assert getattr(a, attr) == getattr(b, attr), attr


def test_include_exclude_and_compiled_names():
    model = mot()
    compiled = torch.compile(model)  # names gain `_orig_mod.`; patterns see them without it
    names = quantize_model(
        compiled,
        "fp8",
        include=[r"\.self_attn\.to_(q|k)$", r"mlp\w*\.up_proj"],
        exclude=r"^layers\.1\.",
        granularity=ANY_GRANULARITY,
    )
    assert names == [
        "layers.0.mlp.up_proj",
        "layers.0.mlp_moe_gen.up_proj",
        "layers.0.self_attn.to_k",
        "layers.0.self_attn.to_q",
    ]


# --- refusals: each message names what is wrong ---------------------------------------


def refused(model, *args, **kwargs) -> str:
    """Run quantize_model expecting a refusal; check nothing was changed; return the message."""
    before = {n: (p, _bytes(p)) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="cannot quantize") as info:
        quantize_model(model, *args, **kwargs)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, (param, data) in before.items():
        assert after[n] is param and (data is None or torch.equal(_bytes(param), data)), n
    return str(info.value)


def _bytes(p):
    """A plain tensor's bytes (float8 included); None for a subclass (identity is checked)."""
    if type(p.data) is not torch.Tensor or p.device.type == "meta":
        return None
    return p.detach().contiguous().view(torch.uint8).clone()


def test_an_invalid_pattern_is_refused():
    msg = refused(mot(), "fp8", include=["to_(q"], exclude=EXCLUDE)
    assert "include pattern 'to_(q' is not a valid regular expression" in msg
    msg = refused(mot(), "fp8", exclude=["[lm_head"])
    assert "exclude pattern '[lm_head' is not a valid regular expression" in msg


def test_a_selection_that_matches_nothing_is_refused():
    msg = refused(mot(), "fp8", include=["to_q", "attn\\.to_qq"])
    assert "include pattern 'attn\\\\.to_qq' matches no linear" in msg
    msg = refused(mot(), "fp8", include=["to_q"], exclude=["layers"])
    assert "select no linear" in msg


def test_an_already_quantized_linear_is_refused():
    model = mot()
    quantize_model(model, "fp8", include=["to_q$"], granularity=ANY_GRANULARITY)
    msg = refused(model, "fp8", exclude=EXCLUDE)  # selects the to_q's again, among others
    assert "`layers.0.self_attn.to_q` is already quantized" in msg and "Float8Tensor" in msg
    assert "`layers.0.self_attn.to_k`" not in msg


def test_a_float8_weight_and_a_static_fp8_linear_are_refused():
    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16), nn.Linear(32, 32, dtype=torch.bfloat16))
    model[0].weight = nn.Parameter(torch.zeros(32, 32, dtype=torch.float8_e4m3fn), requires_grad=False)
    model.add_module("2", Float8StaticLinear(32, 32, bias=False, compute_dtype=torch.bfloat16, device="meta"))
    msg = refused(model, "fp8")
    assert "`0` is already quantized" in msg and "float8_e4m3fn" in msg
    assert "`2` is already quantized (Float8StaticLinear" in msg
    assert "`1`" not in msg


def test_shapes_and_dtypes_torchao_cannot_run_are_refused():
    model = init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)  # 88-wide MLPs
    msg = refused(model, "fp8", exclude=EXCLUDE)
    assert "`layers.0.mlp.up_proj` has weight shape (88, 64)" in msg
    float32 = nn.Linear(32, 32)
    assert "takes torch.bfloat16" in refused(float32, "fp8", granularity="per_row")
    quantize_model(float32, "fp8", granularity="per_tensor")  # per-tensor takes float32


@pytest.mark.parametrize("method", ["mxfp8", "nvfp4"])
def test_mx_formats_are_refused_off_blackwell(method):
    msg = refused(mot(), method, exclude=EXCLUDE)
    assert f"{method} needs a CUDA GPU with compute capability >= 10.0" in msg
    assert "the model is on cpu" in msg


def test_per_row_on_a_cpu_kernel_without_row_scales_is_refused(monkeypatch):
    """What torch 2.10 / 2.11 do on CPU, forced here: a clear refusal before any quantization."""
    monkeypatch.setattr(ptq, "cpu_scaled_mm_takes_row_scales", lambda: False)
    linear = nn.Linear(64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as err:
        quantize_model(linear, "fp8", granularity="per_row")
    assert "fp8 per_row on CPU" in str(err.value) and "per_tensor" in str(err.value)
    assert type(linear.weight) is nn.Parameter  # nothing was quantized
    quantize_model(linear, "fp8", granularity="per_tensor")  # the way out still works


def test_bad_method_and_granularity_are_refused():
    assert "unknown method 'int3'" in refused(mot(), "int3", exclude=EXCLUDE)
    assert "unknown granularity 'per_block'" in refused(mot(), "fp8", exclude=EXCLUDE, granularity="per_block")


def _quantize_sharded(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(32, 48, dtype=torch.bfloat16), nn.Linear(48, 16, dtype=torch.bfloat16))
    fully_shard(model)
    try:
        quantize_model(model, "fp8")
    except ValueError as exc:
        kinds = {type(p).__name__ for p in model.parameters()}
        return str(exc), kinds
    return None, None


def test_a_sharded_model_is_refused():
    for msg, kinds in run_ranks(_quantize_sharded, 2):
        assert msg is not None and "FSDP shards (DTensor), e.g. `0.weight` (4 in all)" in msg
        assert kinds == {"DTensor"}  # still the shards, untouched


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    model = mot()
    root = tmp_path_factory.mktemp("ptq")
    bf16 = export_bf16(model, root / "bf16", config=CONFIG.to_config_dict())
    fp8 = export_fp8(model, root / "fp8", config=CONFIG.to_config_dict(), calibrate=outputs)
    return bf16, fp8


def test_a_modelopt_fp8_checkpoint_is_refused(checkpoints):
    bf16, fp8 = checkpoints
    check_ptq_checkpoint(open_checkpoint(bf16))
    with pytest.raises(ValueError, match="is a ModelOpt static-FP8 checkpoint; runtime quantization"):
        check_ptq_checkpoint(open_checkpoint(fp8))


def test_more_than_one_rank_is_refused():
    check_ptq_world_size(1)
    with pytest.raises(ValueError, match="--quantize runs on a single process, not on 2 ranks"):
        check_ptq_world_size(2)


# --- launch/infer.py --quantize -------------------------------------------------------


def infer(tmp_path, *args, nproc=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FSDP_FP8_TRACEBACK", None)
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    report = tmp_path / "report.json"
    cmd += [str(ROOT / "launch" / "infer.py"), "--report", str(report), "--steps", "2", "--latent-tokens", "8", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bound(240))
    return proc, (json.loads(report.read_text()) if report.exists() else None)


@ROW_SCALES
def test_infer_quantizes_a_bf16_checkpoint(tmp_path, checkpoints):
    bf16, _ = checkpoints
    proc, report = infer(tmp_path, "--checkpoint", str(bf16), "--quantize", "fp8", "--exclude", EXCLUDE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = report["quantize"]
    assert q["method"] == "fp8" and q["linears"] == 28
    assert q["weight_bytes_after"] < 0.65 * q["weight_bytes_before"]
    assert "quantized       28 linears to fp8" in proc.stdout
    assert f"{q['weight_bytes_before']:,} -> {q['weight_bytes_after']:,} bytes" in proc.stdout


def test_infer_refuses_quantize_on_a_modelopt_checkpoint(tmp_path, checkpoints, capsys, monkeypatch):
    from fsdp_fp8.cli.runner import main

    _, fp8 = checkpoints
    monkeypatch.delenv("FSDP_FP8_TRACEBACK", raising=False)
    report = tmp_path / "report.json"
    assert main(["--checkpoint", str(fp8), "--quantize", "fp8", "--report", str(report)]) == 1
    assert not report.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is a ModelOpt static-FP8 checkpoint" in err


def test_infer_refuses_quantize_on_two_ranks(tmp_path, checkpoints, capsys, monkeypatch):
    """What torchrun --nproc-per-node 2 gives rank 0: refused before any process group."""
    from fsdp_fp8.cli.runner import main

    bf16, _ = checkpoints
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("FSDP_FP8_TRACEBACK", raising=False)
    assert main(["--checkpoint", str(bf16), "--quantize", "fp8", "--report", str(tmp_path / "r.json")]) == 1
    assert "--quantize runs on a single process, not on 2 ranks" in capsys.readouterr().err


def test_infer_include_without_quantize_is_a_usage_error(checkpoints, capsys):
    from fsdp_fp8.cli.arguments import parse_run_args as parse_args

    bf16, _ = checkpoints
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--checkpoint", str(bf16), "--include", "to_q"])
    assert exit_.value.code == 2 and "pass --quantize too" in capsys.readouterr().err
