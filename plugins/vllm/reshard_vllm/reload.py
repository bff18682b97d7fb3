"""One weight update of a live vLLM model through vLLM's layerwise reload, committed or rolled back whole.

vLLM's layers repack or quantize their weights after loading (on the CPU backend every linear weight
goes into a oneDNN handle and its parameter is left empty), so new weights must arrive in the
checkpoint layout (vLLM-named, TP-local, fused, padded) and be processed again. ``LayerwiseUpdate``:

1. ``open()``: ``initialize_layerwise_reload`` puts every layer's parameters on meta in checkpoint
   shapes; each layer with tensors of its own is materialized, its parameters backed by receive
   buffers kept across updates (same storage every time, so a refit's prepared plan is reused);
2. the caller writes every parameter (a refit into the model);
3. ``commit()`` processes each layer (``process_weights_after_loading``, copy into the original
   kernel tensors) and finalizes; ``rollback()`` finalizes without processing, which puts every
   layer's original tensors back with their old values.

Nothing else runs in between (the engine does all of it inside one RPC), so generation never sees
meta parameters or a half-updated model.
"""

from __future__ import annotations

from typing import Any

import torch


class LayerwiseUpdate:
    """The reload state of one update of ``model`` (a vLLM model in a worker)."""

    def __init__(self, model: torch.nn.Module, model_config: Any, buffers: dict[str, torch.Tensor]) -> None:
        self.model, self.model_config, self.buffers = model, model_config, buffers
        self.layers: list[tuple[torch.nn.Module, Any]] = []
        self.open_ = False

    def open(self) -> None:
        """Arm the reload and give every parameter of the checkpoint layout its receive buffer."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        initialize_layerwise_reload(self.model)
        self.open_ = True
        for prefix, layer in self.model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or is_deferred_attention_layer(layer):
                continue
            own = dict(layer.named_parameters(recurse=False))
            if not own:
                continue
            materialize_layer(layer, info)
            for name, param in layer.named_parameters(recurse=False):
                param.data = self._buffer(f"{prefix}.{name}" if prefix else name, param)
            self.layers.append((layer, info))

    def _buffer(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The receive buffer of ``name`` (reused while its shape and dtype stay the same)."""
        buf = self.buffers.get(name)
        if buf is None or buf.shape != param.shape or buf.dtype != param.dtype:
            buf = self.buffers[name] = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        return buf

    def commit(self) -> None:
        """Process every written layer into the model's live tensors, then finalize."""
        from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process

        try:
            for layer, info in self.layers:
                _layerwise_process(layer, info)
        finally:
            self._finalize()

    def rollback(self) -> None:
        """Finalize without processing: every layer gets its original tensors and values back."""
        self._finalize()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.open_:
            self.open_ = False
            finalize_layerwise_reload(self.model, self.model_config)
