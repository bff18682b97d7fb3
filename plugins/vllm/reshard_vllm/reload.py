"""One weight update of a live vLLM model through vLLM's layerwise reload, committed or rolled back whole.

vLLM's layers repack or quantize their weights after loading (on the CPU backend every linear weight
goes into a oneDNN handle and its parameter is left empty), so new weights must arrive in the
checkpoint layout (vLLM-named, TP-local, fused, padded) and be processed again. ``LayerwiseUpdate``:

1. ``open()``: ``initialize_layerwise_reload`` puts every layer's parameters on meta in checkpoint
   shapes; each layer with tensors of its own is materialized, its parameters backed by receive
   buffers kept across updates (same storage every time, so a refit's prepared plan is reused).
   vLLM leaves some parameters live through a reload (every ``bias``, a router's
   ``e_score_correction_bias``): those are replaced on the layer by stand-ins backed by their receive
   buffers, never re-pointed, so nothing written during the update reaches a tensor the engine serves;
2. the caller writes every parameter (a refit into the model);
3. ``commit()`` processes each layer (``process_weights_after_loading``, copy into the original
   kernel tensors, live ones included) and finalizes, which re-derives what attention layers compute
   from the weights (MLA's ``W_UK_T``/``W_UV``); ``rollback()`` puts every layer's original tensors
   back with their old values, attention layers included, without processing anything, and
   finalizes, leaving what arrived in the buffers.

Nothing else runs in between (each of open-write-rollback and open-commit happens inside one RPC),
so generation never sees meta parameters or a half-updated model. The engine receives with the
first (``update_weights``) and applies with the second (``finish_weight_update``).
"""

from __future__ import annotations

from typing import Any

import torch

from .vllm_private import layerwise_process, place_kernel_tensors


class LayerwiseUpdate:
    """The reload state of one update of ``model`` (a vLLM model in a worker)."""

    def __init__(self, model: torch.nn.Module, model_config: Any, buffers: dict[str, torch.Tensor]) -> None:
        self.model, self.model_config, self.buffers = model, model_config, buffers
        self.layers: list[tuple[torch.nn.Module, Any]] = []
        self.constant: list[tuple[torch.nn.Module, Any]] = []
        """Armed layers with buffers but no parameters (rotary caches): they get their own back."""
        self.attention: list[tuple[torch.nn.Module, Any]] = []
        """Armed attention layers: a commit has finalize re-derive their weights, a rollback does not."""
        self.open_ = False

    def open(self) -> None:
        """Arm the reload and give every parameter of the checkpoint layout its receive buffer."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        initialize_layerwise_reload(self.model)
        self.open_ = True
        stand_ins: dict[int, torch.nn.Parameter] = {}  # one per live tensor, however many layers hold it
        for prefix, layer in self.model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load():
                continue
            if is_deferred_attention_layer(layer):  # processed by finalize, after every other layer
                self.attention.append((layer, info))
                continue
            if next(layer.named_parameters(recurse=False), None) is None:
                if next(layer.named_buffers(recurse=False), None) is not None:
                    self.constant.append((layer, info))
                continue
            materialize_layer(layer, info)
            live = info.kernel_tensors[0] if info.kernel_tensors is not None else {}
            for name, param in list(layer.named_parameters(recurse=False)):
                kept = live.get(name) is param  # vLLM kept it live: the engine serves it, never write it
                if kept and id(param) in stand_ins:
                    layer.register_parameter(name, stand_ins[id(param)])
                    continue
                key = f"{prefix}.{name}" if prefix else name
                buffer = _receive_buffer(self.buffers, key, param, initial=param if kept else None)
                if kept:
                    stand_ins[id(param)] = _stand_in(param, buffer)
                    layer.register_parameter(name, stand_ins[id(param)])
                else:
                    param.data = buffer
            self.layers.append((layer, info))

    def commit(self) -> None:
        """Process every written layer into the model's live tensors, then finalize."""
        try:
            for layer, info in self.layers:
                _leave_buffers(layer)
                _forget_cpu_moe_kernel(layer)
                layerwise_process(layer, info)
        finally:
            self._finalize()

    def rollback(self) -> None:
        """Finalize without processing: every layer, attention layers included, gets its original
        tensors and values back (derived ones, such as MLA's absorbed matrices, are not recomputed)."""
        self._finalize(restore=[*self.layers, *self.attention])

    def _finalize(self, restore: list[tuple[torch.nn.Module, Any]] | None = None) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.open_:
            self.open_ = False
            # finalize would do the same for these, warning "Failed to load weights" for each layer
            for layer, info in [*self.constant, *(restore or [])]:
                place_kernel_tensors(layer, info)
                info.reset()
            finalize_layerwise_reload(self.model, self.model_config)


def _receive_buffer(
    buffers: dict[str, torch.Tensor], name: str, like: torch.Tensor, initial: torch.Tensor | None = None
) -> torch.Tensor:
    """The receive buffer of parameter ``name``, kept in ``buffers`` across updates (same storage
    every time, so a refit's prepared plan is reused, and what it holds is what arrived last) while
    its shape, dtype and device stay. A new one starts as a copy of ``initial`` when given."""
    buf = buffers.get(name)
    if buf is None or (buf.shape, buf.dtype, buf.device) != (like.shape, like.dtype, like.device):
        buf = buffers[name] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        if initial is not None:
            with torch.no_grad():
                buf.copy_(initial)
    return buf


def _stand_in(live: torch.nn.Parameter, buffer: torch.Tensor) -> torch.nn.Parameter:
    """A parameter like ``live`` (class and attributes, its weight loader included) backed by
    ``buffer``."""
    out = torch.nn.Parameter(buffer, requires_grad=False)
    out.__class__ = live.__class__
    out.__dict__ = live.__dict__.copy()
    return out


def _leave_buffers(layer: torch.nn.Module) -> None:
    """Give ``layer``'s parameters copies of their receive buffers before vLLM processes it.

    Processing may keep what it reads: vLLM's CPU MoE kernel holds the expert biases it was built
    with. Were those the receive buffers, the next update's receive would change the weights being
    served before that update is agreed, and a failed one would leave them half written."""
    for param in list(layer.parameters(recurse=False)):
        param.data = param.data.clone()


def _forget_cpu_moe_kernel(layer: torch.nn.Module) -> None:
    """Make vLLM process a CPU MoE layer's new weights as it did at load time.

    vLLM 0.32 prepacks CPU expert weights (``cpu_prepack_moe_weight``, padding the intermediate dim)
    only when it builds the MoE kernel; a reload finds the kernel built, skips the prepack and copies
    the checkpoint-layout weights over the prepacked ones, so the engine computes with garbage.
    Without a kernel, processing builds a new one and prepacks, and the reload then copies the
    prepacked weights into the layer's original storage.
    """
    quant = getattr(layer, "quant_method", None)
    weight = getattr(layer, "w13_weight", None)
    if getattr(quant, "moe_kernel", None) is not None and weight is not None and weight.device.type == "cpu":
        quant.moe_kernel = None


class InPlaceUpdate:
    """One update of a model whose parameters are already in the checkpoint layout (unquantized
    weights on a GPU: no layer repacks them), with the same contract as ``LayerwiseUpdate``.

    ``open()`` points every parameter at its receive buffer while the refit writes; ``commit()``
    copies each buffer into the parameter's own storage (which CUDA graphs captured) and points it
    back; ``rollback()`` only points it back. The live weights change in one local copy, after
    every worker agreed, so a failed update never leaves them half written.
    """

    def __init__(self, model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
        self.model, self.buffers = model, buffers
        self.live: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    @staticmethod
    def possible(model: torch.nn.Module) -> str | None:
        """None when ``model``'s parameters can be written in place, else why not."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        if any(p.device.type != "cuda" for p in model.parameters()):
            return "its parameters are not on a GPU (vLLM's CPU backend repacks linear weights)"
        for name, layer in model.named_modules():
            quant = getattr(layer, "quant_method", None)
            if quant is not None and not type(quant).__name__.startswith("Unquantized"):
                return f"layer {name} is quantized ({type(quant).__name__})"
            recorded = get_layerwise_info(layer).restore_metadata[0]
            for key, param in layer.named_parameters(recurse=False):
                meta = recorded.get(key)
                if meta is None or meta.shape != param.shape or meta.dtype != param.dtype:
                    return f"parameter {name}.{key} is not in its checkpoint layout"
        return None

    def open(self) -> None:
        for name, param in self.model.named_parameters():
            self.live.append((param, param.data))
            param.data = _receive_buffer(self.buffers, name, param)

    @torch.no_grad()
    def commit(self) -> None:
        for param, live in self.live:
            live.copy_(param.data)
        self.rollback()

    def rollback(self) -> None:
        for param, live in self.live:
            param.data = live
        self.live = []


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` in its checkpoint layout (qualname → tensor, on meta where vLLM
    recorded only the layout): what a reload's receive buffers will be, known before any update opens.

    vLLM records each layer's checkpoint-layout tensors on meta when it loads the model (its kernels
    may since hold them repacked, and tensors it derived, such as MLA's ``W_UK_T``, are no part of
    it); the tensors a reload keeps live (biases, routers' correction biases) are taken as they are.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # a live tensor held by two modules (a router's bias, by its experts too)
    for prefix, layer in model.named_modules():
        recorded_params, recorded_buffers = get_layerwise_info(layer).restore_metadata
        live = {**dict(layer.named_parameters(recurse=False)), **dict(layer.named_buffers(recurse=False))}
        kept = {name: t for name, t in live.items() if name in SKIP_TENSORS and id(t) not in seen}
        seen.update(id(t) for t in kept.values())
        for name, tensor in {**kept, **recorded_buffers, **recorded_params}.items():
            if name not in layer._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = tensor
    return out
