"""Packages a library imports for features foldsweep never calls, loaded only once used.

Keras imports ``matplotlib.pyplot`` (and ``matplotlib.patches``) as it loads, for its
image-gallery plots, their only users: 0.78 s of the 6.6 s that loading Keras and a Ray
worker's modules took on a 2-core machine, paid by the driver before Ray starts and by every
worker before its first trial, none of which draws with them. While Keras loads, importing
those packages makes placeholders (``Deferred``) that Keras binds as it would the modules; a
placeholder imports the real module when something first reads from it (Keras drawing a
gallery). The placeholders leave ``sys.modules`` when the block ends, so a later ``import
matplotlib`` loads the real package, as foldsweep's plots do.

scikit-learn likewise: Keras' scikit-learn wrappers and KerasTuner's BayesianOptimization and
SklearnTuner import it as they load (~1 s of a worker's start-up on that machine), and a Ray worker
uses none of them (the folds are split in the driver). So are SciPy's optimizers, which only
BayesianOptimization uses (``scipy.optimize``, most of what loading KerasTuner costs).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

# What Keras imports only for its plots (keras.src.visualization).
KERAS_PLOTTING = ("matplotlib",)
# What KerasTuner imports only for its BayesianOptimization and SklearnTuner.
KERAS_TUNER_TUNERS = ("sklearn", "scipy.optimize")


class Deferred(types.ModuleType):
    """Stands for a module until something reads from it, then forwards to the real module,
    imported at that moment (which ends every deferral: the placeholders leave ``sys.modules``)."""

    _real: types.ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        if self._real is None and _deferring is not None:
            if attribute.startswith("__"):  # the import system's probes (__path__, __file__)
                raise AttributeError(attribute)
            # ``from package import submodule`` asks the package for it first: a placeholder too.
            with contextlib.suppress(ImportError):
                return importlib.import_module(f"{self.__name__}.{attribute}")
        if self._real is None:
            _stop_deferring()
            self._real = importlib.import_module(self.__name__)
        return getattr(self._real, attribute)


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the deferred packages and their submodules where the import system would, and
    makes a ``Deferred`` of each instead of running its code."""

    def __init__(self, packages: Sequence[str]):
        self.packages = tuple(packages)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not any(name == package or name.startswith(package + ".") for package in self.packages):
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, self, is_package=real.submodule_search_locations is not None)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return Deferred(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_deferring: _Placeholders | None = None


@contextlib.contextmanager
def deferred(packages: Sequence[str]) -> Iterator[None]:
    """While the block runs, importing ``packages`` (those not loaded yet) or their submodules
    binds ``Deferred`` placeholders instead of loading them."""
    global _deferring
    waiting = [package for package in packages if package not in sys.modules]
    if not waiting or _deferring is not None:
        yield
        return
    _deferring = _Placeholders(waiting)
    sys.meta_path.insert(0, _deferring)
    try:
        yield
    finally:
        _stop_deferring()


def _stop_deferring() -> None:
    global _deferring
    if _deferring is not None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_deferring)
        _deferring = None
    for name, module in list(sys.modules.items()):
        if isinstance(module, Deferred):
            del sys.modules[name]
