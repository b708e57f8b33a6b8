"""What the pipeline tests share: the real ModelOpt Cosmos 3 fixture and the step policy it is
given, the small sizes the tests generate at, the character tokenizer that fits the fixture's
64-token vocabulary, a pipeline root of the fixture beside the demo's VAE, and a latent's digest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from fsdp_fp8.testing.wan22_vae import wan22_config

FIXTURES = Path(__file__).parent / "fixtures"
COSMOS3_FIXTURE = FIXTURES / "modelopt-0.47-cosmos3-transformer"
ACTION_FIXTURE = FIXTURES / "modelopt-0.47-cosmos3-action-transformer"
DISTILLED_FIXTURE = FIXTURES / "modelopt-0.47-cosmos3-distilled-transformer"
# (tile min height, width, stride height, width) in pixels: 4-latent tiles, 3-latent strides, of
# the demo's VAE and of a small Wan 2.2 VAE (WAN22_CONFIG: its 48 latent channels, patch 2)
DEMO_TILES, WAN22_TILES = (16, 16, 12, 12), (64, 64, 48, 48)
WAN22_CONFIG = wan22_config(8, 8, 1, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
PIPE_SIZE = {"num_frames": 1, "height": 32, "width": 32}
LAUNCH_SIZE = ("--frames", "1", "--height", "32", "--width", "32")  # the launcher's PIPE_SIZE


def digest(t: torch.Tensor) -> str:
    """The sha256 of a tensor's values as float32 (what the tests compare across world sizes)."""
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def with_policy(src: Path, dst: Path, policy: dict | None = None) -> Path:
    """A copy of the transformer at ``src`` at ``dst`` whose config carries ``policy`` (default:
    the published step policy), as the official builds do; ModelOpt writes none."""
    from fsdp_fp8.format.step_policy import PUBLISHED_POLICY

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["runtime"] = {"diffusion_step_policy": policy or PUBLISHED_POLICY}
    (dst / "config.json").write_text(json.dumps(config, indent=4))
    return dst


def small_tokenizer():
    """Characters a-z, space and a few marks, the chat and vision specials, '?' for the rest."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from fsdp_fp8.generation.demo import CHAT_TEMPLATE, SPECIAL_TOKENS

    chars = ["?"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" \n,.:")
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="?"))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def pipeline_beside_the_demo(demo_root, root: Path, transformer: Path = COSMOS3_FIXTURE, policy: bool = True) -> str:
    """A pipeline at ``root``: ``transformer`` (a real ModelOpt export, given the step policy
    unless ``policy`` is False, as a distilled root has none) beside the demo root's other
    components (the action or distilled demo's as well), with the small text tokenizer above."""
    shutil.copytree(demo_root, root, ignore=shutil.ignore_patterns("transformer", "text_tokenizer"))
    if policy:
        with_policy(transformer, root / "transformer")
    else:
        shutil.copytree(transformer, root / "transformer")
    small_tokenizer().save_pretrained(root / "text_tokenizer")
    return str(root)
