"""Transports (CopyServices): the base contract and discovery by name."""
