"""No code from a checkpoint directory ever runs: the kwargs every Hugging Face loader gets, the
report of what asks for custom code, and the launcher's tokenizer, with a real transformers
tokenizer whose ``tokenizer_config.json`` names a Python file of its own (``auto_map``).

The custom module writes a marker file when imported; ``input`` is replaced so that a prompt
(what transformers does when ``trust_remote_code`` is left unset) answers "y" and is recorded.
"""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from fsdp_fp8.format.remote_code import SAFE_PRETRAINED_KWARGS, remote_code_references, safe_pretrained_kwargs

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _tokenizer_dir(root: Path, custom_class: bool) -> tuple[Path, Path]:
    """A word-level tokenizer saved by transformers, then given an ``auto_map`` to ``evil.py``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory, marker = root / "ckpt", root / "custom-code-ran"
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "red": 2, "fox": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    if custom_class:  # a class transformers does not have: only the shipped code could provide it
        config["tokenizer_class"] = "EvilTokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return directory, marker


@pytest.fixture
def prompts(monkeypatch):
    asked = []

    def answer_yes(prompt=""):
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", answer_yes)
    return asked


def test_the_safe_kwargs_never_trust_never_download_and_cannot_be_overridden():
    assert SAFE_PRETRAINED_KWARGS == {"trust_remote_code": False, "local_files_only": True}
    assert safe_pretrained_kwargs(subfolder="transformer") == {"subfolder": "transformer", **SAFE_PRETRAINED_KWARGS}
    for bad in ({"trust_remote_code": True}, {"custom_pipeline": "x"}):
        with pytest.raises(ValueError, match="never runs code from a checkpoint"):
            safe_pretrained_kwargs(**bad)


def test_auto_map_and_custom_pipeline_components_are_reported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "m.M"}}))
    (tmp_path / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "Cosmos3OmniPipeline",
                "transformer": ["diffusers", "Cosmos3OmniTransformer"],
                "tokenizer": ["transformers", "AutoTokenizer"],
                "scheduler": [None, None],
                "extra": ["my_module", "Mine"],
            }
        )
    )
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "enc.E"}}))
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text("{broken")
    found, problems = remote_code_references(tmp_path)
    assert found == [
        "config.json: `auto_map` names custom code {'AutoModel': 'm.M'}",
        "model_index.json: `extra` comes from module 'my_module', custom code inside the checkpoint",
        "text_encoder/config.json: `auto_map` names custom code {'AutoModel': 'enc.E'}",
    ]
    assert len(problems) == 1 and problems[0].startswith("vae/config.json is not valid JSON")


def test_transformers_with_the_safe_kwargs_neither_prompts_nor_runs_the_code(tmp_path, prompts):
    from transformers import AutoTokenizer

    directory, marker = _tokenizer_dir(tmp_path, custom_class=True)
    with pytest.raises(ValueError, match="contains custom code"):
        AutoTokenizer.from_pretrained(str(directory), **safe_pretrained_kwargs())
    assert prompts == [] and not marker.exists()


def test_the_launcher_tokenizer_refuses_one_that_only_checkpoint_code_provides(tmp_path, prompts):
    from fsdp_fp8.errors import CheckpointError
    from fsdp_fp8.interop.hf_run import prompt_token_ids

    directory, marker = _tokenizer_dir(tmp_path, custom_class=True)
    with pytest.raises(CheckpointError) as info:
        prompt_token_ids("a red fox", None, 10, directory)
    (problem,) = info.value.problems
    assert problem.startswith("tokenizer_config.json: `auto_map` names custom code") and "--prompt-ids" in problem
    assert prompts == [] and not marker.exists()


def test_the_launcher_tokenizer_reports_and_ignores_an_auto_map_it_does_not_need(tmp_path, prompts, caplog):
    from fsdp_fp8.interop.hf_run import prompt_token_ids

    directory, marker = _tokenizer_dir(tmp_path, custom_class=False)
    with caplog.at_level("WARNING"):
        ids, source = prompt_token_ids("a red fox", None, 10, directory)
    assert ids.tolist() == [[1, 2, 3]] and source == "tokenizer"
    assert any(
        "`auto_map` names custom code" in r.getMessage() and "never runs it" in r.getMessage() for r in caplog.records
    )
    assert prompts == [] and not marker.exists()
