"""State fsdp_fp8 keeps about other libraries' objects (``fsdp_fp8.collective.attached``): held
only weakly (dropping the object frees it), and never as an attribute of ours on the object."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from fsdp_fp8.collective import attached, mark_unusable, unusable_reason
from fsdp_fp8.collective.unusable import UNUSABLE


def ours(module: nn.Module) -> dict[str, list[str]]:
    """Each submodule's instance attributes named like ours (``fsdp_fp8...``, ``cache_context``)."""
    found = {}
    for name, m in module.named_modules():
        keys = sorted(k for k in vars(m) if k.startswith("fsdp_fp8") or k == "cache_context")
        if keys:
            found[name or "<root>"] = keys
    return found


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.Linear(3, 2)))


def freed(make_and_attach) -> bool:
    """Whether the object ``make_and_attach()`` returns is freed once dropped."""
    ref = weakref.ref(make_and_attach())
    gc.collect()
    return ref() is None


class Equal:
    """Equal to everything and unhashable, as some library classes are."""

    __hash__ = None

    def __eq__(self, other):
        return True


def test_an_attachment_is_per_object_and_forgets_an_object_dropped():
    box = attached.Attachment("a test's values")
    a, b = Equal(), Equal()
    box.set(a, 1)
    box.set(b, 2)
    assert (box.get(a), box.get(b), box.get(Equal())) == (1, 2, None)
    assert len(box) == 2
    del a
    gc.collect()
    assert len(box) == 1 and box._entries.keys() == {id(b)}  # the dropped object's entry went with it


def test_an_unusable_model_is_marked_without_an_attribute_of_ours_and_freed_when_dropped():
    model = _model()
    mark_unusable(model, "rank 1: disk gone")
    assert unusable_reason(model) == "rank 1: disk gone"
    assert unusable_reason(model[1][0]) == "rank 1: disk gone"  # every module, not only the root
    assert ours(model) == {}
    before = len(UNUSABLE)

    def marked():
        m = _model()
        mark_unusable(m, "injected")
        return m

    assert freed(marked)
    assert len(UNUSABLE) == before


def test_a_step_policy_is_routed_without_an_attribute_of_ours_and_freed_when_dropped():
    from fsdp_fp8 import install_step_policy, routing_of

    model = _model()
    routing = install_step_policy(model, None)
    assert routing_of(model) is routing
    assert ours(model) == {}
    assert freed(lambda: (m := _model(), install_step_policy(m, None))[0])
    with torch.no_grad():
        assert model(torch.zeros(1, 4)).shape == (1, 2)
