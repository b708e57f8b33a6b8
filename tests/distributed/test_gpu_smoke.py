"""bench.gpu_smoke without a GPU: its CUDA sections run on fake CUDA tensors (CUDA's layout,
alignment and one-device rules enforced by the meta kernels, torch's fake process group for the
all-gather), its driver keeps what finished when a section runs out of time, and its preflight
names what a box lacks. So the smoke check cannot rot between GPU runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_smoke import attention, driver, gemm, preflight
from bench.gpu_smoke import load as load_section
from bench.gpu_smoke.context import Context, load_results
from bench.gpu_smoke.fake_cuda import basic_getitem, fake_cuda
from bench.gpu_smoke.sections import SECTIONS, run_section

ROOT = Path(__file__).resolve().parents[2]

CUDA = torch.device("cuda", 0)


def _fake_run(name: str) -> list[dict]:
    ctx = Context(name, CUDA, dry=False, fake=True, quick=True, emit=lambda r: None)
    run_section(name, ctx)
    return ctx.records


def _by_status(records, status):
    return {r["variant"]: r for r in records if r["status"] == status}


def test_the_gemm_section_runs_every_mode_and_layout_on_fake_cuda():
    records = _fake_run("gemm")
    failed = _by_status(records, "failed")
    assert failed == {}, {k: v["error"] for k, v in failed.items()}
    ok = _by_status(records, "ok")
    k, n = gemm.FAKE_GEMM_IN, gemm.FAKE_GEMM_OUT
    for rows in gemm.FAKE_GEMM_ROWS:
        for shape in ((rows, k), (1, rows, k), (2, 1, rows, k)):
            for mode in ("BF16", "W8A8", "W8A8 fast accum", "W8A16"):
                rec = ok[f"{mode} x{shape}->{n}"]
                assert rec["out_shape"] == [*shape[:-1], n] and rec["out_device"] == "cuda:0", rec
                assert rec["out_dtype"] == "torch.bfloat16"
    skipped = _by_status(records, "skipped")
    assert skipped and all("fused" in v and "triton" in r["reason"] for v, r in skipped.items())


def test_the_attention_section_runs_each_usable_backend_at_the_processors_shapes_on_fake_cuda():
    records = _fake_run("attention")
    assert _by_status(records, "failed") == {}
    ok = _by_status(records, "ok")
    rows, heads, _, dim = attention.SMALL_ATTENTION_SHAPE
    assert "native" in ok and ok["native"]["out_shape"] == [1, rows, heads, dim]
    assert all(r["out_device"] == "cuda:0" and r["out_dtype"] == "torch.bfloat16" for r in ok.values())
    skipped = _by_status(records, "skipped")
    assert "downloads nothing" in skipped["flash_hub"]["reason"]
    assert set(ok) | set(skipped) == set(
        __import__("fsdp_fp8.interop.attention_backend").interop.attention_backend.backend_names()
    )


def test_a_shape_cuda_refuses_fails_its_variants_and_the_section_goes_on(monkeypatch):
    monkeypatch.setattr(gemm, "FAKE_GEMM_IN", 24)  # not a multiple of 16: _scaled_mm refuses it on CUDA
    monkeypatch.setattr(gemm, "FAKE_GEMM_ROWS", (7,))
    records = _fake_run("gemm")
    failed, ok = _by_status(records, "failed"), _by_status(records, "ok")
    assert sorted(failed) == sorted(
        f"{m} x{s}->96" for m in ("W8A8", "W8A8 fast accum") for s in ((7, 24), (1, 7, 24), (2, 1, 7, 24))
    )
    assert all("16" in r["error"] for r in failed.values()), [r["error"] for r in failed.values()]
    assert sorted(ok) == sorted(
        f"{m} x{s}->96" for m in ("BF16", "W8A16") for s in ((7, 24), (1, 7, 24), (2, 1, 7, 24))
    )


def test_the_step_section_runs_one_64b_layer_shape_on_fake_cuda():
    records = _fake_run("step")
    failed = _by_status(records, "failed")
    assert failed == {}, {k: v["error"] for k, v in failed.items()}
    assert {"shape", "BF16", "W8A8", "W8A8 fast accum", "W8A16"} <= set(_by_status(records, "ok"))
    assert set(_by_status(records, "skipped")) == {"W8A8 fused quant", "W8A16 fused"}


def test_the_allgather_section_runs_the_hooks_through_a_fake_world_of_8():
    records = _fake_run("allgather")
    failed = _by_status(records, "failed")
    assert failed == {}, {k: v["error"] for k, v in failed.items()}
    cases = [r for r in records if r["variant"].startswith("fake world 8")]
    assert {r["rank"] for r in cases} == {0, 7}
    # every rank sends ceil(rows / 8) rows of bytes, the one holding none included
    assert all(r["payload"] == ["torch.uint8", [r["padded_rows"], r["cols"]]] for r in cases)
    assert any(r["local_rows"] == 0 for r in cases) and any(r["local_rows"] > 0 for r in cases)
    assert "real ranks" in _by_status(records, "skipped")["torchrun"]["reason"]


def test_the_alltoall_section_gives_every_gloo_rank_its_rows_and_heads_back():
    """--dry: 3 gloo ranks under torchrun, rows that do not divide by 3 and fewer than 16 per rank."""
    ctx = Context("alltoall", torch.device("cpu"), dry=True, fake=False, quick=True, emit=lambda r: None)
    run_section("alltoall", ctx)
    (record,) = _by_status(ctx.records, "ok").values()
    assert record["backend"] == "gloo" and record["world"] == 3 and record["rows_equal_everywhere"] is True
    assert [(c["rows"], c["chunk"]) for c in record["cases"]] == [(24, 16), (5, 5)]  # 5 rows: whole on rank 0
    assert "a real collective" in _by_status(_fake_run("alltoall"), "skipped")["torchrun"]["reason"]


def test_the_decode_section_packs_the_gather_on_fake_cuda_and_splits_over_gloo_ranks_dry():
    records = _fake_run("decode")
    assert _by_status(records, "ok")["gather packing"]["shapes_back"] is True
    assert "real ranks" in _by_status(records, "skipped")["torchrun"]["reason"]
    ctx = Context("decode", torch.device("cpu"), dry=True, fake=False, quick=True, emit=lambda r: None)
    run_section("decode", ctx)
    (record,) = _by_status(ctx.records, "ok").values()
    assert record["backend"] == "gloo" and record["world"] == 2 and record["frames_equal"] is True
    assert record["ranks"][0]["sent_bytes"] == 0 and record["ranks"][1]["sent_bytes"] > 0  # rank 0 writes


@pytest.mark.parametrize(
    "index",
    [(Ellipsis, slice(2, None)), (slice(None), 1), 0, None, (None, Ellipsis, 1), (1, slice(None, None, 2)), -1],
    ids=repr,
)
def test_the_fake_cuda_indexing_views_equal_torchs(index):
    x = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    parts = index if isinstance(index, tuple) else (index,)
    got, want = basic_getitem(x, parts), x[index]
    assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)
    assert got.data_ptr() == want.data_ptr()  # a view, as torch's indexing returns


def test_fake_cuda_indexing_and_copy_keep_cudas_one_device_rule():
    with fake_cuda():
        x = torch.zeros(4, 8, device="cuda")
        x[1:3] = torch.ones(2, 8, device="cuda")
        x[:2].copy_(torch.ones(2, 8, device="cuda"))
        assert x[..., 2:].shape == (4, 6) and x[..., 2:].device.type == "cuda"
        with pytest.raises(RuntimeError, match="device"):
            x[1:3] + torch.ones(2, 8)  # a CPU operand: refused, as CUDA refuses it


def test_preflight_names_each_missing_wheel_by_file_and_the_compiler(tmp_path, monkeypatch):
    pins = preflight.carried_wheels()
    assert preflight.missing_wheels(tmp_path) == pins
    name, version = pins[0].split("==")
    (tmp_path / f"{name}-{version}-cp310-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert preflight.missing_wheels(tmp_path) == pins[1:]
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(preflight.sysconfig, "get_config_var", lambda key: None)
    monkeypatch.setattr(preflight.sysconfig, "get_paths", lambda: {"include": str(tmp_path / "include")})
    problems = preflight.compiler_problems()
    assert (
        len(problems) == 2 and "no C compiler" in problems[0] and str(tmp_path / "include" / "Python.h") in problems[1]
    )


def test_every_module_a_section_imports_is_carried_as_a_wheel():
    carried = {preflight.wheel_key(p.split("==")[0]) for p in preflight.carried_wheels()}
    needed = {preflight.wheel_key(m) for mods in preflight.NEEDS.values() for m in mods} - {"torch"}
    assert sorted(needed - carried) == []


def test_the_driver_and_every_section_module_import_without_torch():
    """The driver's process imports every section's module but never torch: on a box whose torch
    is missing or broken, preflight still runs and says so."""
    code = "import sys, bench.gpu_smoke.driver; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_quick_fits_six_minutes_and_the_outer_timeout_outlasts_every_budget():
    quick = driver.budgets(driver.parse_args(["--out", "x", "--quick"]))
    full = driver.budgets(driver.parse_args(["--out", "x"]))
    assert sum(quick.values()) <= 360 and set(quick) == set(SECTIONS)
    for flags, chosen in (([], full), (["--quick"], quick)):
        run = [sys.executable, "-m", "bench.gpu_smoke", "--out", "x", "--outer-timeout", *flags]
        outer = int(subprocess.run(run, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
        assert outer > sum(chosen.values())
    assert "--outer-timeout" in (ROOT / "bench" / "gpu_smoke.sh").read_text()


@pytest.mark.timeout(240)
def test_a_section_out_of_time_keeps_what_finished_and_the_run_says_so(tmp_path):
    out = tmp_path / "not-yet" / "smoke.jsonl"  # its directory is created
    # relative to the caller's directory, though each section's child runs in the checkout's root
    cmd = [sys.executable, "-m", "bench.gpu_smoke", "--dry", "--out", "not-yet/smoke.jsonl"]
    cmd += ["--only", "tests,gemm", "--budget", "gemm=2"]  # importing torch alone takes longer
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = load_results(out)
    sections = results["sections"]
    preflight = sections["preflight"]  # runs first, whatever --only says
    assert preflight["status"] == "ok" and preflight["variants"]["modules"]["missing"] == []
    assert sections["versions"]["status"] == "skipped" and "--only" in sections["versions"]["reason"]
    assert sections["gemm"]["status"] == "timeout" and sections["gemm"]["budget_s"] == 2
    # pytest ran tests/gpu and each test is reported, skipped without CUDA with its reason
    tests = sections["tests"]["variants"]
    gpu_tests = {v: r for v, r in tests.items() if v != "pytest"}
    not_skipped = {v: r for v, r in gpu_tests.items() if r["status"] != "skipped" or "GPU" not in r["skipped"]}
    assert gpu_tests and not_skipped == {}
    assert results["summary"]["ok"] is False and results["summary"]["statuses"]["gemm"] == "timeout"


def test_what_preflight_finds_missing_skips_the_sections_that_need_it(tmp_path):
    ctx = Context("preflight", None, dry=False, fake=False, quick=True, emit=lambda r: None)
    ctx.args = driver.parse_args(["--out", "x", "--wheels", str(tmp_path)])
    preflight.section_preflight(ctx)
    pre = {"variants": {r["variant"]: r for r in ctx.records}}
    assert pre["variants"]["wheels"]["missing"] == preflight.carried_wheels()
    # this machine has every module, so the missing wheels do not matter; a lacking one does
    assert pre["variants"]["modules"]["missing"] == [] and pre["variants"]["wheels"]["status"] == "ok"
    pre["variants"]["modules"]["blocks"]["demo"] = ["diffusers"]
    assert driver._blocked("demo", pre, cuda=False) == "preflight: missing modules diffusers"
    assert driver._blocked("gemm", pre, cuda=False) is None
    pre["variants"]["device"] = {"status": "failed", "problems": ["GPU 0: capability 8.0 < 8.9 (no FP8)"]}
    assert "8.0 < 8.9" in driver._blocked("gemm", pre, cuda=True)
    assert driver._blocked("gemm", pre, cuda=False) is None and driver._blocked("versions", pre, cuda=True) is None


def test_the_load_section_measures_load_model_against_the_read_floor_on_cpu():
    ctx = Context("load", torch.device("cpu"), dry=True, fake=False, quick=True, emit=lambda r: None)
    run_section("load", ctx)
    by = {r["variant"]: r for r in ctx.records}
    assert {v: r["status"] for v, r in by.items()} == {
        "raw read": "ok",
        "load_model": "ok",
        "load/close x5": "ok",
        "h2d": "skipped",
        "vs floor": "ok",
    }, {v: r.get("error") for v, r in by.items()}
    cycles = by["load/close x5"]  # RSS on the CPU: what close() gives back is measurable here too
    assert cycles["one_load_bytes"] >= 0.9 * by["load_model"]["bytes_read"] and len(cycles["after_close_bytes"]) == 5
    assert cycles["within_5pct_of_one_load"], cycles
    load = by["load_model"]
    # load_model read exactly the codes of every linear, 1 byte per element
    assert load["bytes_read"] == load["fp8_linears"] * load_section.LOAD_ROWS * load_section.LOAD_COLS > 0
    assert by["vs floor"]["floor"] == "raw read" and by["vs floor"]["load_vs_floor"] > 0
