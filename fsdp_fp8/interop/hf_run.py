"""Run a loaded Hugging Face model once, deterministically, and digest what it produced.

A causal LM generates greedily from token ids; a diffusers transformer runs one forward on
seeded inputs. Each call goes through the model itself, never a submodule: FSDP2's root
parameters (embeddings, final norm, head) are all-gathered by the root's own pre-forward.
No KV cache: every step re-runs the whole sequence, which is exact and simple, and HF
``generate`` adds nothing a few tokens need. The digests are SHA-256 of float32 bytes, so
equal digests at different world sizes mean bit-identical outputs.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError, CheckpointError, raise_if_problems
from fsdp_fp8.format.remote_code import remote_code_references, safe_pretrained_kwargs

log = logging.getLogger(__name__)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], str]:
    """Greedy decoding; returns (generated ids, SHA-256 of every step's full logits)."""
    device = next(model.parameters()).device
    ids = prompt.to(device)
    digest = hashlib.sha256()
    generated: list[int] = []
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits
        digest.update(_bytes(logits))
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        generated.append(int(nxt[0, 0]))
        ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
    return generated, digest.hexdigest()


def _flux_inputs(config, dtype: torch.dtype, g: torch.Generator) -> dict:
    side, text = 4, 8  # a 4x4 latent grid of packed tokens, 8 text tokens
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    inputs = {
        "hidden_states": torch.randn(1, side * side, config.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, text, config.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5])
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"):
        if key in inputs:
            inputs[key] = inputs[key].to(dtype)
    return inputs


def _cosmos3_inputs(config, dtype: torch.dtype, g: torch.Generator) -> dict:
    from fsdp_fp8.interop.cosmos import seeded_inputs

    return seeded_inputs(config, dtype, g)


# Seeded-input recipes by diffusers class name; the launcher runs only these.
INPUT_RECIPES = {"FluxTransformer2DModel": _flux_inputs, "Cosmos3OmniTransformer": _cosmos3_inputs}
# Classes the launcher denoises (a whole loop, step policy applied) rather than runs once.
DENOISERS = ("Cosmos3OmniTransformer",)


def diffusers_inputs(model: nn.Module, seed: int = 0, dtype: torch.dtype | None = None) -> dict:
    """Seeded forward kwargs for a diffusers transformer of a class in ``INPUT_RECIPES``."""
    # By MRO: fully_shard swaps the class for a generated FSDP<name> subclass.
    name = next((c.__name__ for c in type(model).__mro__ if c.__name__ in INPUT_RECIPES), None)
    if name is None:
        raise ArgumentError(
            f"no seeded-input recipe for diffusers class {type(model).__name__!r}; the launcher "
            f"runs {sorted(INPUT_RECIPES)} (load any class from Python with fsdp_fp8.load_model)",
            "launcher run",
        )
    dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
    return INPUT_RECIPES[name](model.config, dtype, torch.Generator().manual_seed(seed))


@torch.no_grad()
def diffusers_forward(model: nn.Module, seed: int, dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], str]:
    """One forward on seeded inputs; returns (output shape, SHA-256 of the output)."""
    device = next(model.parameters()).device
    inputs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in diffusers_inputs(model, seed, dtype).items()
    }
    out = model(**inputs)[0]
    return tuple(out.shape), hashlib.sha256(_bytes(out)).hexdigest()


def prompt_token_ids(text: str, ids: list[int] | None, vocab_size: int, directory) -> tuple[torch.Tensor, str]:
    """(1, n) prompt ids and where they came from: explicit ids, a tokenizer stored in the
    checkpoint directory (never downloaded), or the UTF-8 bytes of ``text`` folded into the vocab."""
    from pathlib import Path

    if ids:
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ArgumentError(f"--prompt-ids {bad} are outside the vocabulary [0, {vocab_size})", "launcher run")
        return torch.tensor([ids], dtype=torch.long), "--prompt-ids"
    if any((Path(directory) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return torch.tensor([_tokenizer(directory)(text)["input_ids"]], dtype=torch.long), "tokenizer"
    return prompt_bytes(text, vocab_size), "prompt bytes mod vocab"


def _tokenizer(directory):
    """The checkpoint's own tokenizer, loaded without ever running code shipped with it.

    A ``tokenizer_config.json`` ``auto_map`` is reported and ignored: transformers is told
    never to trust remote code (so it never prompts either). A tokenizer that exists only as
    such code is refused, naming the file and the key.
    """
    from transformers import AutoTokenizer

    references, problems = remote_code_references(directory, subfolders=False)
    raise_if_problems(problems, f"tokenizer in {directory}")
    for reference in references:
        log.warning("%s; fsdp_fp8 never runs it (ignored)", reference)
    try:
        return AutoTokenizer.from_pretrained(str(directory), **safe_pretrained_kwargs())
    except ValueError as exc:
        if not references:
            raise
        raise CheckpointError(
            [
                f"{r}, and the tokenizer cannot be loaded without it; pass --prompt-ids instead "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
                for r in references
            ],
            f"tokenizer in {directory}",
        ) from exc


def prompt_bytes(text: str, vocab_size: int) -> torch.Tensor:
    """No tokenizer download: the prompt's UTF-8 bytes folded into the vocabulary, (1, n)."""
    data = text.encode("utf-8") or b" "
    return torch.tensor([[b % vocab_size for b in data]], dtype=torch.long)


def run_hf(
    model: nn.Module,
    spec,
    directory,
    *,
    prompt: str,
    negative_prompt: str | None = None,
    prompt_ids: tuple[int, ...] | None = None,
    new_tokens: int = 8,
    seed: int = 0,
    steps: int = 20,
    guidance: float = 3.0,
) -> dict:
    """The launcher's run of a transformers / diffusers model (``spec``: its ``ModelSpec``), from
    plain values: a causal LM reads the prompt (or ``prompt_ids``) and ``new_tokens``; a Cosmos 3
    transformer alone the prompts, ``steps``, ``seed`` and ``guidance``; any other diffusers
    model ``seed``."""
    kind = spec.kind
    if kind == "causal_lm":
        ids, source = prompt_token_ids(prompt, list(prompt_ids or ()), model.config.vocab_size, directory)
        generated, digest = greedy_generate(model, ids, new_tokens)
        return {
            "prompt_ids": ids[0].tolist(),
            "prompt_source": source,
            "generated_ids": generated,
            "logits_sha256": digest,
        }
    if kind == "diffusers" and spec.name in DENOISERS:
        return cosmos3_loop(model, directory, prompt, negative_prompt, steps=steps, seed=seed, guidance=guidance)
    if kind == "diffusers":
        shape, digest = diffusers_forward(model, seed, spec.dtype)
        return {"output_shape": list(shape), "output_sha256": digest}
    raise ArgumentError(
        f"the launcher runs causal LMs and diffusers transformers, not {type(model).__name__} "
        "(load it from Python with fsdp_fp8.load_model)",
        "launcher run",
    )


def cosmos3_loop(
    model: nn.Module, directory, prompt: str, negative_prompt: str | None, *, steps: int, seed: int, guidance: float
) -> dict:
    """A Cosmos 3 transformer alone: ``steps`` denoising steps on seeded latents, with
    guidance, the step policy applied per step (``fsdp_fp8.interop.cosmos.denoise``)."""
    from fsdp_fp8.format.step_policy import describe_trace
    from fsdp_fp8.interop.cosmos import denoise, latent_shape
    from fsdp_fp8.runtime.precision import denoising_step, routing_of

    vocab = model.config.vocab_size
    cond, source = prompt_token_ids(prompt, None, vocab, directory)
    uncond, _ = prompt_token_ids(negative_prompt or "", None, vocab, directory)
    routing = routing_of(model)
    start = len(routing.trace)
    latent = denoise(
        model,
        cond[0],
        uncond[0],
        steps=steps,
        seed=seed,
        guidance=guidance,
        shape=latent_shape(model.config),
        step_context=lambda i, n: denoising_step(model, i, n),
    )
    return {
        "prompt_source": source,
        "steps": steps,
        "precision_trace": describe_trace(routing.trace[start:]),
        "latent_shape": list(latent.shape),
        "latent_sha256": hashlib.sha256(_bytes(latent)).hexdigest(),
    }
