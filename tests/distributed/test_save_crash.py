"""Crash-safe saves: what a save killed mid-write leaves behind, and what cleans it.

Each rank in turn (2 gloo ranks) is killed with SIGKILL in the middle of its writes, and rank 0
once more just before the rename into place. The target must never appear (it holds a whole
checkpoint or nothing), and the next save into the same parent must remove what the dead save
left (rank 0's temporary directory) and write a checkpoint equal to a clean save's. Then the
rule that decides which leftovers are dead (``fsdp_fp8.save.temp_dir``), the permissions
of a finished save, the destination check before the CLI loads anything, and the source's
non-weight files carried over.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_writer import raw_tensors
from ranks import RanksFailed, run_ranks
from small_models import uneven_model_fn, write_uneven_checkpoint

KV_FIXTURE = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-llama-fp8-kv"


def _save_once(source: Path, target: Path, **kwargs):
    from fsdp_fp8 import load_model, save_checkpoint

    loaded = load_model(uneven_model_fn, source, device=torch.device("cpu"))
    return save_checkpoint(loaded, target, **kwargs)


# --- a rank killed mid-save -----------------------------------------------------------------


def _save_and_die(rank, world, source: str, target: str, dying: int, when: str, records: str) -> None:
    from unittest import mock

    from fsdp_fp8 import load_model, save_checkpoint
    from fsdp_fp8.format.writer import ShardWriter
    from fsdp_fp8.save import save_checkpoint as save_module

    loaded = load_model(uneven_model_fn, source, device=torch.device("cpu"))
    real_write, writes = ShardWriter.write, []

    def write_then_die(self, key, offset, data):
        real_write(self, key, offset, data)
        writes.append(key)
        if len(writes) == 2:  # some of its bytes are on disk, the rest never will be
            os.kill(os.getpid(), signal.SIGKILL)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    patches = []
    if rank == dying:
        if when == "mid-write":
            patches.append(mock.patch.object(ShardWriter, "write", write_then_die))
        else:
            patches.append(mock.patch.object(save_module, "move_into_place", die))
    for p in patches:
        p.start()
    try:
        save_checkpoint(loaded, target, timeout_s=30)
        record = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - judged by the test
        record = (type(exc).__name__, str(exc))
    Path(records, f"rank{rank}.pkl").write_bytes(pickle.dumps(record))


def _save_next(rank, world, source: str, target: str) -> tuple[tuple[str, ...], list[str]]:
    """The next save at 2 ranks: what it removed, and what this rank logged about it."""
    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "left by an interrupted save" in record.getMessage():
                said.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("fsdp_fp8").addHandler(handler)
    try:
        report = _save_once(Path(source), Path(target))
    finally:
        logging.getLogger("fsdp_fp8").removeHandler(handler)
    return report.removed_leftovers, said


@pytest.mark.parametrize(("dying", "when"), [(0, "mid-write"), (1, "mid-write"), (0, "before the rename")])
def test_a_rank_killed_mid_save_leaves_no_mix_and_nothing_survives_the_next_save(tmp_path, monkeypatch, dying, when):
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 60.0)  # the survivor must be allowed to report
    source = write_uneven_checkpoint(tmp_path / "src")
    parent = tmp_path / "out"
    target = parent / "ckpt"
    with pytest.raises(RanksFailed, match=f"rank {dying} died of SIGKILL"):
        run_ranks(_save_and_die, 2, str(source), str(target), dying, when, str(tmp_path), timeout=240, pg_timeout=30)
    survivor = 1 - dying
    kind, text = pickle.loads((tmp_path / f"rank{survivor}.pkl").read_bytes())
    assert kind == "PeerLostError", (kind, text)  # it learnt of the death and raised
    assert not target.exists()  # never a partial or mixed checkpoint at the target
    left = sorted(p.name for p in parent.iterdir())
    assert all(name.startswith(".ckpt.tmp-") for name in left), left
    # Only rank 0's death leaves its temporary directory behind; a surviving rank 0 removes it.
    assert len(left) == (1 if dying == 0 else 0), left

    nexts = run_ranks(_save_next, 2, str(source), str(target), timeout=240, pg_timeout=30)
    assert sorted(p.name for p in parent.iterdir()) == ["ckpt"]  # no leftover survives the next save
    (removed, said), (removed_1, said_1) = nexts
    assert sorted(Path(p).name for p in removed) == left and removed_1 == ()
    assert len(said) == len(left) and said_1 == [], nexts  # each removal said once, by rank 0
    assert all("no longer running" in line for line in said), said
    reference = _save_once(source, tmp_path / "reference" / "ckpt").directory
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert raw_tensors(target) == raw_tensors(reference) == raw_tensors(source)


# --- which leftovers are dead -----------------------------------------------------------------


def _dead_pid() -> tuple[int, int]:
    """(pid, start time) of a process that has exited."""
    from fsdp_fp8.save.temp_dir import process_start

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = process_start(child.pid)
    child.kill()
    child.wait()
    return child.pid, start


def _leftover(parent: Path, target: str, owner) -> Path:
    path = parent / f".{target}.tmp-{owner.token()}-abcd1234"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"partial")
    return path


def test_only_leftovers_of_dead_saves_are_removed(tmp_path):
    import dataclasses

    from fsdp_fp8.save.temp_dir import Owner, clean_leftovers, process_start

    me = Owner.this_process()
    pid, start = _dead_pid()
    gone = dataclasses.replace(me, pid=pid, start=start)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = {
            _leftover(tmp_path, "a", gone),  # exited
            _leftover(tmp_path, "b", dataclasses.replace(me, start=me.start + 1)),  # our pid, reused
            _leftover(tmp_path, "c", dataclasses.replace(gone, boot="0badb007")),  # before a reboot
        }
        kept = {
            _leftover(tmp_path, "d", me): "which is still running",  # this very process
            _leftover(tmp_path, "e", dataclasses.replace(me, pid=live.pid, start=process_start(live.pid))): "still",
            _leftover(tmp_path, "f", dataclasses.replace(gone, host="elsewhere")): "another host",
            _leftover(tmp_path, "g", dataclasses.replace(gone, namespace="0c0ffee0")): "cannot be seen from here",
            _leftover(tmp_path, "h", dataclasses.replace(gone, machine="00000000", boot="0badb007")): "cannot be seen",
        }
        old = tmp_path / ".i.tmp-k2j4h6g8"  # an older fsdp_fp8's mkdtemp name: no owner in it
        old.mkdir()
        kept[old] = "does not say which process made it"
        if os.geteuid() == 0:  # only root can make a directory another user owns
            other_user = _leftover(tmp_path, "j", gone)
            os.chown(other_user, 4321, 4321)
            kept[other_user] = "made by another user (uid 4321)"
        unrelated = [tmp_path / "ckpt", tmp_path / ".ckpt.tmp-notes.txt", tmp_path / ".x.tmp-not-an-owner"]
        unrelated[0].mkdir()
        unrelated[1].write_text("a file, not a save's directory")
        unrelated[2].mkdir()
        link = tmp_path / f".k.tmp-{gone.token()}-abcd1234"
        link.symlink_to(unrelated[0])  # a link, never followed nor removed
        cleaning = clean_leftovers(tmp_path)
    finally:
        live.kill()
        live.wait()
    assert {x.path for x in cleaning.removed} == dead
    assert not any(p.exists() for p in dead)
    assert {x.path for x in cleaning.kept} == set(kept)
    for leftover in cleaning.kept:
        assert kept[leftover.path] in leftover.why, (leftover.path.name, leftover.why)
        assert leftover.path.exists()
    assert all(p.exists() for p in unrelated) and link.is_symlink()
    assert cleaning.failed == []


def test_the_cli_clean_removes_dead_leftovers_and_says_so(tmp_path, capsys):
    import dataclasses

    from fsdp_fp8.cli.commands import main
    from fsdp_fp8.save.temp_dir import Owner

    me = Owner.this_process()
    pid, start = _dead_pid()
    dead = _leftover(tmp_path, "ckpt", dataclasses.replace(me, pid=pid, start=start))
    live = _leftover(tmp_path, "ckpt", me)
    assert main(["save", "--clean", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert f"removed {dead}, left by an interrupted save (made by pid {pid} on {me.host}" in out, out
    assert f"left {live} alone: made by pid {me.pid} on {me.host}, which is still running" in out, out
    assert not dead.exists() and live.exists()
    assert main(["save", "--clean", str(tmp_path / "other")]) == 0  # the live one is all that is left
    assert "removed" not in capsys.readouterr().out


def test_a_pid_no_process_can_have_is_an_unknown_owner_kept_and_named_once(tmp_path, capsys, caplog):
    """A leftover named with pid 10**25 (os.kill overflows on it) used to end `save --clean` and
    every save into its parent in an OverflowError, keeping the dead leftover beside it."""
    import dataclasses

    from fsdp_fp8.cli.commands import main
    from fsdp_fp8.save.temp_dir import Owner

    me = Owner.this_process()
    pid, start = _dead_pid()
    parent = tmp_path / "out"
    odd = _leftover(parent, "ckpt", dataclasses.replace(me, pid=10**25))
    dead = _leftover(parent, "ckpt", dataclasses.replace(me, pid=pid, start=start))
    assert main(["save", "--clean", str(parent / "ckpt")]) == 0
    said = "".join(capsys.readouterr())
    assert f"left {odd} alone: its owner is unknown: the pid in its name, {10**25}, cannot be a process id" in said
    assert said.count(odd.name) == 1 and not dead.exists() and odd.exists(), said
    dead = _leftover(parent, "ckpt", dataclasses.replace(me, pid=pid, start=start))
    with caplog.at_level(logging.WARNING, logger="fsdp_fp8"):
        report = _save_once(write_uneven_checkpoint(tmp_path / "src"), parent / "ckpt")
    assert report.removed_leftovers == (str(dead),) and not dead.exists() and odd.exists()
    assert caplog.text.count(odd.name) == 1, caplog.text
    assert (parent / "ckpt" / "model.safetensors").is_file()


# --- permissions ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_a_saved_checkpoint_gets_the_users_umask(tmp_path, mask):
    source = write_uneven_checkpoint(tmp_path / "src")
    (source / "generation_config.json").write_text("{}")
    old = os.umask(mask)
    try:
        report = _save_once(source, tmp_path / "out" / "ckpt", max_shard_size=200)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in report.directory.iterdir()}
    assert report.directory.stat().st_mode & 0o777 == 0o777 & ~mask
    assert len(modes) > 3 and set(modes.values()) == {0o666 & ~mask}, modes


# --- the destination, checked before anything loads -------------------------------------------


def test_cli_save_refuses_a_bad_destination_before_loading(tmp_path, capsys, monkeypatch):
    import fsdp_fp8.compose.model as api
    from fsdp_fp8.cli.commands import main

    loads = []
    real = api.load_model
    monkeypatch.setattr(api, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("not a directory")
    cases = {
        tmp_path / "full": "exists and is not an empty directory",
        tmp_path / "file": "exists and is not a directory",
        tmp_path
        / "file"
        / "ckpt": f"cannot create {tmp_path / 'file' / 'ckpt'}: {tmp_path / 'file'} is not a directory",
    }
    for destination, needle in cases.items():
        assert main(["save", str(KV_FIXTURE), str(destination)]) == 1
        err = capsys.readouterr().err
        assert needle in err, err
    assert loads == []  # refused before the source was loaded
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert main(["save", str(KV_FIXTURE), str(tmp_path / "new" / "ckpt")]) == 0  # parents are created
    assert len(loads) == 1


@pytest.fixture
def small_filesystem(tmp_path):
    """A 64 KiB tmpfs (root only; skipped where it cannot be mounted)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_save_that_does_not_fit_is_refused_before_writing(small_filesystem, capsys):
    from fsdp_fp8.cli.commands import main

    assert main(["save", str(KV_FIXTURE), str(small_filesystem / "kv")]) == 1
    err = capsys.readouterr().err
    import re

    found = re.search(rf"{re.escape(str(small_filesystem / 'kv'))} needs ([\d,]+) bytes but its filesystem", err)
    assert found, err
    assert int(found[1].replace(",", "")) > (KV_FIXTURE / "model.safetensors").stat().st_size > 64 * 1024
    assert list(small_filesystem.iterdir()) == []  # nothing written, no temporary directory left
    assert os.statvfs(small_filesystem).f_bfree == os.statvfs(small_filesystem).f_blocks


# --- the source's other files ------------------------------------------------------------------


def test_the_sources_non_weight_files_are_carried_or_named(tmp_path, caplog):
    source = write_uneven_checkpoint(tmp_path / "src")
    extras = {
        "generation_config.json": b'{"do_sample": false}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b"{}",
        "special_tokens_map.json": b"{}",
        "README.md": b"# a model card\n",
    }
    for name, data in extras.items():
        (source / name).write_bytes(data)
    (source / "original").mkdir()
    (source / "pytorch_model.bin").write_bytes(b"pickle")
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's own file")
    (source / "notes.txt").symlink_to(secret)
    (source / "vocab.txt").symlink_to(source / "README.md")  # a link inside the checkpoint: followed
    os.mkfifo(source / "pipe")
    with caplog.at_level(logging.WARNING, logger="fsdp_fp8"):
        report = _save_once(source, tmp_path / "out")
    for name, data in extras.items():
        assert (report.directory / name).read_bytes() == data, name
    assert (report.directory / "vocab.txt").read_bytes() == extras["README.md"]
    assert not (report.directory / "vocab.txt").is_symlink()
    assert sorted(report.carried) == sorted([*extras, "vocab.txt"])
    assert sorted(report.not_carried) == sorted(
        [
            f"notes.txt (a symlink to {secret.resolve()}, outside the checkpoint)",
            "original (a directory)",
            "pipe (not a regular file)",
            "pytorch_model.bin (pickle weights, never read)",
        ]
    )
    assert not (report.directory / "notes.txt").exists() and not (report.directory / "original").exists()
    logged = [r.getMessage() for r in caplog.records if "not carried" in r.getMessage()]
    assert len(logged) == 4, logged


def test_cli_save_carries_generation_config(tmp_path):
    from fsdp_fp8.cli.commands import main

    assert main(["save", str(KV_FIXTURE), str(tmp_path / "kv")]) == 0
    assert (tmp_path / "kv" / "generation_config.json").read_bytes() == (
        KV_FIXTURE / "generation_config.json"
    ).read_bytes()


# --- plan_save: pure, without ranks --------------------------------------------------------------


def test_plan_save_decides_everything_without_writing(tmp_path):
    from fsdp_fp8 import load_model, plan_save

    source = write_uneven_checkpoint(tmp_path / "src")
    loaded = load_model(uneven_model_fn, source, device=torch.device("cpu"))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    plan = plan_save(loaded)
    assert plan.problems == ()
    assert sorted(plan.layout.tensors) == sorted(raw_tensors(source))
    assert plan.bytes_to_write == sum(p.spec.nbytes for p in plan.layout.tensors.values())
    assert plan_save(loaded, rank=1).bytes_to_write == 0  # unsharded: rank 0 writes it all
    assert plan_save(loaded).digest == plan.digest
    assert plan_save(loaded, max_shard_size=200).digest != plan.digest
    broken = plan_save(loaded.model, unusable="rank 1: injected")  # no source, no config: two problems
    assert broken.layout is None and len(broken.problems) == 2, broken.problems
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing was written


def test_a_symlink_destination_is_refused_before_anything_is_written(tmp_path):
    # The rename into place replaces a link, it does not fill its target: refused up front,
    # not after every byte was written.
    from fsdp_fp8.save.destination import destination_problems

    target = tmp_path / "empty"
    target.mkdir()
    link = tmp_path / "out"
    link.symlink_to(target)
    (problem,) = destination_problems(link)
    assert f"{link} is a symbolic link (to {target})" in problem and f"({target})" in problem, problem
    assert destination_problems(target) == []


def test_a_directory_sync_error_is_raised_unless_the_filesystem_cannot_sync_directories(tmp_path, monkeypatch):
    import errno

    from fsdp_fp8.save import temp_dir

    def fsync_failing(code):
        def fsync(fd):
            raise OSError(code, os.strerror(code))

        return fsync

    monkeypatch.setattr(temp_dir.os, "fsync", fsync_failing(errno.EINVAL))
    temp_dir.sync_directory(tmp_path)  # a filesystem that cannot sync a directory: the data was synced
    monkeypatch.setattr(temp_dir.os, "fsync", fsync_failing(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        temp_dir.sync_directory(tmp_path)  # a write-back failure: the save must not say it is done
