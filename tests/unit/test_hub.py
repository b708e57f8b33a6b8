"""Hub names resolve through a local Hugging Face cache only: repo ids, revisions and cache
repo roots, against a cache laid out as huggingface_hub lays it out (blobs + snapshot links)."""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from fsdp_fp8.cli import commands as cli  # noqa: E402
from fsdp_fp8.format.checkpoint import open_checkpoint  # noqa: E402

FIXTURE = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-llama-tied"
MAIN, V1 = "a" * 40, "b" * 40  # commit hashes


def _snapshot(repo: Path, commit: str, source: Path) -> Path:
    """``snapshots/<commit>/<file>`` -> ``../../blobs/<sha256>``, as the hub cache stores files."""
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(source.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A cache with ``acme/tiny-llama`` at main and at tag v1 (another commit of the same
    files); the network is cut and every attempt to reach it fails the test."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    snapshots = {"main": _snapshot(repo, MAIN, FIXTURE), "v1": _snapshot(repo, V1, FIXTURE)}
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    attempts = []

    def no_network(*args, **kwargs):  # recorded, not only raised: HTTP clients catch and retry
        attempts.append(args)
        raise OSError("network access attempted")

    for owner, name in ((socket, "getaddrinfo"), (socket, "create_connection"), (socket.socket, "connect")):
        monkeypatch.setattr(owner, name, no_network)
    monkeypatch.chdir(tmp_path)  # "acme/tiny-llama" is no directory here
    yield cache, repo, snapshots
    assert attempts == [], "the hub was contacted"


@pytest.mark.parametrize(
    "name, snapshot",
    [
        ("acme/tiny-llama", "main"),
        ("acme/tiny-llama@main", "main"),
        ("acme/tiny-llama@v1", "v1"),
        (f"acme/tiny-llama@{V1}", "v1"),
        ("REPO_ROOT", "main"),
        ("REPO_ROOT@v1", "v1"),
    ],
)
def test_hub_names_open_the_cached_snapshot(hub, name, snapshot):
    _, repo, snapshots = hub
    name = name.replace("REPO_ROOT", str(repo))
    ckpt = open_checkpoint(name)
    assert ckpt.directory == snapshots[snapshot]
    reference = open_checkpoint(FIXTURE)
    assert sorted(ckpt.tensors) == sorted(reference.tensors)
    assert [f.header_sha256 for f in ckpt.files.values()] == [f.header_sha256 for f in reference.files.values()]


@pytest.mark.parametrize(
    "name, needle",
    [
        ("acme/other-model", "no complete snapshot of acme/other-model"),
        ("acme/tiny-llama@v2", "no complete snapshot of acme/tiny-llama@v2"),
        ("REPO_ROOT@v2", "no complete snapshot of acme/tiny-llama@v2"),
    ],
)
def test_a_missing_snapshot_is_a_clear_error_and_no_download(hub, name, needle):
    cache, repo, _ = hub
    with pytest.raises(FileNotFoundError) as err:
        open_checkpoint(name.replace("REPO_ROOT", str(repo)))
    message = str(err.value)
    assert needle in message and str(cache) in message and "never downloads" in message, message


def test_an_existing_directory_wins_over_a_repo_id(hub, tmp_path):
    local = tmp_path / "acme" / "tiny-llama"
    shutil.copytree(FIXTURE, local)
    assert open_checkpoint("acme/tiny-llama").directory == Path("acme/tiny-llama")


def test_a_path_that_is_no_repo_id_is_reported_missing(hub):
    with pytest.raises(FileNotFoundError, match="checkpoint directory nowhere/at/all does not exist"):
        open_checkpoint("nowhere/at/all")


def test_verify_and_inspect_take_a_repo_id(hub, capsys):
    pytest.importorskip("transformers")
    _, _, snapshots = hub
    assert cli.main(["verify", "acme/tiny-llama@v1", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {snapshots['v1']} loads onto cpu as LlamaForCausalLM")
    assert cli.main(["inspect", "acme/tiny-llama"]) == 0
    assert f"checkpoint:      {snapshots['main']}" in capsys.readouterr().out


# A hostile cache: names whose revision, ref file or snapshot would lead outside the cache.
# Each leads (on a resolver that checks nothing) to a complete checkpoint in ``outside/``, so a
# refusal is the only way such a name does not load it.


@pytest.fixture
def hostile(hub, tmp_path):
    cache, repo, snapshots = hub
    outside = tmp_path / "outside"
    shutil.copytree(FIXTURE, outside)
    # refs/evil's text names the snapshot; huggingface_hub joins it onto snapshots/ unchecked.
    (repo / "refs" / "evil").write_text("../../../outside")
    # refs/pr/1 (a valid ref name with slashes) at a commit whose snapshot links out of the cache.
    linked = "c" * 40
    (repo / "refs" / "pr").mkdir()
    (repo / "refs" / "pr" / "1").write_text(linked)
    (repo / "snapshots" / linked).symlink_to(outside, target_is_directory=True)
    # A ref file outside the cache, reached by a revision climbing out of refs/.
    (tmp_path / "x").write_text("../../../outside")
    return cache, repo, snapshots, outside


@pytest.mark.parametrize(
    "name, needles",
    [
        ("acme/tiny-llama@../../../x", ["'../../../x'", "neither a commit hash nor a valid git ref name", "`..`"]),
        ("REPO_ROOT@..hidden", ["'..hidden'", "`..`"]),
        ("acme/tiny-llama@TMP/x", ["TMP/x", "starts or ends with `/`"]),
        ("acme/tiny-llama@.hidden", ["'.hidden'", "starts with `.`"]),
        ("acme/tiny-llama@main.lock", ["'main.lock'", "ends with `.lock`"]),
        ("acme/tiny-llama@evil", ["'evil'", "refs/evil holds '../../../outside', not a commit hash", "TMP/outside"]),
        ("REPO_ROOT@evil", ["'evil'", "not a commit hash", "led to TMP/outside"]),
        ("acme/tiny-llama@pr/1", ["'pr/1'", "resolves to TMP/outside", "not a directory inside"]),
        ("acme/tiny-llama@" + "c" * 40, ["'" + "c" * 40 + "'", "resolves to TMP/outside"]),
    ],
)
def test_a_hub_name_never_leads_outside_the_cache(hostile, tmp_path, name, needles):
    """Refused naming the name, the revision and where it would have led; nothing outside is
    opened (a resolver that checks nothing opens ``outside/``, a complete checkpoint)."""
    _, repo, _, outside = hostile
    tmp = str(tmp_path.resolve())
    name = name.replace("REPO_ROOT", str(repo)).replace("TMP", tmp)
    with pytest.raises(FileNotFoundError) as err:
        opened = open_checkpoint(name)
        pytest.fail(f"{name} opened {opened.directory}")
    message = str(err.value)
    assert "refused" in message and repr(name) in message, message
    for needle in needles:
        assert needle.replace("TMP", tmp) in message, (needle, message)


def test_a_valid_ref_name_with_slashes_still_resolves(hostile):
    """git's rules, not a narrower pattern: ``refs/pr/1``-style names inside the cache load."""
    _, repo, snapshots, _ = hostile
    (repo / "refs" / "pr" / "2").write_text(V1)
    assert open_checkpoint("acme/tiny-llama@pr/2").directory == snapshots["v1"]


@pytest.mark.parametrize(
    "revision, valid",
    [
        ("main", True),
        ("v1.0", True),
        ("refs/pr/1", True),
        ("feature/x-y_z", True),
        ("..", False),
        ("a/../b", False),
        ("/abs", False),
        ("trailing/", False),
        ("a//b", False),
        ("a/.b", False),
        ("a.lock", False),
        ("end.", False),
        ("@", False),
        ("a@{1}", False),
        ("sp ace", False),
        ("ti~lde", False),
        ("back\\slash", False),
        ("", False),
    ],
)
def test_ref_names_follow_git_check_ref_format(revision, valid):
    from fsdp_fp8.format.hub import ref_name_problem

    assert (ref_name_problem(revision) is None) == valid, ref_name_problem(revision)


@pytest.mark.parametrize("command", [["verify", "--device", "cpu"], ["inspect"]])
def test_a_path_looking_name_in_neither_place_says_both_and_no_hub_advice(hub, capsys, command):
    """A mistyped relative path (``fixtures/...`` for ``tests/fixtures/...``) reads as a repo id:
    the answer names the directory it was looked up in and the cache, not the hub library's
    advice to pass ``local_files_only=False`` (no CLI user can), and no source line of ours."""
    cache, _, _ = hub
    assert cli.main([command[0], "fixtures/modelopt-0.47-llama-tied", *command[1:]]) == 1
    err = capsys.readouterr().err
    assert f"'fixtures/modelopt-0.47-llama-tied': no such directory (relative to {Path.cwd()}), and no complete " in err
    assert f"snapshot of fixtures/modelopt-0.47-llama-tied in the local Hugging Face cache {cache}" in err, err
    assert "local_files_only" not in err and "raised at" not in err and ".py:" not in err, err
