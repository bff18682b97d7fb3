"""The lazily exported public names of ``reshard_core`` all resolve, and unknown names fail clearly."""

import pytest

import reshard_core


@pytest.mark.parametrize("name", sorted(set(reshard_core.__all__) - {"__version__"}))
def test_every_public_name_resolves(name):
    assert getattr(reshard_core, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'reshard_core' has no attribute 'nope'"):
        reshard_core.nope  # noqa: B018


def test_dir_lists_the_public_api_before_anything_is_imported():
    import subprocess
    import sys

    code = (
        "import reshard_core, sys; names = reshard_core.__all__; "
        "print(sorted(names) == [n for n in dir(reshard_core) if n in names], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]
