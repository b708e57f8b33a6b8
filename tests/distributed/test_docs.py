"""The documentation stands on its own: no file outside the repository is cited, no path of
one machine is given as if it were everyone's, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(
    [
        *ROOT.glob("fsdp_fp8/**/*.py"),
        *ROOT.glob("launch/*.py"),
        *ROOT.glob("bench/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
    ]
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


def test_every_bench_command_runs_a_module_of_bench():
    """Benches run from the repository root as modules (``python -m bench.NAME``, ``torchrun ...
    -m bench.NAME``): a doc or a bench's usage line that runs ``bench/NAME.py`` as a script, or
    names a module ``bench`` lacks, fails here."""
    import importlib.util

    texts = {path: path.read_text() for path in [*DOCS, *ROOT.glob("bench/**/*.py"), *ROOT.glob("bench/*.sh")]}
    scripts = [
        f"{path.relative_to(ROOT)}: {hit}"
        for path, text in texts.items()
        for hit in re.findall(r"(?:python|torchrun|distributed\.run)[^\n`]*?\sbench/\w+\.py", text)
    ]
    named = {name for text in texts.values() for name in re.findall(r"-m (bench(?:\.\w+)+)", text)}
    named = {name for name in named if not name.rpartition(".")[2].isupper()}  # bench.NAME: a placeholder
    assert scripts == [] and {"bench.load", "bench.gpu_smoke"} <= named
    assert sorted(name for name in named if importlib.util.find_spec(name) is None) == []


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def _parser_options(command: str) -> set[str]:
    """The options ``COMMAND --help`` lists: the ``--`` flags of the parser that prints it."""
    from fsdp_fp8.cli.arguments import build_run_parser
    from fsdp_fp8.cli.commands import build_parser

    if command == "run":
        parser = build_run_parser()
    else:
        parser = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _table_options(text: str, header: str) -> set[str]:
    """The ``--`` flags in the first column of every docs table whose first header cell is ``header``."""
    found, rows = set(), None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            rows = None
        elif rows is None:
            rows = cells[0] == header  # a table's header row decides whether its rows count
        elif rows:
            found |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", cells[0]))
    return found


@pytest.mark.parametrize("command", ["run", "inspect", "verify", "save"])
def test_every_option_is_in_usage_md(command):
    """Each option ``--help`` lists has a row in usage.md's option table for its command, and each
    row an option of the command: an option added to the parser alone fails here."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    header = "option" if command == "run" else f"`{command}` option"
    options = _parser_options(command)
    assert options, command
    assert sorted(options - _table_options(usage, header)) == [], f"in --help, not in the {header!r} table"
    assert sorted(_table_options(usage, header) - options) == [], f"in the {header!r} table, not in --help"


def test_the_option_table_test_sees_an_option_added_to_help_only(monkeypatch):
    from fsdp_fp8.cli import arguments

    build = arguments.build_run_parser

    def with_one_more(*args, **kwargs):
        parser = build(*args, **kwargs)
        parser.add_argument("--brand-new", action="store_true", help="new")
        return parser

    monkeypatch.setattr(arguments, "build_run_parser", with_one_more)
    with pytest.raises(AssertionError, match="--brand-new"):
        test_every_option_is_in_usage_md("run")


def test_fsdp_fp8_cache_has_the_codes_one_meaning_everywhere(tmp_path, monkeypatch):
    """``FSDP_FP8_CACHE`` is the demo directory's parent (the code's meaning); every doc that
    names it says so: ``$FSDP_FP8_CACHE/cosmos3-demo-<version>``, default ``~/.cache/fsdp_fp8``."""
    from fsdp_fp8.export import cache
    from fsdp_fp8.generation.demo import demo_checkpoint

    monkeypatch.setattr(cache, "build_once", lambda path, build, complete: path)  # the path, nothing built
    monkeypatch.setenv("FSDP_FP8_CACHE", str(tmp_path))
    assert demo_checkpoint().parent == tmp_path and demo_checkpoint().name.startswith("cosmos3-demo-")
    monkeypatch.delenv("FSDP_FP8_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_checkpoint().parent == tmp_path / "home" / ".cache" / "fsdp_fp8"
    said = {}
    for path in DOCS:
        for paragraph in path.read_text().split("\n\n"):
            if "FSDP_FP8_CACHE" in paragraph and "cosmos3-demo" in paragraph:  # where it is explained
                said[path.name] = paragraph
                assert "$FSDP_FP8_CACHE/cosmos3-demo-<version>" in paragraph, (path.name, paragraph)
                assert re.findall(r"default `([^`]*)`", paragraph) == ["~/.cache/fsdp_fp8"], (path.name, paragraph)
    assert {"usage.md", "cosmos3.md"} <= set(said), said


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
    exec(_usage_block("fsdp_fp8.prepare_for_inference(loaded, "), namespace)

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


def test_the_step_by_step_snippets_run_as_written(mot_root, tmp_path):
    """The pieces ``load_model`` composes, the step policy and the save, as usage.md prints them,
    on 2 gloo ranks: both saves hold the source's tensors, byte for byte."""
    import torch
    from ranks import run_ranks

    ckpt = mot_root
    results = run_ranks(_step_by_step_snippets, 2, str(ckpt), str(tmp_path), timeout=240)
    (bytes_read, gathered), saved = results[0]
    source = _files_as_bytes(Path(ckpt))
    assert bytes_read > 0
    for name, got in (("gathered", gathered), ("pieces", saved["pieces"]), ("saved", saved["saved"])):
        assert sorted(got) == sorted(source), name
        assert [k for k in source if not torch.equal(got[k], source[k])] == [], name


# --- every README and usage.md python block, as written, under torchrun at 2 ranks -------------
#
# One torchrun job runs every block in turn (one job, not one per block: a job's start imports
# torch and diffusers on every rank, the larger part of a block's time). Each block is still a
# program of its own: it gets a namespace holding only what its placeholders stand for (below),
# and a store of its own (a fresh port that rank 0 picks and shares through torchrun's store), so
# the process group it makes never meets the previous block's keys. A block that fails on one rank
# ends that rank at once: torchrun then stops the other, which may be waiting in a collective for
# it, and the blocks not yet run report that they did not run. Each rank reports whether the block
# ran, the world size it saw and, for every parameter of the model the block loaded, the rows it
# holds of the rows the model has.

_RUNNER = r"""
import json, os, socket, sys, traceback
import torch, torch.distributed as dist

def _held(model):
    from torch.distributed.tensor import DTensor
    for module in model.modules():  # FSDP2 keeps the root unsharded after a forward
        if hasattr(module, "reshard"):
            module.reshard()
    rows = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        inner = getattr(local, "qdata", local)  # an FP8 weight's codes
        rows.append([name, int(p.shape[0]) if p.dim() else 1, int(inner.shape[0]) if inner.dim() else 1])
    return rows

def _own_store(agent, index, rank):
    # The block's process group gets a store of its own on a port rank 0 finds free.
    if rank == 0:
        with socket.socket() as probe:
            probe.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(f"snippet-port-{index}", str(probe.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent.get(f"snippet-port-{index}").decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"

def _run(block):
    namespace = {}
    exec(block["prologue"], namespace)
    exec(block["code"], namespace)
    loaded = namespace.get("loaded")
    model = getattr(loaded, "model", None) or namespace.get("model")
    pipe = namespace.get("pipe")
    model = pipe.transformer if pipe is not None else model
    return {
        "ok": True,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "held": _held(model) if block["shards"] else None,
    }

blocks, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
rank = int(os.environ["RANK"])
agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
for index, block in enumerate(blocks):
    _own_store(agent, index, rank)
    try:
        seen = _run(block)
    except BaseException:
        seen = {"ok": False, "error": traceback.format_exc()[-4000:]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    json.dump({block["id"]: seen}, open(os.path.join(out_dir, f"rank{rank}-block{index}.json"), "w"))
    if not seen["ok"]:
        os._exit(1)
"""

_GROUP = """
import os, torch, torch.distributed as dist
from fsdp_fp8.load.fsdp_wrap import default_mesh
dist.init_process_group("gloo")
"""
_MODEL = """
from fsdp_fp8.models import MoTConfig, build_model
MyModel = lambda config: build_model(MoTConfig.from_config_dict(config))
"""


def _doc_blocks() -> list[tuple[str, str]]:
    """Every python block of the README and usage.md but the server's client (it needs a server:
    test_serve.py runs it against one)."""
    return [
        (f"{path.name}#{n}", block)
        for path in (ROOT / "README.md", ROOT / "docs" / "usage.md")
        for n, block in enumerate(_python_blocks(path))
        if "openai.OpenAI(" not in block
    ]


def _fill(block_id: str, code: str, ckpt: str, pipeline: str, out: str) -> dict:
    """What each kind of block needs bound, and whether it must shard. A standalone program
    (``load_model`` / ``load_pipeline`` / ``save_checkpoint`` from the top) gets nothing but its
    placeholders: it must shard at 2 ranks as written. A fragment continuing the prose above it
    (the pieces, the step policy, PTQ) gets the state that prose set up."""
    subs = {
        '"/path/to/checkpoint"': repr(ckpt),
        '"/path/to/new"': repr(f"{out}/saved-{block_id}"),
        '"/path/to/Cosmos3-Nano-fp8"': repr(pipeline),
        "num_frames=93": "num_frames=1",
        "height=704": "height=32",
        "width=1280": "width=32",
        "num_inference_steps=35": "num_inference_steps=2",
    }
    if not __import__("torch").cuda.is_available():  # the snippet's own "or gloo on CPU"
        subs['init_process_group("nccl")'] = 'init_process_group("gloo")'
    for old, new in subs.items():
        code = code.replace(old, new)
    if "plan_load(" in code:
        prologue = (
            _GROUP
            + _MODEL
            + (
                f"import fsdp_fp8\npath = {ckpt!r}\nmesh = default_mesh('cpu')\ndevice = torch.device('cpu')\n"
                f"out_dir = {out + '/pieces'!r}\n"
            )
        )
        return {"prologue": prologue, "code": code, "shards": True}
    if "prepare_for_inference(" in code:
        prologue = (
            _GROUP + f"import fsdp_fp8\nloaded = fsdp_fp8.load_model(None, {ckpt!r})\nmodel = loaded.model\nn = 2\n"
        )
        return {"prologue": prologue, "code": code, "shards": True}
    if "quantize_model(" in code:  # one process's own model (runtime PTQ does not shard)
        prologue = (
            "import dataclasses\nfrom fsdp_fp8.models import PRESETS, build_model, init_weights\n"
            "config = dataclasses.replace(PRESETS['tiny'], intermediate_size=96)  # FP8 needs 16-aligned\n"
            "model = init_weights(build_model(config, device='cpu'), seed=0)\n"
        )
        return {"prologue": prologue, "code": code, "shards": False}
    if "load_model(" in code or "load_pipeline(" in code:
        return {"prologue": _MODEL + "import fsdp_fp8\n", "code": code, "shards": True}
    raise AssertionError(f"{block_id}: a python block this test does not know; add its placeholders:\n{code}")


@pytest.fixture(scope="module")
def snippets_under_torchrun(tmp_path_factory, demo_cache, mot_root):
    import json
    import os
    import subprocess
    import sys

    from calibration import bound

    from fsdp_fp8.generation.demo import demo_checkpoint

    tmp = tmp_path_factory.mktemp("snippets")
    ckpt = mot_root
    pipeline = str(demo_checkpoint(demo_cache))  # the run's shared demo, built once
    blocks = [{"id": i, **_fill(i, code, ckpt, pipeline, str(tmp))} for i, code in _doc_blocks()]
    (tmp / "blocks.json").write_text(json.dumps(blocks))
    (tmp / "runner.py").write_text(_RUNNER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FSDP_FP8_CACHE": str(demo_cache)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp / "runner.py"), str(tmp / "blocks.json"), str(tmp)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=bound(150 * len(blocks)))
        tail = proc.stderr[-4000:]
    except subprocess.TimeoutExpired as exc:  # a rank left waiting in a collective
        tail = f"torchrun killed after {exc.timeout:.0f} s"
    seen: list[dict] = [{}, {}]
    for index, block in enumerate(blocks):
        for rank in range(2):
            report = tmp / f"rank{rank}-block{index}.json"
            fallback = {
                "ok": False,
                "error": f"rank {rank} wrote no report for this block (it failed, or one before it did):\n{tail}",
            }
            seen[rank][block["id"]] = json.loads(report.read_text())[block["id"]] if report.exists() else fallback
    return {b["id"]: b for b in blocks}, seen


@pytest.mark.parametrize("block_id", [i for i, _ in _doc_blocks()])
def test_every_doc_snippet_runs_and_shards_under_torchrun_at_2_ranks(snippets_under_torchrun, block_id):
    """Each block ran on both ranks; a block that loads a model saw world size 2 on both ranks,
    and each rank holds its half of every parameter's rows (``torch.chunk``: ceil(rows / 2) on
    rank 0, the rest on rank 1), not a whole copy."""
    blocks, seen = snippets_under_torchrun
    for rank, by_block in enumerate(seen):
        got = by_block[block_id]
        assert got["ok"], f"rank {rank}:\n{got.get('error')}"
        if not blocks[block_id]["shards"]:
            continue
        assert got["world_size"] == 2, f"rank {rank} saw world_size={got['world_size']}: not sharded"
        assert got["held"], block_id
        wrong = [
            (name, rows, held)
            for name, rows, held in got["held"]
            if held != (-(-rows // 2) if rank == 0 else rows - -(-rows // 2))
        ]
        assert wrong == [], f"rank {rank} holds other than its half of: {wrong[:5]}"
