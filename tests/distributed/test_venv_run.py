"""``scripts/venv-run`` says what it is doing while it sets the venv up: a line per phase, pip's
own output (on stderr, so the command's stdout stays its own), and how long it took;
and it runs the command in the caller's directory.

The venv is a stand-in whose ``python`` records its arguments and prints what pip would, and
the base ``python`` one without torch: the script's own logic runs, nothing is installed."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(venv: Path, base_python: Path, *command: str, cwd: Path | None = None):
    env = {**os.environ, "FSDP_FP8_VENV": str(venv), "PYTHON": str(base_python)}
    env.pop("FSDP_FP8_TORCH_INDEX_URL", None)
    return subprocess.run(
        [str(ROOT / "scripts" / "venv-run"), *(command or ("echo", "the command ran"))],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard: the script runs no real pip here
    )


def test_set_up_shows_each_phase_pip_and_the_time_taken(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip-calls"
    _executable(
        venv / "bin" / "python",
        f'#!/bin/sh\necho "$@" >> {log}\necho "Collecting $(echo "$@" | tr " " "\\n" | tail -n 1)"\n',
    )
    base = tmp_path / "python3"
    _executable(base, "#!/bin/sh\nexit 1\n")  # no torch >= 2.10 here: the CPU build is installed

    first = _run(venv, base)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "the command ran\n"  # pip's output is not mixed into the command's
    lines = first.stderr.splitlines()
    phases = [line for line in lines if re.match(r"\[venv-run\] phase \d/3: ", line)]
    assert [p.split(":")[0] for p in phases] == [f"[venv-run] phase {i}/3" for i in (1, 2, 3)], lines
    assert "torch==2.13.0" in phases[1] and "fsdp_fp8" in phases[2]
    assert re.search(r"one-time set-up, typically \d+-\d+ minutes", lines[0]), lines[0]
    assert re.fullmatch(r"\[venv-run\] set-up done in \d+ s; running: echo the command ran", lines[-1]), lines
    # pip's own output is shown (not -q), between the phase lines that started it.
    assert lines.index("Collecting torch==2.13.0") > lines.index(phases[1])
    assert lines.index(f"Collecting {ROOT}[test,hf]") > lines.index(phases[2])
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("-m pip install") and " -q" not in c for c in calls), calls

    again = _run(venv, base)  # installed: the command starts at once, silently
    assert (again.returncode, again.stdout, again.stderr) == (0, "the command ran\n", "")
    assert len(log.read_text().splitlines()) == 2


def test_the_command_runs_where_the_caller_is(tmp_path):
    """`cd /tmp && /path/to/clone/scripts/venv-run python -c 'import os; print(os.getcwd())'`
    prints /tmp: a snippet or an --output path relative to the caller's directory stays there."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".fsdp_fp8-installed").write_text(_stamp())  # set up already: the command runs at once
    _executable(venv / "bin" / "python", '#!/bin/sh\nexec python3 "$@"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ran = _run(venv, tmp_path / "python3", "python", "-c", "import os; print(os.getcwd())", cwd=elsewhere)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, f"{elsewhere}\n", "")


def _stamp() -> str:
    """What scripts/venv-run writes once the venv is set up for this pyproject and constraints."""
    import hashlib

    data = (ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16] + "\n"
