"""Packages a library imports only for what foldsweep never calls stay unloaded until used
(``pipeline.base.deferred``), shown on a small package of the test's own, written the way
Keras imports matplotlib (``import package.submodule as name``, ``from package import
submodule``, each inside ``try: ... except ImportError``)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from pipeline.base.deferred import Deferred, deferred


@pytest.fixture
def package(tmp_path, monkeypatch, request):
    """A package ``name`` with submodules ``pyplot`` and ``patches``; each counts its loads in
    ``sys.<name>_loads``."""
    name = f"fakeplot_{request.node.name[-40:].replace('[', '_').replace(']', '_')}"
    root = tmp_path / name
    root.mkdir()
    count = f"sys.{name}_loads = getattr(sys, '{name}_loads', []) + [__name__]"
    (root / "__init__.py").write_text(f"import sys\n{count}\nVALUE = 21\n")
    (root / "pyplot.py").write_text(
        f"import sys\n{count}\nfrom {name} import VALUE\n\ndef subplots():\n    return VALUE * 2\n"
    )
    (root / "patches.py").write_text(f"import sys\n{count}\n\nclass Patch:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [module for module in sys.modules if module == name or module.startswith(name + ".")]:
        del sys.modules[module]
    if hasattr(sys, f"{name}_loads"):
        delattr(sys, f"{name}_loads")


def loads(name: str) -> list[str]:
    return getattr(sys, f"{name}_loads", [])


def import_as_keras_does(name: str) -> tuple[object, object]:
    namespace: dict = {}
    exec(
        textwrap.dedent(
            f"""
            try:
                import {name}.pyplot as plt
            except ImportError:
                plt = None
            try:
                from {name} import patches
            except ImportError:
                patches = None
            """
        ),
        namespace,
    )
    return namespace["plt"], namespace["patches"]


def test_the_imports_inside_the_block_bind_placeholders_and_run_none_of_the_package(package):
    with deferred((package,)):
        plt, patches = import_as_keras_does(package)
    assert isinstance(plt, Deferred) and isinstance(patches, Deferred)
    assert (plt.__name__, patches.__name__) == (f"{package}.pyplot", f"{package}.patches")
    assert loads(package) == []
    assert not [module for module in sys.modules if module.split(".")[0] == package]  # a later import loads it


def test_a_placeholder_loads_the_real_module_when_first_read_and_forwards_to_it(package):
    with deferred((package,)):
        plt, patches = import_as_keras_does(package)
    assert plt.subplots() == 42
    assert loads(package) == [package, f"{package}.pyplot"]
    assert plt.subplots is sys.modules[f"{package}.pyplot"].subplots
    assert patches.Patch is sys.modules[f"{package}.patches"].Patch
    assert loads(package) == [package, f"{package}.pyplot", f"{package}.patches"]  # each loaded once


def test_an_import_after_the_block_gets_the_real_package(package):
    with deferred((package,)):
        plt, _ = import_as_keras_does(package)
    real = __import__(f"{package}.pyplot", fromlist=["subplots"])
    assert not isinstance(real, Deferred)
    assert real.subplots() == 42
    assert plt.subplots() == 42
    assert loads(package) == [package, f"{package}.pyplot"]


def test_a_package_loaded_before_the_block_is_not_deferred(package):
    __import__(package)
    with deferred((package,)):
        plt, patches = import_as_keras_does(package)
    assert not isinstance(plt, Deferred) and not isinstance(patches, Deferred)
    assert plt.subplots() == 42


def test_a_package_that_is_not_installed_fails_to_import_as_without_the_block():
    with deferred(("no_such_plotting_package",)):
        plt, patches = import_as_keras_does("no_such_plotting_package")
    assert plt is None and patches is None


def test_a_placeholder_read_inside_the_block_ends_the_deferral(package):
    with deferred((package,)):
        plt, _ = import_as_keras_does(package)
        assert plt.subplots() == 42
        again, patches = import_as_keras_does(package)
        assert not isinstance(again, Deferred) and not isinstance(patches, Deferred)
    assert loads(package) == [package, f"{package}.pyplot", f"{package}.patches"]
