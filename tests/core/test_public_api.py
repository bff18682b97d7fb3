"""The lazily exported public names of ``reshard_core`` all resolve, and unknown names fail clearly."""

import pytest

import reshard_core


@pytest.mark.parametrize("name", sorted(set(reshard_core.__all__) - {"__version__"}))
def test_every_public_name_resolves(name):
    assert getattr(reshard_core, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'reshard_core' has no attribute 'nope'"):
        reshard_core.nope  # noqa: B018
