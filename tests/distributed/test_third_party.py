"""A library user's run prints nothing from TorchAO, torch or diffusers on fsdp_fp8's behalf:
their import-time notices are quieted around fsdp_fp8's own imports (``fsdp_fp8.third_party``),
and the user's logging and warning set-up is as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SNIPPET = """
import logging, sys, warnings

callers = []  # who set a warning filter: torch and its friends do on import; fsdp_fp8 must not


def recorded(set_filter):
    def record(*args, **kwargs):
        callers.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return set_filter(*args, **kwargs)

    return record


warnings.filterwarnings, warnings.simplefilter = recorded(warnings.filterwarnings), recorded(warnings.simplefilter)
import fsdp_fp8
for name in sys.argv[1:]:
    if name.startswith("pipeline:"):
        pipe = fsdp_fp8.load_pipeline(name.removeprefix("pipeline:"))
        print("loaded", type(pipe).__name__)
        continue
    loaded = fsdp_fp8.load_model(None, name)
    print("loaded", len(loaded.fp8_linears), "FP8 linears")
ours = sorted({c for c in callers if c.split(".")[0] == "fsdp_fp8"})
assert ours == [], f"warning filters set by {ours}"
from fsdp_fp8.third_party import QuietFilter

loggers = logging.root.manager.loggerDict.items()
left = [n for n, lg in loggers if any(isinstance(f, QuietFilter) for f in getattr(lg, "filters", ()))]
assert left == [], f"fsdp_fp8's filters left on {left}"
logging.getLogger("torchao").warning("Failed to load: the user's own message")  # still printed
"""


def test_a_snippet_calling_load_model_under_torchrun_prints_only_its_own_lines(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    fixtures = [str(FIXTURES / "modelopt-0.47-cosmos3-transformer"), str(FIXTURES / "modelopt-0.47-llama-sharded")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(snippet)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*cmd, *fixtures], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["loaded 31 FP8 linears", "loaded 14 FP8 linears"], proc.stdout
    assert proc.stderr.splitlines() == ["Failed to load: the user's own message"], proc.stderr[-3000:]


def test_a_snippet_calling_load_pipeline_prints_only_its_own_lines_and_diffusers_progress_bar(tmp_path, demo_root):
    root = demo_root
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(snippet), f"pipeline:{root}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["loaded Cosmos3OmniPipeline"], proc.stdout
    # diffusers' own progress bar stays (the user's to turn off); no notice, no advice, no warning
    lines = [line for line in proc.stderr.splitlines() if line and "Loading pipeline components" not in line]
    assert lines == ["Failed to load: the user's own message"], proc.stderr[-3000:]


def test_quiet_warnings_drops_only_its_own_and_shows_the_others_after():
    import warnings

    from fsdp_fp8.third_party import quiet_warnings

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_warnings():
            warnings.warn("`torch.nn.utils.weight_norm` is deprecated in favor of ...", FutureWarning)
            warnings.warn("the user's own", UserWarning)
    assert [(w.category, str(w.message)) for w in shown] == [(UserWarning, "the user's own")]
