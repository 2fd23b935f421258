"""The package's layers (pipeline/*/__init__.py say what each may import) hold in the code, and
the records layer loads neither Ray nor TensorFlow."""

from __future__ import annotations

import ast
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
LAYERS = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
COMMANDS = "commands"  # the modules right in pipeline/
COMMAND_MODULES = ("checks", "cli", "refit", "rerun", "sweep", "terminal")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in LAYERS else COMMANDS


def allowed_layers() -> dict[str, set[str]]:
    """Each layer's ``May import:`` line, and itself."""
    allowed = {}
    for layer in LAYERS:
        docstring = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text())) or ""
        found = re.search(r"^May import: (.*)$", docstring, re.MULTILINE)
        assert found, f"pipeline/{layer}/__init__.py does not say what the layer may import"
        named = re.findall(r"pipeline\.(\w+)", found.group(1))
        assert set(named) <= set(LAYERS), f"pipeline/{layer}: unknown layers {set(named) - set(LAYERS)}"
        allowed[layer] = {layer, *named}
    return allowed


def imports_of(source: str, module: str) -> set[str]:
    """Every foldsweep module ``source`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("pipeline")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
            # ``from pipeline.base import errors`` imports pipeline.base.errors
            found |= {
                f"{node.module}.{alias.name}"
                if layer_of(node.module) and node.module.count(".") == 1 and node.module.split(".")[1] in LAYERS
                else node.module
                for alias in node.names
            }
    return {name for name in found if name != module}


def package_imports() -> dict[str, set[str]]:
    return {
        module_name(path): imports_of(path.read_text(), module_name(path)) for path in sorted(PACKAGE.rglob("*.py"))
    }


def arrows_back_up(imports: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a layer's module that its layer may not make."""
    wrong = []
    for module, imported in imports.items():
        layer = layer_of(module)
        if layer in (None, COMMANDS):
            continue
        wrong += [f"{module} -> {name}" for name in sorted(imported) if layer_of(name) not in allowed[layer]]
    return wrong


def cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in sorted(imports.get(module, ())):
            if state.get(name) == "open":
                found.append(path[path.index(name) :] + [name] if name in path else [module, name])
            elif name not in state and name in imports:
                visit(name, path + [name])
        state[module] = "done"

    for module in sorted(imports):
        if module not in state:
            visit(module, [module])
    return found


def test_every_module_lives_in_a_layer_or_is_a_command():
    top = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")
    assert top == sorted(COMMAND_MODULES)
    assert LAYERS == ["base", "contract", "engine", "inputs", "records"]


def test_no_import_runs_back_up_a_layer_and_there_are_no_cycles():
    imports = package_imports()
    assert arrows_back_up(imports, allowed_layers()) == []
    assert cycles(imports) == []
    # inside the package, only the new paths (pipeline.base.old_paths serves what others wrote)
    old = {
        name
        for names in imports.values()
        for name in names
        if layer_of(name) == COMMANDS and name.split(".")[1] not in COMMAND_MODULES
    }
    assert old == set()


def test_the_check_names_an_import_that_runs_back_up():
    imports = {
        **package_imports(),
        "pipeline.inputs.spec": {"pipeline.base.errors", "pipeline.engine.runner"},
        "pipeline.records.report": {"pipeline.engine.trainer", "pipeline.contract.results"},
        "pipeline.base.quiet": {"pipeline.sweep"},
    }
    assert sorted(arrows_back_up(imports, allowed_layers())) == [
        "pipeline.base.quiet -> pipeline.sweep",
        "pipeline.inputs.spec -> pipeline.engine.runner",
        "pipeline.records.report -> pipeline.engine.trainer",
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def fresh_interpreter(code: str) -> str:
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


@pytest.mark.e2e
def test_the_reports_load_neither_ray_nor_tensorflow():
    """A fresh interpreter: the only way to see what importing a module loads."""
    loaded = json.loads(
        fresh_interpreter(
            "import json, sys\n"
            "import pipeline.records.report, pipeline.records.plots, pipeline.records.publish\n"
            "import pipeline.records.significance, pipeline.records.tracking\n"
            "print(json.dumps(sorted(name for name in sys.modules)))"
        )
    )
    heavy = sorted(name for name in loaded if name.split(".")[0] in ("ray", "tensorflow", "keras", "mlflow"))
    assert heavy == []
    assert "pipeline.records.plots" in loaded and "pipeline.records.callbacks" not in loaded


@pytest.mark.e2e
def test_sweeps_pickled_under_the_old_module_paths_still_load():
    """What Ray Tune pickled in a 0.1.0 sweep (its callbacks' classes, by module path) loads."""
    from pipeline.contract.results import EpochSelection
    from pipeline.inputs.spec import Objective
    from pipeline.records.callbacks import MlflowTrialCallback

    # Protocol 2 names a class by a text line, "module\nname", so the old path can be written in.
    old = pickle.dumps([Objective("loss", "min"), EpochSelection(Objective(), "last")], protocol=2)
    old = old.replace(b"pipeline.inputs.spec\n", b"pipeline.spec\n")
    old = old.replace(b"pipeline.contract.results\n", b"pipeline.results\n")
    assert b"pipeline.spec" in old and b"pipeline.inputs" not in old
    loaded = json.loads(
        fresh_interpreter(
            f"import json, pickle\nvalue = pickle.loads({old!r})\n"
            "import pipeline.tracking, pipeline.training\n"
            "print(json.dumps([repr(value), pipeline.tracking.MlflowTrialCallback.__module__,"
            " pipeline.training.TrainingParams.__module__, pipeline.tracking.Tracker.__module__]))"
        )
    )
    assert loaded == [
        repr([Objective("loss", "min"), EpochSelection(Objective(), "last")]),
        MlflowTrialCallback.__module__,
        "pipeline.engine.recipe",
        "pipeline.records.tracking",
    ]
