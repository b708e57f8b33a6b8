"""Tower maps: which FP8 linear belongs to which tower of a mixture-of-transformers model.

A step policy switches the generation (denoising) tower step by step and gives the
understanding ("reasoner") tower one precision outright; linears in neither tower (patch
embedders, timestep embedders, output heads) are never switched. A tower map says which is
which, by module name: ``{"layers.0.self_attn.to_q": "reasoner", "proj_in": "other", ...}``.

Maps are derived from a model's module structure (which attribute of which decoder layer a
linear is), never from a list of names per model size, so one rule serves every size of a
class. A map must name every FP8 linear: a linear the map does not know is an error, never
silently "other".
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.load.spec import TowerSpec

GENERATION, REASONER, OTHER = "generation", "reasoner", "other"
TOWERS = (GENERATION, REASONER, OTHER)

TOWERS_HINT = (
    "pass `towers=` to fsdp_fp8.load_model / load_pipeline / install_step_policy: a mapping from each FP8 "
    "linear's module name to 'reasoner', 'generation' or 'other', or a function of the model returning one"
)

# diffusers Cosmos3OmniTransformer (0.42), Cosmos3AttnProcessor: to_q/to_k/to_v read the
# understanding sequence and to_out projects its attention output; add_q_proj/add_k_proj/
# add_v_proj read the generation sequence and to_add_out projects its output. The decoder
# layer runs `mlp` on the understanding sequence and `mlp_moe_gen` on the generation one.
_COSMOS3_ATTENTION = {
    "to_q": REASONER,
    "to_k": REASONER,
    "to_v": REASONER,
    "to_out": REASONER,
    "add_q_proj": GENERATION,
    "add_k_proj": GENERATION,
    "add_v_proj": GENERATION,
    "to_add_out": GENERATION,
}
_COSMOS3_MLP = {"mlp": REASONER, "mlp_moe_gen": GENERATION}


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Float8StaticLinear))


def cosmos3_towers(model: nn.Module) -> dict[str, str]:
    """The tower map of a diffusers ``Cosmos3OmniTransformer`` (plain, swapped or sharded).

    Each ``layers[i]`` is a ``Cosmos3VLTextMoTDecoderLayer``: its attention projections and
    its two MLPs are assigned as above; every other linear of the model (``proj_in``,
    ``proj_out``, ``time_embedder.*``, ``lm_head``, audio / action projections) is "other".
    A linear inside a decoder layer that this rule does not place raises ``ValueError``: a
    later diffusers that adds one must be looked at, not guessed.
    """
    towers: dict[str, str] = {}
    placed: set[int] = set()
    strays: list[str] = []
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ArgumentError(f"{type(model).__name__} has no `layers` ModuleList: not a Cosmos3OmniTransformer")
    for i, layer in enumerate(layers):
        prefix = f"layers.{i}"
        attn = getattr(layer, "self_attn", None)
        for attr, tower in _COSMOS3_ATTENTION.items():
            module = getattr(attn, attr, None)
            if module is not None and _is_linear(module):
                towers[f"{prefix}.self_attn.{attr}"] = tower
                placed.add(id(module))
        for attr, tower in _COSMOS3_MLP.items():
            mlp = getattr(layer, attr, None)
            if mlp is None:
                continue
            for name, module in mlp.named_modules():
                if _is_linear(module):
                    towers[f"{prefix}.{attr}.{name}"] = tower
                    placed.add(id(module))
        strays += [
            f"{prefix}.{name}"
            for name, module in layer.named_modules()
            if _is_linear(module) and id(module) not in placed
        ]
    if strays:
        raise ArgumentError(f"linears inside Cosmos 3 decoder layers with no known tower: {sorted(strays)}")
    for name, module in model.named_modules():
        if _is_linear(module) and id(module) not in placed:
            towers[name] = OTHER
    return towers


def needs_towers(policy) -> bool:
    """Whether ``policy`` (a StepPolicy or None) runs the two towers differently at some step.

    Only then does a model need a tower map; otherwise every FP8 linear takes the same
    precision at every step and one tower is exact.
    """
    if policy is None:
        return False
    windows = policy.first_count > 0 or policy.last_count > 0
    return policy.reasoner == "a16" or windows


def resolve_towers(spec: TowerSpec | None, model: nn.Module) -> dict[str, str] | None:
    """A ``towers=`` (a mapping, or a function of the model returning one, or ``None`` when it
    knows none) as a dict; ``None`` when there is no map."""
    if spec is None:
        return None
    towers = spec(model) if callable(spec) else spec
    if towers is None:
        return None
    if not isinstance(towers, Mapping):
        raise ArgumentError(f"`towers` must map linear names to {list(TOWERS)}, got {type(towers).__name__}")
    return dict(towers)


def tower_problems(towers: Mapping[str, str], fp8_linears: list[str], source: str = "towers") -> list[str]:
    """What is wrong with ``towers`` for a model whose FP8 linears are ``fp8_linears``."""
    problems = [
        f"`{name}` in {source} is {tower!r}, not one of {list(TOWERS)}"
        for name, tower in sorted(towers.items())
        if tower not in TOWERS
    ]
    problems += [
        f"FP8 linear `{name}` is in no tower of {source}; map it to one of {list(TOWERS)}"
        for name in sorted(set(fp8_linears) - set(towers))
    ]
    return problems


def tower_map_problems(
    towers: Mapping[str, str] | None, fp8_linears: list[str], policy, model_name: str, source: str
) -> list[str]:
    """The one check of a tower map against a model's FP8 linears and a step policy (``policy``: a
    ``StepPolicy`` or ``None``): every linear in a known tower; and a policy that runs the towers
    differently (``needs_towers``) needs a map (fail-closed)."""
    if towers is not None:
        return tower_problems(towers, fp8_linears, "the tower map")
    if needs_towers(policy):
        return [
            f"{source}: the step policy's `reasoner` ({policy.reasoner!r}) differs from its steps, but "
            f"{model_name} has no known tower map, so fsdp_fp8 cannot tell the reasoner's linears from the "
            f"generation tower's; {TOWERS_HINT}"
        ]
    return []
