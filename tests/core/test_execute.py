"""The executor in one process: input checks (exact texts, nothing moves), slot layout, schedule helpers,
LOCAL ops (plain, cast, transformed) with a recording transport."""

from __future__ import annotations

import itertools

import pytest
import torch

from reshard_core.errors import PlanError
from reshard_core.execute import ExecMemo, ExecStats, StagingPool, execute_plan
from reshard_core.execute.schedule import (
    build_schedule,
    finalize_points,
    first_points,
    split_batches,
)
from reshard_core.execute.slots import Slot, layout_slots, slot_view
from reshard_core.plan.ops import OpKind, RankPlan, TransferOp
from reshard_core.specs import TensorMeta
from reshard_core.transform import ReshardTransform
from reshard_core.transport.copy_service import CopyService
from reshard_core.transport.task_ids import message_task_id

BF16, F32 = torch.bfloat16, torch.float32


class Recorder(CopyService):
    """A transport that records calls and moves nothing (``run`` only; no ``start``)."""

    name = "recorder"
    device = "any"

    def __init__(self, device: str = "any"):
        super().__init__()
        self.device = device
        self.calls: list[tuple] = []

    def submit_send(self, tensor, dest_rank, task_id):
        self.calls.append(("send", dest_rank, task_id, tensor.nbytes))

    def submit_recv(self, tensor, src_rank, task_id):
        self.calls.append(("recv", src_rank, task_id, tensor.nbytes))

    def run(self):
        self.calls.append(("run",))


def op(kind, name, peer, offsets, sizes, src_local=None, dst_local=None, batch=0) -> TransferOp:
    return TransferOp(OpKind(kind), name, peer, offsets, sizes, src_local, dst_local, batch)


def plan_of(rank, ops, **dtypes) -> RankPlan:
    shapes = {"w": (4, 6), "v": (4, 6)}
    metas = {n: TensorMeta(n, shapes.get(n, (4, 6)), dtypes.get(n, F32)) for n in {o.name for o in ops}}
    return RankPlan(rank, tuple(ops), metas, max((o.batch for o in ops), default=0) + 1)


# -- slots and schedule ------------------------------------------------------------------------------


def test_slots_align_each_wire_tensor_to_its_item_size():
    slots, total = layout_slots([((3,), torch.uint8), ((2,), BF16), ((1,), F32), ((1,), torch.float64)])
    assert [s.offset for s in slots] == [0, 4, 8, 16]
    assert total == 24
    message = torch.arange(24, dtype=torch.uint8)
    view = slot_view(message, Slot(4, (1, 2), BF16))
    assert view.shape == (1, 2) and view.dtype == BF16
    assert torch.equal(view.view(torch.uint8).reshape(-1), torch.tensor([4, 5, 6, 7], dtype=torch.uint8))


def test_batches_group_ops_by_peer_in_plan_order():
    ops = [
        op("send", "w", 1, (0, 0), (2, 6), (0, 0), None, 0),
        op("recv", "w", 2, (2, 0), (1, 6), None, (0, 0), 0),
        op("send", "v", 1, (0, 0), (2, 6), (0, 0), None, 0),
        op("local", "v", 0, (2, 0), (2, 6), (2, 0), (0, 0), 0),
        op("send", "w", 3, (0, 0), (1, 6), (0, 0), None, 2),
    ]
    batches = split_batches(plan_of(0, ops))
    assert [b.index for b in batches] == [0, 2]
    assert batches[0].sends == {1: [ops[0], ops[2]]}
    assert batches[0].recvs == {2: [ops[1]]}
    assert batches[0].local == [ops[3]]
    assert batches[1].sends == {3: [ops[4]]}


def test_a_schedule_lists_each_batch_s_messages_peers_in_turn_small_ops_first():
    big = TensorMeta("big", (256, 1024), F32)  # a 64-row slice is 256 KiB: a message of its own
    ops = [
        op("send", "big", 1, (0, 0), (64, 1024), (0, 0)),
        op("send", "big", 1, (64, 0), (64, 1024), (64, 0)),
        op("send", "w", 1, (0, 0), (1, 6), (0, 0)),
        op("send", "big", 2, (128, 0), (64, 1024), (128, 0)),
        op("recv", "w", 2, (1, 0), (1, 6), None, (0, 0)),
    ]
    plan = RankPlan(0, tuple(ops), {"big": big, "w": TensorMeta("w", (4, 6), F32)}, 1)
    schedule = build_schedule(plan, {"w"})
    assert [b.index for b in schedule.batches] == [0]
    assert schedule.sends[0] == [(1, 0, [ops[2]]), (2, 0, [ops[3]]), (1, 1, [ops[0]]), (1, 2, [ops[1]])]
    assert schedule.receives[0] == [(2, 0, [ops[4]])]
    assert schedule.finals == {0: ["w"]} and schedule.firsts == {0: ["w"]}


def test_task_ids_name_batch_message_sender_and_receiver():
    ids = {message_task_id(*key) for key in itertools.product(range(3), range(5), range(5), range(4))}
    assert len(ids) == 300
    assert message_task_id(2, 3, 4) == (2 << 60) | (3 << 20) | 4
    assert message_task_id(2, 3, 4, 5) == (2 << 60) | (5 << 40) | (3 << 20) | 4


def test_finalize_and_first_points_follow_receiving_ops_only():
    ops = [
        op("recv", "w", 1, (0, 0), (1, 6), None, (0, 0), 0),
        op("send", "v", 1, (0, 0), (1, 6), (0, 0), None, 0),
        op("local", "w", 0, (1, 0), (1, 6), (1, 0), (1, 0), 1),
        op("recv", "v", 1, (0, 0), (1, 6), None, (0, 0), 2),
    ]
    plan = plan_of(0, ops)
    assert finalize_points(plan, {"w", "v"}) == {1: ["w"], 2: ["v"]}
    assert first_points(plan, {"w", "v"}) == {0: ["w"], 2: ["v"]}
    assert finalize_points(plan, {"v"}) == {2: ["v"]}


# -- checks before any data moves --------------------------------------------------------------------


def _bad(plan, src, dst, transport=None, **kwargs) -> str:
    transport = transport or Recorder()
    with pytest.raises(PlanError) as info:
        execute_plan(plan, src, dst, transport, **kwargs)
    assert transport.calls == []  # nothing was submitted
    return str(info.value)


def test_destination_dtype_mismatch_is_refused_unless_cast():
    plan = plan_of(0, [op("recv", "w", 1, (0, 0), (4, 6), None, (0, 0))])
    assert _bad(plan, {}, {"w": torch.zeros(4, 6, dtype=BF16)}) == (
        "tensor 'w': destination dtype torch.bfloat16 differs from the plan's dtype torch.float32 "
        "(pass cast=True to convert)"
    )


def test_source_dtype_mismatch_is_refused():
    plan = plan_of(0, [op("send", "w", 1, (0, 0), (4, 6), (0, 0), None)])
    assert _bad(plan, {"w": torch.zeros(4, 6, dtype=torch.float16)}, {}) == (
        "tensor 'w': source dtype torch.float16 differs from the plan's dtype torch.float32 "
        "(pass cast=True to convert)"
    )


@pytest.mark.parametrize(
    ("ops", "src", "dst", "message"),
    [
        (
            [op("send", "w", 1, (0, 0), (4, 6), (0, 0), None)],
            {},
            {},
            "tensor 'w': the plan of rank 0 needs its source tensor, none was given",
        ),
        (
            [op("recv", "w", 1, (0, 0), (4, 6), None, (0, 0))],
            {},
            {"w": None},
            "tensor 'w': the plan of rank 0 needs its destination tensor, none was given",
        ),
        (
            [op("local", "w", 0, (0, 0), (4, 6), (0, 0), (1, 0))],
            {"w": torch.zeros(4, 6)},
            {"w": torch.zeros(4, 6)},
            "tensor 'w': destination region at (1, 0) of size (4, 6) "
            "is outside the local tensor of shape (4, 6)",
        ),
        (
            [op("send", "w", 1, (0, 0), (4, 6), (0,), None)],
            {"w": torch.zeros(4, 6)},
            {},
            "tensor 'w': source region (0,) does not fit a 2-d tensor",
        ),
        (
            [op("send", "w", 0, (0, 0), (4, 6), (0, 0), None)],
            {"w": torch.zeros(4, 6)},
            {},
            "tensor 'w': rank 0 has a send op with itself",
        ),
        (
            [
                op("send", "w", 1, (0, 0), (4, 6), (0, 0), None, 1),
                op("send", "w", 2, (0, 0), (4, 6), (0, 0), None, 0),
            ],
            {"w": torch.zeros(4, 6)},
            {},
            "plan of rank 0 lists batch 0 after batch 1",
        ),
    ],
)
def test_bad_inputs_are_one_clear_error_before_anything_moves(ops, src, dst, message):
    assert _bad(plan_of(0, ops), src, dst) == message


def test_op_without_metadata_is_refused():
    plan = RankPlan(0, (op("send", "x", 1, (0,), (1,), (0,), None),), {}, 1)
    assert _bad(plan, {"x": torch.zeros(1)}, {}) == "tensor 'x': rank 0 has an op for it but no metadata"


def test_tensors_on_a_device_the_transport_cannot_move_are_refused():
    plan = plan_of(0, [op("send", "w", 1, (0, 0), (4, 6), (0, 0), None)])
    assert _bad(plan, {"w": torch.zeros(4, 6)}, {}, Recorder(device="cuda")) == (
        "tensor 'w': source tensor is on cpu, the transport moves cuda only"
    )


def test_two_transforms_claiming_one_tensor_is_an_error():
    class Claim(ReshardTransform):
        def should_transform(self, name):
            return True

    plan = plan_of(0, [op("local", "w", 0, (0, 0), (4, 6), (0, 0), (0, 0))])
    message = _bad(plan, {"w": torch.zeros(4, 6)}, {"w": torch.zeros(4, 6)}, transform=[Claim(), Claim()])
    assert message == "tensor 'w' is claimed by more than one transform: Claim, Claim"


# -- LOCAL ops -----------------------------------------------------------------------------------------


def test_local_ops_copy_view_to_view_in_place_without_staging():
    src = {"w": torch.arange(24, dtype=F32).reshape(4, 6)}
    dst = {"w": torch.full((6, 4), -1.0)}
    pointer = dst["w"].data_ptr()
    # source columns 2..5 of rows 1..2 land at destination rows 3..4, columns 1..2 (strided both sides)
    plan = plan_of(0, [op("local", "w", 0, (1, 2), (2, 4), (1, 2), (3, 0))])
    plan = RankPlan(0, plan.ops, {"w": TensorMeta("w", (6, 6), F32)}, 1)
    transport = Recorder()
    stats = execute_plan(plan, src, dst, transport)
    want = torch.full((6, 4), -1.0)
    want[3:5, 0:4] = src["w"][1:3, 2:6]
    assert torch.equal(dst["w"], want)
    assert dst["w"].data_ptr() == pointer
    assert transport.calls == []  # a batch of local copies only starts no transport round
    assert (stats.bytes_local, stats.bytes_sent, stats.messages, stats.batches) == (32, 0, 0, 1)
    assert stats.peak_staging_bytes == 0
    assert isinstance(stats, ExecStats)


def test_a_memo_keeps_the_check_verdict_schedule_and_region_views_for_its_plan_only():
    src = {"w": torch.arange(24, dtype=F32).reshape(4, 6)}
    dst = {"w": torch.zeros(4, 6)}
    plan = plan_of(0, [op("local", "w", 0, (0, 0), (2, 6), (0, 0), (2, 0))])
    memo = ExecMemo()
    execute_plan(plan, src, dst, Recorder(), memo=memo)
    assert memo.checked == {(False, "any")}
    schedule = memo.schedules[frozenset()]
    views = dict(memo.views)
    assert sorted(side for _, side in views) == ["dst", "src"]
    src["w"] += 100  # new values, same tensors: the kept views see them
    execute_plan(plan, src, dst, Recorder(), memo=memo)
    assert torch.equal(dst["w"][2:], src["w"][:2])
    assert all(memo.views[key] is view for key, view in views.items())
    assert memo.schedules == {frozenset(): schedule}  # derived once, reused
    other = plan_of(0, [op("local", "w", 0, (2, 0), (2, 6), (2, 0), (0, 0))])
    with pytest.raises(PlanError):  # another plan: the verdict is forgotten and the check runs again
        execute_plan(other, src, {}, Recorder(), memo=memo)
    assert memo.checked == set() and memo.views == {} and memo.schedules == {}


def test_cast_converts_on_local_copies():
    src = {"w": torch.randn(4, 6)}
    dst = {"w": torch.zeros(4, 6, dtype=BF16)}
    plan = plan_of(0, [op("local", "w", 0, (0, 0), (4, 6), (0, 0), (0, 0))])
    execute_plan(plan, src, dst, Recorder(), cast=True)
    assert torch.equal(dst["w"], src["w"].to(BF16))


class SplitTransform(ReshardTransform):
    """Two wire tensors per op (bits as int32, and a row max); owns its destination."""

    def __init__(self):
        self.owned = torch.zeros(4, 6)
        self.seen: list[list[tuple]] = []
        self.finalized: list[str] = []

    def should_transform(self, name):
        return name == "w"

    def prepare_send(self, name, op, src_view):
        return [src_view.contiguous().view(torch.int32), src_view.amax(-1)]

    def prepare_recv(self, name, op):
        raise AssertionError("a LOCAL op never asks for receive buffers")

    def finalize_recv(self, name, op, buffers):
        self.seen.append([(tuple(b.shape), b.dtype) for b in buffers])
        self.owned[op.dst_local[0] : op.dst_local[0] + op.sizes[0]] = buffers[0].view(F32)

    def finalize_tensor(self, name):
        self.finalized.append(name)

    def transient_bytes(self, name):
        return 512


def test_transformed_local_ops_get_every_produced_tensor_in_its_own_slot():
    src = {"w": torch.randn(4, 6)}
    transform = SplitTransform()
    ops = [
        op("local", "w", 0, (0, 0), (2, 6), (0, 0), (0, 0)),
        op("local", "w", 0, (2, 0), (2, 6), (2, 0), (2, 0)),
    ]
    stats = execute_plan(plan_of(0, ops), src, {}, Recorder(), transform=transform)
    assert torch.equal(transform.owned, src["w"])
    assert transform.seen == [[((2, 6), torch.int32), ((2,), F32)]] * 2
    assert transform.finalized == ["w"]
    assert stats.peak_staging_bytes == 512 + 2 * 6 * 4 + 2 * 4


def test_staging_pool_hands_back_buffers_that_fit_on_the_same_device():
    pool = StagingPool()
    a = pool.take(64, torch.device("cpu"))
    assert (a.dtype, a.shape, pool.held_bytes) == (torch.uint8, (64,), 0)
    pool.give(a)
    assert pool.held_bytes == 64
    half = pool.take(32, "cpu")  # a smaller request reuses a's leading bytes
    assert half.shape == (32,) and half.data_ptr() == a.data_ptr() and pool.held_bytes == 0
    pool.give(half)
    assert pool.take(64, "cpu") is a
    pool.give(a)
    pool.clear()
    assert pool.held_bytes == 0


def test_destinations_may_be_parameters_that_require_grad():
    src = {"w": torch.randn(4, 6)}
    dst = {"w": torch.nn.Parameter(torch.zeros(4, 6))}
    plan = plan_of(0, [op("local", "w", 0, (0, 0), (4, 6), (0, 0), (0, 0))])
    execute_plan(plan, src, dst, Recorder())
    assert torch.equal(dst["w"].detach(), src["w"]) and dst["w"].requires_grad


# -- messages without staging ---------------------------------------------------------------------------


class Capture(Recorder):
    """A recording transport that keeps the submitted tensors (and moves nothing)."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []
        self.sent: dict[int, torch.Tensor] = {}

    def submit_send(self, tensor, dest_rank, task_id):
        super().submit_send(tensor, dest_rank, task_id)
        self.sent[dest_rank] = tensor

    def submit_recv(self, tensor, src_rank, task_id):
        super().submit_recv(tensor, src_rank, task_id)
        self.tensors.append(tensor)


def test_slices_adjacent_in_one_storage_go_on_the_wire_as_one_unstaged_message():
    flat = torch.arange(48, dtype=F32)
    src = {"w": flat[:24].view(4, 6), "v": flat[24:].view(4, 6)}  # one storage, end to end
    dst = {"w": torch.zeros(4, 6)}
    ops = [
        op("recv", "w", 1, (0, 0), (2, 6), None, (0, 0)),  # rows 0-1, then rows 2-3: adjacent
        op("recv", "w", 1, (2, 0), (2, 6), None, (2, 0)),
        op("send", "v", 1, (0, 0), (4, 6), (0, 0), None),
        op("send", "w", 1, (0, 0), (4, 6), (0, 0), None),  # w after v: not in storage order
        op("send", "w", 2, (0, 0), (4, 6), (0, 0), None),
        op("send", "v", 2, (0, 0), (4, 6), (0, 0), None),  # w then v: in storage order
    ]
    transport = Capture()
    stats = execute_plan(plan_of(0, ops), src, dst, transport)
    sent, (received,) = transport.sent, transport.tensors
    assert received.data_ptr() == dst["w"].data_ptr() and received.nbytes == 96
    assert sent[2].data_ptr() == flat.data_ptr() and sent[2].nbytes == 192
    assert sent[1].data_ptr() not in (flat.data_ptr(), flat[24:].data_ptr())  # packed
    assert stats.peak_staging_bytes == 192  # only the message to rank 1
    assert stats.messages_sent == 2 and stats.messages_received == 1


def test_slices_out_of_order_or_with_gaps_are_staged():
    dst = {"w": torch.zeros(4, 6)}
    reversed_rows = [
        op("recv", "w", 1, (2, 0), (2, 6), None, (2, 0)),
        op("recv", "w", 1, (0, 0), (2, 6), None, (0, 0)),
    ]
    gap = [
        op("recv", "w", 1, (0, 0), (1, 6), None, (0, 0)),
        op("recv", "w", 1, (2, 0), (2, 6), None, (2, 0)),
    ]
    for ops in (reversed_rows, gap):
        transport = Capture()
        stats = execute_plan(plan_of(0, ops), {}, dst, transport)
        assert transport.tensors[0].data_ptr() != dst["w"].data_ptr()
        assert stats.peak_staging_bytes == transport.tensors[0].nbytes > 0


def test_a_memo_keeps_each_message_s_recipe_and_a_warm_run_sends_the_same_bytes():
    flat = torch.arange(48, dtype=F32)
    src = {"w": flat[:24].view(4, 6), "v": flat[24:].view(4, 6)}
    dst = {"w": torch.zeros(4, 6)}
    ops = [
        op("recv", "w", 1, (0, 0), (2, 6), None, (0, 0)),
        op("recv", "w", 1, (2, 0), (2, 6), None, (2, 0)),
        op("send", "v", 1, (0, 0), (4, 6), (0, 0), None),  # v then w: not storage order, packed
        op("send", "w", 1, (0, 0), (4, 6), (0, 0), None),
        op("send", "w", 2, (0, 0), (4, 6), (0, 0), None),  # in storage order: direct
        op("send", "v", 2, (0, 0), (4, 6), (0, 0), None),
    ]
    plan, memo = plan_of(0, ops), ExecMemo()
    runs = []
    for _ in range(2):
        transport = Capture()
        execute_plan(plan, src, dst, transport, memo=memo)
        runs.append((transport.sent[1].clone(), transport.sent[2], transport.tensors[0], dict(memo.recipes)))
    (packed, direct, received, recipes), (packed2, direct2, received2, recipes2) = runs
    assert sorted(direction for _, direction in recipes) == ["recv", "send", "send"]
    assert all(recipes2[key] is recipe for key, recipe in recipes.items())  # built once
    assert torch.equal(packed.view(F32), torch.cat([flat[24:], flat[:24]])) and torch.equal(packed, packed2)
    assert direct.data_ptr() == direct2.data_ptr() == flat.data_ptr()
    assert received.data_ptr() == received2.data_ptr() == dst["w"].data_ptr()
