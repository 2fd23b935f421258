"""Module paths of earlier releases, still importable: foldsweep 0.1.0's (one flat package), and
the engine's before its modules were named after the fold layouts (``pipeline.engine.trial``,
``training``, ``fused``).

Ray Tune pickles a sweep's callbacks and their settings with the module paths of their classes
(``pipeline.tracking.MlflowTrialCallback``, ``pipeline.spec.Objective``...), and ``--resume``
unpickles them, so a sweep recorded before the package was split into layers must still find
them there. Scripts written against the old paths keep working too. An old path is a module of
its own that hands on, by name, what its new homes define (a name that changed with its module
by its new name, ``OLD_NAMES``); it is made on first import only, so nothing heavy loads before
something asks for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

# old module -> the modules its names live in now, searched in order
OLD_PATHS: dict[str, tuple[str, ...]] = {
    **{
        f"pipeline.{name}": (f"pipeline.base.{name}",)
        for name in ("errors", "quiet", "environment", "private_hooks", "compile_cache")
    },
    **{
        f"pipeline.{name}": (f"pipeline.inputs.{name}",)
        for name in ("spec", "space", "hypermodel", "losses", "datasets", "protein", "folds")
    },
    **{f"pipeline.{name}": (f"pipeline.contract.{name}",) for name in ("plan", "results")},
    **{
        f"pipeline.{name}": (f"pipeline.engine.{name}",)
        for name in ("stacked", "resident", "runtime", "lifespan", "stopping")
    },
    "pipeline.trainer": ("pipeline.engine.trainer", "pipeline.engine.fold_engine"),
    "pipeline.trial": ("pipeline.engine.runner", "pipeline.engine.trainable"),
    "pipeline.fused": ("pipeline.engine.side_by_side",),
    "pipeline.training": (
        "pipeline.engine.fold_engine",
        "pipeline.engine.compiled_loop",
        "pipeline.engine.sequential",
        "pipeline.engine.recipe",
    ),
    **{
        f"pipeline.{name}": (f"pipeline.records.{name}",)
        for name in ("stores", "report", "significance", "plots", "publish", "progress")
    },
    "pipeline.tracking": ("pipeline.records.tracking", "pipeline.records.callbacks"),
    # the engine's modules named after the fold layouts (after 31e017e)
    "pipeline.engine.fused": ("pipeline.engine.side_by_side",),
    "pipeline.engine.training": (
        "pipeline.engine.fold_engine",
        "pipeline.engine.compiled_loop",
        "pipeline.engine.sequential",
    ),
    "pipeline.engine.trial": ("pipeline.engine.runner", "pipeline.engine.trainable"),
}
# Names that changed with their module: old module -> {old name: its name now}.
OLD_NAMES: dict[str, dict[str, str]] = {
    **{module: {"FusedFolds": "SideBySideFolds"} for module in ("pipeline.fused", "pipeline.engine.fused")},
}


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of ``OLD_PATHS`` and makes each a module that forwards to its new homes."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _forwarding_module(spec.name, OLD_PATHS[spec.name], OLD_NAMES.get(spec.name, {}))

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _forwarding_module(name: str, homes: tuple[str, ...], renamed: dict[str, str]) -> types.ModuleType:
    module = types.ModuleType(name, f"Moved: its names now live in {', '.join(homes)}.")

    def forward(attribute: str) -> Any:
        if attribute.startswith("__"):  # the import system's own questions (__path__...)
            raise AttributeError(attribute)
        for home in homes:
            found = getattr(importlib.import_module(home), renamed.get(attribute, attribute), _MISSING)
            if found is not _MISSING:
                return found
        raise AttributeError(f"module {name!r} (moved to {', '.join(homes)}) has no attribute {attribute!r}")

    vars(module)["__getattr__"] = forward  # PEP 562: asked for every name the module does not hold
    return module


_MISSING = object()


def install() -> None:
    """Make the old paths importable in this process (once)."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
