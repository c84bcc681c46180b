"""The public API is importable from the package root, and importing the root stays cheap."""

import subprocess
import sys

import cachegen_core


def test_every_exported_name_resolves():
    for name in cachegen_core.__all__:
        assert getattr(cachegen_core, name) is not None, name
    assert cachegen_core.KVEngine.__module__ == "cachegen_core.engine.engine"


def test_unknown_names_are_attribute_errors():
    try:
        cachegen_core.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("no AttributeError")


def test_importing_the_package_does_not_import_torch():
    code = "import sys, cachegen_core; print('torch' in sys.modules, 'langchain_core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]
