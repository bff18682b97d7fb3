"""The ``ReshardTransform`` base contract and how transforms are assigned to tensors."""

from __future__ import annotations

import pytest
import torch

import reshard_core
from reshard_core.errors import PlanError
from reshard_core.plan.ops import OpKind, TransferOp
from reshard_core.transform import ReshardTransform, assign_transforms

OP = TransferOp(OpKind.SEND, "w", 1, (0,), (2,), (0,), None)


class Only(ReshardTransform):
    def __init__(self, *names):
        self.names = set(names)

    def should_transform(self, name):
        return name in self.names


def test_public_export_is_the_base_class():
    assert reshard_core.ReshardTransform is ReshardTransform


def test_base_claims_nothing_and_its_optional_hooks_are_no_ops():
    base = ReshardTransform()
    assert base.should_transform("w") is False
    assert base.transient_bytes("w") == 0
    assert base.finalize_tensor("w") is None


@pytest.mark.parametrize(
    ("call", "hook"),
    [
        (lambda t: t.prepare_send("w", OP, torch.zeros(2)), "prepare_send"),
        (lambda t: t.prepare_recv("w", OP), "prepare_recv"),
        (lambda t: t.finalize_recv("w", OP, []), "finalize_recv"),
    ],
)
def test_required_hooks_say_which_class_lacks_them(call, hook):
    with pytest.raises(NotImplementedError, match=f"^Only.{hook}$"):
        call(Only("w"))


def test_assignment_accepts_none_one_or_several_transforms():
    a, b = Only("x"), Only("y")
    assert assign_transforms(None, ["x", "y"]) == {}
    assert assign_transforms(a, ["x", "y", "z"]) == {"x": a}
    assert assign_transforms([a, b], ["x", "y", "z"]) == {"x": a, "y": b}


def test_a_tensor_claimed_twice_is_a_plan_error_naming_it():
    with pytest.raises(PlanError) as info:
        assign_transforms([Only("x"), Only("x", "y")], ["y", "x"])
    assert str(info.value) == "tensor 'x' is claimed by more than one transform: Only, Only"
