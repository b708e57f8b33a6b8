"""The attention backend of a pipeline's transformer: one of diffusers' registry names
(``diffusers.models.attention_dispatch.AttentionBackendName``), checked before the load.

Our attention processors (diffusers' ``Cosmos3AttnProcessor``, and the Ulysses one, which takes
the backend its predecessor had: ``interop.ulysses``) call ``dispatch_attention_fn``
with the processor's ``_attention_backend``, which ``use_backend`` sets on the model's processors. A
backend is usable here when diffusers' own requirement check passes (its package is installed)
and one small attention call shaped as the processors make it (bf16, grouped-query, causal and
not) runs on the device: a kernel that is installed but cannot run on this device (flash on a
CPU) is refused too. Backends whose kernel diffusers downloads from the Hub (``*_hub``) are never
usable: fsdp_fp8 downloads nothing.
"""

from __future__ import annotations

import warnings

import torch

from fsdp_fp8.errors import ArgumentError

DEFAULT_BACKEND = "native"


def backend_names() -> tuple[str, ...]:
    """Every name of diffusers' attention backend registry."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return tuple(b.value for b in AttentionBackendName)


def _probe(name: str, device: torch.device) -> None:
    """One grouped-query attention call through ``name``, causal and not, as the processors make."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q = torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16, device=device)
    with warnings.catch_warnings():  # a backend's notices about itself (flex: compile advice)
        warnings.simplefilter("ignore")
        for causal in (True, False):
            dispatch_attention_fn(q, kv, kv, is_causal=causal, enable_gqa=True, backend=name)


def unusable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run here (one line), or None."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    if name.endswith("_hub"):
        return "its kernel is downloaded from the Hugging Face Hub, and fsdp_fp8 downloads nothing"
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
        _probe(name, device)
    except Exception as exc:  # noqa: BLE001 - the kernel's own refusal, in one line
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'}"
    return None


def usable_backends(device: torch.device) -> list[str]:
    return [name for name in backend_names() if unusable_reason(name, device) is None]


def backend_problems(name: str, device: torch.device) -> list[str]:
    """Why ``name`` is no attention backend this device can use, listing those it can."""
    names = backend_names()
    if name not in names:
        return [f"attention backend {name!r} is not one of diffusers' ({', '.join(names)})"]
    reason = unusable_reason(name, device)
    if reason is None:
        return []
    usable = ", ".join(usable_backends(device))
    return [f"attention backend {name!r} cannot run on {device.type} here ({reason}); usable here: {usable}"]


def use_backend(model, name: str) -> None:
    """Every attention processor of ``model`` calls backend ``name``: its ``_attention_backend``,
    which diffusers' processors hand to ``dispatch_attention_fn`` (as ``set_attention_backend``
    sets it). Not that setter itself: it also makes ``name`` the process's active backend, for
    every other model too, after the call."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    processors = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    if not processors:
        raise ArgumentError(
            f"{type(model).__name__} has no attention processor that takes a backend", "attention backend"
        )
    for processor in processors:
        processor._attention_backend = AttentionBackendName(name)


__all__ = ["DEFAULT_BACKEND", "backend_names", "backend_problems", "usable_backends", "use_backend"]
