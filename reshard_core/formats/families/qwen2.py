"""Qwen2 / Qwen2.5 (``qwen2``): a Llama whose q/k/v projections always have biases (``o_proj`` none)."""

from __future__ import annotations

from typing import Any

from .family import Family


class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)

    def attention_biases(self, c: Any) -> tuple[bool, bool]:
        return True, False


FAMILY = Qwen2()
