"""Inputs that would hang, exhaust or crash a rank before any collective could time out.

Named pipes and devices where a JSON file or shard belongs, a directory, a name too long for
the filesystem, JSON nested past any parser's stack, headers in an encoding the safetensors
library refuses, and an index naming very many files: each is refused with one
``CheckpointError`` naming the file, within a time bound, and ``verify`` / ``inspect`` print
it without a traceback. The pipe and device cases run in a child process with a wall-clock
and memory bound, so a regression fails the test instead of hanging or exhausting the machine.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from calibration import bound
from ckpt_writer import read_raw, write_raw
from small_models import FIXTURE, write_uneven_checkpoint

from fsdp_fp8.cli import commands as cli
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint

REFUSE_WITHIN_S = 5.0
INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00005.safetensors"


def _fixture_copy(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, directory)
    return directory


def _refused(directory: Path, *needles: str) -> CheckpointError:
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(directory)
    assert time.monotonic() - t0 < bound(REFUSE_WITHIN_S)
    text = str(info.value)
    assert all(n in text for n in needles), (needles, text)
    return info.value


# --- pipes and devices: never block, never read without bound ---------------------------------

_CHILD = textwrap.dedent("""
    import json, sys, time
    from fsdp_fp8.errors import CheckpointError
    from fsdp_fp8.format.checkpoint import open_checkpoint
    out = {}
    for case, directory in json.loads(sys.argv[1]).items():
        t0 = time.monotonic()
        try:
            open_checkpoint(directory)
            out[case] = ["accepted", "", time.monotonic() - t0]
        except CheckpointError as exc:
            out[case] = ["CheckpointError", str(exc), time.monotonic() - t0]
        except BaseException as exc:
            out[case] = [type(exc).__name__, str(exc), time.monotonic() - t0]
    print(json.dumps(out))
""")


def _bounded_child():
    # 4 GiB of address space: a reader that slurps an endless device dies of MemoryError
    # instead of exhausting the machine.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_pipes_and_devices_are_refused_without_blocking(tmp_path):
    cases = {}
    for name in ("config.json", "hf_quant_config.json", INDEX, SHARD):  # a named pipe in each place
        d = _fixture_copy(tmp_path / f"fifo-{name}")
        (d / name).unlink()
        os.mkfifo(d / name)
        cases[f"fifo {name}"] = (d, name, "is a named pipe, not a regular file")
    for name in ("config.json", "hf_quant_config.json"):  # hub snapshots link their JSON files
        d = _fixture_copy(tmp_path / f"dev-{name}")
        (d / name).unlink()
        (d / name).symlink_to("/dev/zero")
        cases[f"/dev/zero as {name}"] = (d, name, "is a character device, not a regular file")
    d = _fixture_copy(tmp_path / "dev-single")
    for p in list(d.glob("*.safetensors*")):
        p.unlink()
    os.mkfifo(d / "model.safetensors")
    cases["fifo model.safetensors"] = (d, "model.safetensors", "is a named pipe, not a regular file")
    arg = json.dumps({case: str(d) for case, (d, _, _) in cases.items()})
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, arg],
            capture_output=True,
            text=True,
            timeout=bound(60),
            preexec_fn=_bounded_child,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("open_checkpoint blocked on a pipe or device (killed after 60 s x the slowdown)")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for case, (_, name, needle) in cases.items():
        kind, text, seconds = results[case]
        assert kind == "CheckpointError", (case, kind, text[:500])
        assert name in text and needle in text, (case, text)
        assert seconds < bound(REFUSE_WITHIN_S), (case, seconds)


def test_a_json_file_larger_than_the_cap_is_refused_unread(tmp_path, monkeypatch):
    from fsdp_fp8.format import handles

    d = _fixture_copy(tmp_path)
    monkeypatch.setattr(handles, "MAX_JSON_BYTES", 1000)
    _refused(d, INDEX, "bytes; JSON files above 1,000 are refused")


# --- directories, names, nesting, encodings: one CheckpointError, never a bare exception -------


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json", INDEX, SHARD])
def test_a_directory_where_a_file_belongs_is_refused(tmp_path, name):
    d = _fixture_copy(tmp_path)
    (d / name).unlink()
    (d / name).mkdir()
    _refused(d, name, "is a directory, not a regular file")


def test_a_file_name_too_long_for_the_filesystem_is_refused(tmp_path):
    d = _fixture_copy(tmp_path)
    index = json.loads((d / INDEX).read_text())
    long_name = "x" * 300 + ".safetensors"
    index["weight_map"]["model.norm.weight"] = long_name
    (d / INDEX).write_text(json.dumps(index))
    _refused(d, INDEX, "`model.norm.weight`", "cannot be looked up", "File name too long")


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "depth, needle", [(100_000, "nested too deeply to parse"), (200, "nested more than 32 levels deep")]
)
@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json", INDEX])
def test_deeply_nested_json_is_refused(tmp_path, name, depth, needle):
    d = _fixture_copy(tmp_path)
    obj = json.loads((d / name).read_text())
    text = json.dumps(obj)[:-1] + f', "deep": {_deep(depth)}}}'
    (d / name).write_text(text)
    _refused(d, name, needle)


def test_a_deeply_nested_header_is_refused(tmp_path):
    d = _fixture_copy(tmp_path)
    header, data = read_raw(d / SHARD)
    text = json.dumps(header)[:-1] + f', "x": {{"dtype": "F32", "shape": {_deep(100_000)}, "data_offsets": [0, 0]}}}}'
    write_raw(d / SHARD, text.encode(), data)
    _refused(d, f"{SHARD} header", "nested too deeply to parse")
    write_raw(
        d / SHARD,
        json.dumps({**header, "x": {"dtype": "F32", "shape": json.loads(_deep(500)), "data_offsets": [0, 0]}}).encode(),
        data,
    )
    _refused(d, "`x` in " + SHARD, "is not a list of non-negative integers")


@pytest.mark.parametrize(
    "encode, needle",
    [
        (lambda t: b"\xef\xbb\xbf" + t.encode(), "byte-order mark"),
        (lambda t: t.encode("utf-16"), "not UTF-8"),
        (lambda t: t.encode("utf-16-le"), "not valid JSON"),  # valid UTF-8 (NULs), not JSON
        (lambda t: t.replace('"format"', '"f\\u00e9rmat"').encode().replace(b"\\u00e9", b"\xe9"), "not UTF-8"),
        (lambda t: t.replace('"pt"', "NaN"), "non-standard constant NaN"),
    ],
)
def test_a_header_the_safetensors_library_refuses_is_refused(tmp_path, encode, needle):
    d = _fixture_copy(tmp_path)
    header, data = read_raw(d / SHARD)
    raw = encode(json.dumps(header))
    write_raw(d / SHARD, raw if isinstance(raw, bytes) else raw.encode(), data)
    _refused(d, f"{SHARD} header is not valid JSON", needle)


def _refuse_index_naming(d: Path, files: int) -> tuple[float, CheckpointError]:
    index = json.loads((FIXTURE / INDEX).read_text())
    index["weight_map"].update({f"extra.{i}.weight": f"missing-{i:06d}.safetensors" for i in range(files)})
    (d / INDEX).write_text(json.dumps(index))
    best, error = float("inf"), None
    for _ in range(2):  # the faster of two: a busy machine slows one run, not the shape of the cost
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            open_checkpoint(d)
        best, error = min(best, time.monotonic() - t0), info.value
    return best, error


def test_an_index_naming_many_distinct_files_is_checked_in_linear_time(tmp_path):
    d = _fixture_copy(tmp_path)
    small, _ = _refuse_index_naming(d, 4_000)
    large, error = _refuse_index_naming(d, 16_000)
    # One problem per missing file, each naming its key; 4x the files must cost about 4x the
    # time (quadratic code costs 16x: minutes at this size).
    assert sum("which does not exist" in p for p in error.problems) == 16_000
    assert any("`extra.15999.weight`" in p and "missing-015999" in p for p in error.problems)
    assert large < max(8 * small, bound(0.5)) and large < bound(REFUSE_WITHIN_S), (small, large)


def test_an_ignore_list_of_many_names_matches_in_linear_time():
    from fsdp_fp8.format.quant_config import QuantConfig

    quant = QuantConfig(True, ignore=tuple(f"model.layers.{i}.mlp.gate" for i in range(50_000)) + ("*.router", "lm_*"))
    t0 = time.monotonic()
    hits = sum(quant.is_ignored(f"model.layers.{i}.mlp.gate") for i in range(0, 100_000, 2))
    assert hits == 25_000
    assert quant.is_ignored("a.router") and quant.is_ignored("lm_head") and quant.is_ignored("model.layers.7.mlp.gate")
    assert not quant.is_ignored("model.layers.1.mlp.up") and not quant.is_ignored("model.layers.1.mlp.gateway")
    assert time.monotonic() - t0 < bound(REFUSE_WITHIN_S)


# --- the CLI prints the refusal, never a traceback --------------------------------------------


def _hostile_dirs(tmp_path: Path) -> dict[str, Path]:
    out = {}
    d = _fixture_copy(tmp_path / "dir")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    out["directory as config.json"] = d
    d = _fixture_copy(tmp_path / "deep")
    (d / "hf_quant_config.json").write_text(_deep(100_000))
    out["deep hf_quant_config.json"] = d
    d = _fixture_copy(tmp_path / "bom")
    header, data = read_raw(d / SHARD)
    write_raw(d / SHARD, b"\xef\xbb\xbf" + json.dumps(header).encode(), data)
    out["BOM header"] = d
    d = _fixture_copy(tmp_path / "long")
    index = json.loads((d / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "y" * 300 + ".safetensors"
    (d / INDEX).write_text(json.dumps(index))
    out["long name"] = d
    return out


@pytest.mark.parametrize("command", [["verify"], ["verify", "--sha256"], ["inspect"], ["inspect", "--world-size", "2"]])
def test_verify_and_inspect_print_one_error_and_no_traceback(tmp_path, capsys, command):
    for case, d in _hostile_dirs(tmp_path).items():
        code = cli.main([command[0], str(d), *command[1:]])  # an escaping exception fails the test
        err = capsys.readouterr().err
        assert code == 1, case
        assert "Traceback" not in err and "problem" in err, (case, err)


def test_scale_reads_go_through_the_held_descriptor_not_the_path(tmp_path):
    """Opening reads each file once: a scale is read from the descriptor its header came from."""
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    opened = []
    real_open = os.open

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    os.open = counting_open
    try:
        with open_checkpoint(d) as ckpt:
            assert len(ckpt.scales) == 12
    finally:
        os.open = real_open
    assert sorted(opened) == sorted(p.name for p in d.iterdir()), opened
