"""``load_pipeline``: a diffusers pipeline whose transformer fsdp_fp8 loaded, sharded, with its step policy.

    pipeline root (model_index.json)
      transformer/   -> fsdp_fp8.load_model: meta build, FP8 swap, fully_shard, rank-slice reads
      vae/, scheduler/, text_tokenizer/, ...  -> diffusers / transformers from_pretrained, same directory

Every component but the transformer is loaded by diffusers itself, from local files only
(``fsdp_fp8.format.remote_code``: ``local_files_only=True``, ``trust_remote_code=False``); nothing is downloaded and no code
from the checkpoint runs. ModelOpt is not needed.

The step policy runs once per scheduler step through a hook the pipeline already drives:
diffusers pipelines call every transformer pass inside ``transformer.cache_context(name,
step_index=i, num_inference_steps=n, ...)`` (``Cosmos3OmniPipeline``: ``"cond"``, then
``"uncond"`` under classifier-free guidance). fsdp_fp8 wraps that context manager on the
loaded transformer (its class is swapped for a subclass whose ``cache_context`` runs the
hook, as ``fully_shard`` itself swaps the class; the hook is kept in
``collective.attached.STEP_HOOK``, no attribute is set on the instance): on entry it sets the generation tower to the policy's precision for
``(i, n)``, on exit it returns it to W8A8. The precision is a pure function of ``(i, n)``, so
both guidance passes of one step agree; the trace records each step once. A transformer
forward outside such a context while a policy is installed is refused (the policy could
not be applied), never run silently at the wrong precision.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_fp8.collective.attached import LOADED, STEP_HOOK
from fsdp_fp8.format.hub import resolve_hub_path
from fsdp_fp8.format.read_options import DEFAULT_READ_OPTIONS, ReadOptions
from fsdp_fp8.format.remote_code import remote_code_references, safe_pretrained_kwargs
from fsdp_fp8.format.step_policy import resolve_step_policy
from fsdp_fp8.fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.interop.cfg_parallel import enable_cfg_parallel, pair_of
from fsdp_fp8.interop.load import load_model
from fsdp_fp8.load.api import LoadedModel, default_device
from fsdp_fp8.runtime.precision import PrecisionRouting, install_step_policy, set_step_precision
from fsdp_fp8.runtime.towers import TowerSpec

MODEL_INDEX = "model_index.json"
TRANSFORMER = "transformer"
log = logging.getLogger(__name__)


def _read_index(root: Path) -> dict:
    index_path = root / MODEL_INDEX
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{root} has no {MODEL_INDEX}: not a diffusers pipeline root "
            "(load a transformer directory alone with fsdp_fp8.load_model)"
        )
    try:
        index = json.loads(index_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{index_path}: not valid JSON ({exc})") from None
    problems = []
    if not isinstance(index.get("_class_name"), str):
        problems.append(f"`_class_name` is {index.get('_class_name')!r}, not a pipeline class name")
    entry = index.get(TRANSFORMER)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
        problems.append(f"`{TRANSFORMER}` is {entry!r}, not a diffusers model entry")
    elif not (root / TRANSFORMER / "config.json").is_file():
        problems.append(f"`{TRANSFORMER}` is listed but {root / TRANSFORMER / 'config.json'} does not exist")
    references, unreadable = remote_code_references(root)
    problems += unreadable
    for ref in references:
        if ref.startswith("model_index.json"):  # a component diffusers would import from the checkpoint
            problems.append(ref)
        else:  # an `auto_map` transformers ignores under trust_remote_code=False
            log.warning("%s: %s; ignored (fsdp_fp8 never runs code from a checkpoint)", root, ref)
    if problems:
        raise ValueError(f"{index_path}:\n" + "\n".join(f"  - {p}" for p in problems))
    return index


def _pipeline_class(name: str, source: Path):
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise ValueError(f"{source}: `_class_name` {name!r} is not a pipeline of diffusers {diffusers.__version__}")
    return cls


class StepHook:
    """The transformer's ``cache_context``, wrapped to switch precision per pipeline step.

    Holds no reference to the transformer (it is kept in ``STEP_HOOK``, keyed weakly by it):
    the method it wraps comes with each call.
    """

    def __init__(self, routing: PrecisionRouting):
        self.routing = routing
        self._step: tuple[int, int] | None = None
        self._passes: set[str] = set()

    @contextlib.contextmanager
    def __call__(self, inner, name: str, **kwargs):
        """``inner(name, **kwargs)`` (diffusers' own ``cache_context``) at the step's precision."""
        step, steps = kwargs.get("step_index"), kwargs.get("num_inference_steps")
        if not (isinstance(step, int) and isinstance(steps, int)):
            raise RuntimeError(
                f"the pipeline entered transformer.cache_context({name!r}) without `step_index` and "
                "`num_inference_steps`; fsdp_fp8 cannot tell which denoising step runs, so it cannot apply "
                "the checkpoint's step policy (load with step_policy='off' to run every step W8A8)"
            )
        # A new step begins at a new (i, n), or when a pass name repeats (the next request).
        new_step = (step, steps) != self._step or name in self._passes
        if new_step:
            self._step, self._passes = (step, steps), set()
        self._passes.add(name)
        with inner(name, **kwargs), set_step_precision(self.routing, step, steps, record=new_step):
            yield

    def check_forward(self, _module, _args, _kwargs) -> None:
        if self.routing.active == 0:
            raise RuntimeError(
                "the transformer ran outside a denoising step (transformer.cache_context with step_index): "
                "its step policy cannot be applied; call it inside fsdp_fp8.denoising_step(model, i, n)"
            )


_STEPPED: dict[type, type] = {}  # a transformer class -> its subclass with the step hook


def stepped_class(cls: type) -> type:
    """``cls`` with a ``cache_context`` that runs the instance's ``StepHook`` around diffusers' own.

    A subclass rather than an instance attribute: an attribute named ``cache_context`` would
    shadow diffusers' method on the instance and travel with copies; the class keeps the
    method where diffusers' loop looks it up (``self.transformer.cache_context(...)``) and the
    hook itself stays in ``STEP_HOOK``. One subclass per class, made once.
    """
    if cls not in _STEPPED:

        class Stepped(cls):
            def cache_context(self, name, **kwargs):
                hook = STEP_HOOK.get(self)
                if hook is None:  # a copy of a loaded transformer: its hook stayed with the original
                    raise RuntimeError(
                        f"this {cls.__name__} has no fsdp_fp8 step hook (only the transformer "
                        "load_pipeline returned has one; a copy does not)"
                    )
                return hook(super().cache_context, name, **kwargs)

        Stepped.__name__ = Stepped.__qualname__ = f"Stepped{cls.__name__}"
        _STEPPED[cls] = Stepped
    return _STEPPED[cls]


def loaded_of(pipe) -> LoadedModel:
    """The ``LoadedModel`` of ``pipe``'s transformer (``pipe`` from ``load_pipeline``): the
    checkpoint, the load plan and report, the FP8 linears, the tower map."""
    loaded = LOADED.get(pipe)
    if loaded is None:
        raise ValueError(f"this {type(pipe).__name__} was not loaded by fsdp_fp8.load_pipeline")
    return loaded


def load_pipeline(
    path: str | os.PathLike,
    mesh: DeviceMesh | None = None,
    *,
    device: torch.device | None = None,
    step_policy: str | dict = "auto",
    towers: TowerSpec | None = None,
    read_options: ReadOptions = DEFAULT_READ_OPTIONS,
    cfg_parallel: bool = False,
    **components,
):
    """The diffusers pipeline at ``path`` (a directory with ``model_index.json``, or a hub name
    resolved through the local cache only, ``fsdp_fp8.format.hub``), its
    transformer loaded by fsdp_fp8 and sharded over ``mesh`` (default: every rank).

    ``step_policy``: ``"auto"`` (the checkpoint's), ``"off"`` (every step W8A8) or a policy
    dict. ``towers`` overrides the tower map (``fsdp_fp8.runtime.towers``); ``read_options`` goes to
    ``load_model`` (the reads' threads, request size, staging and prefetch budgets). Other keyword
    arguments go to the pipeline's ``from_pretrained`` (e.g. ``safety_checker=None``); a
    ``transformer``, ``trust_remote_code`` or ``custom_pipeline`` is refused, and
    ``local_files_only`` is always set. Collective under a process group, like ``load_model``.
    ``fsdp_fp8.loaded_of(pipe)`` is the ``LoadedModel`` and ``fsdp_fp8.routing_of(pipe.transformer)``
    the routing (its ``trace``: one precision per step run, ``"W8A16"`` or ``"W8A8"``;
    ``summary()``: ``"W8A16 x3 / W8A8 x14 / W8A16 x3"``).

    ``cfg_parallel``: ranks in pairs run the two guidance passes of each step at once
    (``fsdp_fp8.interop.cfg_parallel``); both ranks of a pair must then be given the same
    request. Needs an even number of ranks.
    """
    root = resolve_hub_path(path)  # a directory, or a hub name through the local cache only
    index = _read_index(root)
    cls = _pipeline_class(index["_class_name"], root / MODEL_INDEX)
    if "transformer" in components:
        raise ValueError("load_pipeline loads the `transformer` itself; do not pass one")
    kwargs = safe_pretrained_kwargs(**components)  # refuses trust_remote_code / custom_pipeline
    if cfg_parallel:  # before the first collective: every rank sees the same world size
        pair_of(dist.get_rank() if dist.is_initialized() else 0, dist.get_world_size() if dist.is_initialized() else 1)
    device = device or default_device()
    loaded: LoadedModel = load_model(
        None, root / TRANSFORMER, mesh, device=device, towers=towers, read_options=read_options
    )
    model = loaded.model
    policy = resolve_step_policy(
        loaded.checkpoint.quant.step_policy, step_policy, str(root / TRANSFORMER / "config.json")
    )
    routing = install_step_policy(model, policy, loaded.towers)
    share_quantized_inputs(model)
    pipe = cls.from_pretrained(str(root), transformer=model, **kwargs)
    for name, component in pipe.components.items():
        if name != TRANSFORMER and isinstance(component, nn.Module):
            component.to(device)
    hook = StepHook(routing)
    STEP_HOOK.set(model, hook)
    model.__class__ = stepped_class(type(model))
    if policy is not None:
        # Prepended: refuse before FSDP's own pre-forward all-gathers anything.
        model.register_forward_pre_hook(hook.check_forward, with_kwargs=True, prepend=True)
    if cfg_parallel:
        enable_cfg_parallel(model)
    LOADED.set(pipe, loaded)
    return pipe
