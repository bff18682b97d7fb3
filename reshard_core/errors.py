"""Exception types. Every error reshard raises on bad input is a ``ReshardError`` with one clear message."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``exc``'s whole message on one line (runs of whitespace and newlines become one space)."""
    return " ".join(str(exc).split())


class ReshardError(Exception):
    """Base class of every error reshard raises on purpose."""


class PlanError(ReshardError):
    """The two sides cannot be matched (names, shapes, dtypes, coverage); raised before data moves."""


class TransportError(ReshardError):
    """A transport failed, timed out, or a peer vanished while data moved."""


class PluginError(ReshardError):
    """A plugin could not be loaded, is incompatible, or a requested name is unknown."""


class FormatError(PlanError):
    """A model format cannot map a model's tensors onto logical ones (an unmapped tensor, or a
    layout the mapping does not allow); raised on every rank before data moves."""


class LayoutPayloadError(ReshardError):
    """A layout-exchange payload is malformed (truncated, corrupted, or not made by reshard)."""


class MissingDependency(ReshardError, ImportError):
    """A module needs an optional package that is not installed; the message says how to install it.

    Raised instead of a bare ``ModuleNotFoundError`` by modules that import an optional dependency
    (one their distribution declares as an extra) at import time."""

    def __init__(self, module: str, distribution: str, install: str) -> None:
        self.module, self.distribution, self.install = module, distribution, install
        super().__init__(f"{module} needs {distribution}, which is not installed here: {install}")
