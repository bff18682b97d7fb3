"""Compact, pickle-free exchange of layout tables (see ``collective.exchange_layouts``)."""

from .collective import ExchangeStats, exchange_layouts

__all__ = ["ExchangeStats", "exchange_layouts"]
