"""A load's settings as one frozen, self-checked value (``LoadOptions``), built once by the CLI from
its arguments or by a Python caller, and handed down unchanged to every step of the load
(TorchAO's ``Float8LinearConfig`` pattern). ``load_model(..., strict=False)`` and friends are a
convenience that builds one (``load_options``); nothing below reads a module global at call time.

The device a load goes to by default is this one's: torchrun's ``LOCAL_RANK`` modulo the GPUs
this process sees, or the CPU (``default_device``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_fp8.collective import DEFAULT_TIMEOUT_S
from fsdp_fp8.errors import ArgumentError, ArgumentTypeError
from fsdp_fp8.format.timeouts import timeout_problems
from fsdp_fp8.fp8.kernels import DEFAULT_KERNELS, KernelOptions
from fsdp_fp8.reading.read_options import DEFAULT_READ_OPTIONS, ReadOptions


def local_cuda_index() -> int:
    """This process's GPU: torchrun's ``LOCAL_RANK`` modulo the GPUs this process sees.

    A launcher that hands each rank its own ``CUDA_VISIBLE_DEVICES`` leaves one visible GPU
    per process while ``LOCAL_RANK`` still counts the node's ranks: the modulo maps rank 3 to
    its one GPU (index 0) instead of asking for a ``cuda:3`` that does not exist.
    """
    return int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


@dataclass(frozen=True, eq=False)
class LoadOptions:
    """How one load runs; every step of it reads this one value.

    - ``device``: where the model goes (``None``: ``default_device()``, resolved when built).
    - ``mesh``: what ``fully_shard`` shards over (``None``: a 1-D mesh over every rank; a 2-D
      ``(replicate, shard)`` mesh is HSDP, ``fsdp_fp8.load.fsdp_wrap.device_mesh``).
    - ``strict``: every model tensor in the checkpoint and every checkpoint tensor in the model;
      ``strict_kv_scales``: refuse FP8 KV-cache scales the model has no place for (else a warning).
    - ``timeout_s``: how long a rank waits for its peers in each agreement (the one after the
      reads adds the time the slowest rank's bytes take, ``collective.outcome_timeout_s``).
    - ``read_options``: the reads' threads, request size, staging and prefetch budgets.
    - ``mp_policy``, ``offload_policy``, ``reshard_after_forward``: FSDP2's ``fully_shard``
      options (``None`` / ``True``: FSDP2's defaults).
    - ``kernels``: the FP8 linears' kernel variants (``KernelOptions``), fixed at the swap.
    """

    device: torch.device | None = None
    mesh: DeviceMesh | None = None
    strict: bool = True
    strict_kv_scales: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    read_options: ReadOptions = DEFAULT_READ_OPTIONS
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    reshard_after_forward: bool | int = True
    kernels: KernelOptions = DEFAULT_KERNELS

    def __post_init__(self) -> None:
        problems = []
        device = self.device
        if device is None:
            device = default_device()
        elif isinstance(device, str | torch.device):
            try:
                device = torch.device(device)
            except RuntimeError as exc:
                problems.append(f"`device` is {self.device!r}: {exc}")
        else:
            problems.append(f"`device` is a {type(device).__name__}; give a torch.device or a string like 'cuda:0'")
        problems += _type_problems(self)
        problems += timeout_problems(self.timeout_s, "`timeout_s`")
        if problems:
            raise ArgumentError(problems, "LoadOptions")
        object.__setattr__(self, "device", device)

    def replace(self, **changes) -> LoadOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def on_host(self) -> bool:
        """Sharded parameters live in host memory (``CPUOffloadPolicy``, with a process group)."""
        return isinstance(self.offload_policy, CPUOffloadPolicy) and dist.is_initialized()

    @property
    def storage_device(self) -> torch.device:
        """Where the parameters are materialized and read into: host memory under CPU offload."""
        return torch.device("cpu") if self.on_host else self.device

    def fsdp_options(self) -> dict:
        """The ``fully_shard`` options that differ from FSDP2's defaults, by name."""
        options = {}
        if self.mp_policy is not None:
            options["mp_policy"] = self.mp_policy
        if self.offload_policy is not None:
            options["offload_policy"] = self.offload_policy
        if self.reshard_after_forward is not True:
            options["reshard_after_forward"] = self.reshard_after_forward
        return options


_TYPES = {
    "mesh": (DeviceMesh, type(None)),
    "strict": (bool,),
    "strict_kv_scales": (bool,),
    "read_options": (ReadOptions,),
    "mp_policy": (MixedPrecisionPolicy, type(None)),
    "offload_policy": (OffloadPolicy, type(None)),
    "reshard_after_forward": (bool, int),
    "kernels": (KernelOptions,),
}


def _type_problems(options: LoadOptions) -> list[str]:
    return [
        f"`{name}` is a {type(getattr(options, name)).__name__}, not {' or '.join(t.__name__ for t in types)}"
        for name, types in _TYPES.items()
        if not isinstance(getattr(options, name), types)
    ]


SETTINGS = tuple(f.name for f in dataclasses.fields(LoadOptions))


def load_options(options: LoadOptions | None = None, **settings) -> LoadOptions:
    """``options`` (default: ``LoadOptions()``) with the keyword ``settings`` applied: the
    convenience behind ``load_model(..., strict=False)``. An unknown name is a ``TypeError``
    naming the known ones; settings given with ``None`` keep the value."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ArgumentTypeError(f"unknown load setting(s) {', '.join(unknown)}; the settings are {', '.join(SETTINGS)}")
    given = {name: value for name, value in settings.items() if value is not None}
    if options is None:
        return LoadOptions(**given)
    return options.replace(**given) if given else options
