"""reshard: move model weights between parallel layouts, exactly and fast.

The public names below are imported lazily, so ``import reshard_core`` stays cheap and never pulls
a transport or a framework it does not need.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

PLUGIN_API_VERSION = 1
"""The plugin API this core provides. Plugins declare ``RESHARD_PLUGIN_API`` in their hook module."""

_EXPORTS = {
    # data model
    "Replicate": "layout",
    "Shard": "layout",
    "Mesh": "layout",
    "Layout": "layout",
    "Box": "layout",
    "TensorMeta": "specs",
    "TensorSpec": "specs",
    "TransferOp": "plan.ops",
    "OpKind": "plan.ops",
    "RankPlan": "plan.ops",
    # errors
    "ReshardError": "errors",
    "PlanError": "errors",
    "TransportError": "errors",
    "PluginError": "errors",
    "FormatError": "errors",
    "MissingDependency": "errors",
    # extension points
    "CopyService": "transport.copy_service",
    "ReshardTransform": "transform",
    "hookimpl": "hookspecs",
    # plugins and transports
    "register_plugin": "plugins",
    "get_transport": "transport.registry",
    # extraction
    "declare_layout": "extract.plain",
    "extract_specs": "extract",
    "ExtractContext": "extract",
    "ExtractError": "extract",
    # model formats (refits across naming, fusing and padding conventions)
    "ModelFormat": "formats",
    "FormatSpecs": "formats",
    "CanonicalFormat": "formats",
    "declare_format": "formats",
    "SplitView": "views",
    "PiecewiseView": "views",
    # planning (offline and per rank)
    "LayoutTable": "plan.table",
    "TableEntry": "plan.table",
    "TableBuilder": "plan.table",
    "plan_rank": "plan.rank",
    "validate_table": "plan.validate",
    "exchange_layouts": "exchange",
    "ExchangeStats": "exchange",
    "simulate": "simulate",
    "parse_parallel": "simulate",
    # refit API
    "refit": "api",
    "prepare": "api",
    "refuse_refit": "api",
    "weight_version": "versions",
    "RefitOptions": "options",
    "Session": "session",
    "clear_caches": "api",
    "RefitReport": "report",
    "TransferGroup": "coordination.transfer_group",
}

__all__ = ["PLUGIN_API_VERSION", "__version__", *_EXPORTS]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
