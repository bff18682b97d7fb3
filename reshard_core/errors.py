"""Exception types. Every error reshard raises on bad input is a ``ReshardError`` with one clear message."""


class ReshardError(Exception):
    """Base class of every error reshard raises on purpose."""


class PlanError(ReshardError):
    """The two sides cannot be matched (names, shapes, dtypes, coverage); raised before data moves."""


class TransportError(ReshardError):
    """A transport failed, timed out, or a peer vanished while data moved."""


class PluginError(ReshardError):
    """A plugin could not be loaded, is incompatible, or a requested name is unknown."""
