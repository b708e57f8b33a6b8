"""The documentation stands on its own: no file outside the repository is cited, no path of
one machine is given as if it were everyone's, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(
    [*ROOT.glob("fsdp_fp8/**/*.py"), *ROOT.glob("launch/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/**/*.py")]
)
# A format note kept outside the repository, and home or workspace directories of one machine.
OUTSIDE = re.compile(r"FORMAT\.md|/work/|/root/|/home/\w|/Users/\w")


@pytest.mark.parametrize("path", DOCS + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_the_repository_is_cited(path):
    if path == Path(__file__).resolve():
        return  # this file names what it looks for
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = path.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve()
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert broken == []


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def _options_in_help(argv, capsys, main) -> set[str]:
    with pytest.raises(SystemExit):
        main(argv)
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", capsys.readouterr().out)) - {"--help"}


@pytest.mark.parametrize("command", ["run", "inspect", "verify", "save"])
def test_every_option_is_in_usage_md(command, capsys):
    from fsdp_fp8.cli import commands

    options = _options_in_help([command, "--help"], capsys, commands.main)
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert options, command
    assert sorted(o for o in options if not re.search(rf"(?<![\w-]){o}(?![\w-])", usage)) == []


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_snippet_assumes_cuda(path):
    """``torch.cuda.set_device`` only under a check that CUDA is there: a CPU torch has none."""
    for block in _python_blocks(path):
        lines = block.splitlines()
        for n, line in enumerate(lines):
            if "cuda.set_device" in line:
                assert any("cuda.is_available()" in above for above in lines[max(0, n - 3) : n]), block


def test_the_load_model_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    """usage.md's first snippet, in one process on this machine, with its two placeholders
    bound: ``MyModel`` to the reference model and the path to a checkpoint of it."""
    import dataclasses

    from fsdp_fp8.export.modelopt import export_fp8
    from fsdp_fp8.models import PRESETS, MoTConfig, build_model, init_weights

    # Every FP8 linear 16-aligned, so that the same snippet loads onto CUDA where there is one.
    config = dataclasses.replace(PRESETS["tiny"], intermediate_size=96)
    model = init_weights(build_model(config, device="cpu"), seed=0)
    kept = ("lm_head", "proj_in", "proj_out")  # 6 latent channels: not a multiple of 16
    linears = [n for n, m in model.named_modules() if type(m).__name__ == "Linear" and n not in kept]
    ckpt = export_fp8(
        model,
        tmp_path / "ckpt",
        config=model.config.to_config_dict(),
        input_scales={n: 0.01 for n in linears},
        ignore=kept,
    )
    snippet = _python_blocks(ROOT / "docs" / "usage.md")[0]
    assert '"/path/to/checkpoint"' in snippet and "MyModel" in snippet
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    namespace = {"MyModel": lambda config: build_model(MoTConfig.from_config_dict(config))}
    exec(snippet.replace('"/path/to/checkpoint"', repr(str(ckpt))), namespace)
    assert len(namespace["loaded"].fp8_linears) == len(linears)
    assert "LoadReport(rank=0, world_size=1" in capsys.readouterr().out


def _usage_block(marker: str) -> str:
    """The one python block of usage.md containing ``marker``."""
    found = [b for b in _python_blocks(ROOT / "docs" / "usage.md") if marker in b]
    assert len(found) == 1, (marker, len(found))
    return found[0]


def _step_by_step_snippets(rank: int, world: int, ckpt: str, out_dir: str):
    """usage.md's piece-by-piece, step-policy and save snippets on one rank of ``world``, with
    their placeholders bound: ``MyModel`` to the reference model, ``path`` and ``mesh``/``device``
    to this job's, ``n`` to a step count. Returns what rank 0 gathered and what the ranks saved."""
    import torch

    import fsdp_fp8
    from fsdp_fp8.load.fsdp_wrap import default_mesh
    from fsdp_fp8.models import MoTConfig, build_model

    namespace = {
        "fsdp_fp8": fsdp_fp8,
        "MyModel": lambda config: build_model(MoTConfig.from_config_dict(config)),
        "path": ckpt,
        "mesh": default_mesh("cpu"),
        "device": torch.device("cpu"),
        "out_dir": f"{out_dir}/pieces",
    }
    exec(_usage_block("fsdp_fp8.plan_load(ckpt, model)"), namespace)
    pieces = namespace["report"].bytes_read, _as_bytes(namespace["state"]) if rank == 0 else None

    loaded = fsdp_fp8.load_model(None, ckpt, device=torch.device("cpu"))
    namespace.update(loaded=loaded, model=loaded.model, n=4)
    exec(_usage_block("install_step_policy(model, policy, loaded.towers)"), namespace)

    save = _usage_block("fsdp_fp8.save_checkpoint(loaded, ")
    save = save.replace('"/path/to/checkpoint"', repr(ckpt)).replace('"/path/to/new"', repr(f"{out_dir}/saved"))
    exec(save, namespace)
    saved = {name: _files_as_bytes(Path(out_dir, name)) for name in ("pieces", "saved")} if rank == 0 else None
    return pieces, saved


def _as_bytes(tensors: dict) -> dict:
    import torch

    return {k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in tensors.items()}


def _files_as_bytes(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in _as_bytes(load_file(f)).items()}


def test_the_step_by_step_snippets_run_as_written(tmp_path):
    """The pieces ``load_model`` composes, the step policy and the save, as usage.md prints them,
    on 2 gloo ranks: both saves hold the source's tensors, byte for byte."""
    import torch
    from ranks import run_ranks

    from fsdp_fp8.testing.mot_checkpoint import write_mot_checkpoint

    ckpt = write_mot_checkpoint(tmp_path / "ckpt")
    results = run_ranks(_step_by_step_snippets, 2, str(ckpt), str(tmp_path), timeout=240)
    (bytes_read, gathered), saved = results[0]
    source = _files_as_bytes(Path(ckpt))
    assert bytes_read > 0
    for name, got in (("gathered", gathered), ("pieces", saved["pieces"]), ("saved", saved["saved"])):
        assert sorted(got) == sorted(source), name
        assert [k for k in source if not torch.equal(got[k], source[k])] == [], name
