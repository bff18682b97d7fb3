"""``ExecMemo``: what repeated executions of one plan on the same tensors may reuse.

A refit repeats: the same plan, the same source and destination tensors (written in place). The
input check then needs to pass once, the plan's schedule (batches, messages) is derived once, and
every op's region view and every untransformed message's recipe can be kept instead of rebuilt. A
prepared session keeps one memo; ``refit()`` rebuilds the session, with a fresh memo, when its
models' tensors change, and ``Session.refit()`` refuses to run then. A caller of ``execute_plan``
who passes a memo makes the same promise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .messages import Recipe
from .schedule import Schedule


@dataclass
class ExecMemo:
    """Valid for one plan and one set of tensors: the same tensor objects, with the same shapes,
    strides, dtypes and storage, and the same transforms, in every call it is passed to.

    ``checked``: the ``(cast, transport device)`` combinations the input check passed for.
    ``views``: each op's region views, by ``(id(op), side)``.
    ``schedules``: the plan's ``Schedule`` by the set of transformed names.
    ``recipes``: how each message without transformed ops travels (``messages.Recipe``).
    """

    plan: object | None = None
    checked: set[tuple[bool, str]] = field(default_factory=set)
    views: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    schedules: dict[frozenset[str], Schedule] = field(default_factory=dict)
    recipes: dict[tuple[int, str], Recipe] = field(default_factory=dict)

    def bind(self, plan: object) -> None:
        """Forget everything when called with another plan than before. The plan is held, not its
        ``id``: ops are keyed by identity, and a collected plan's address may be reused."""
        if self.plan is not plan:
            self.plan = plan
            self.checked.clear()
            self.views.clear()
            self.schedules.clear()
            self.recipes.clear()
