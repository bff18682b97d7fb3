"""Test helpers for reshard and its plugins: local Gloo worlds, a transport conformance suite,
model builders."""
