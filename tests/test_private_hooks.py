"""The private hooks into Ray, MLflow, Keras and TensorFlow (pipeline/base/private_hooks.py): all hold
on the locked versions, a renamed one is named with its library's version, every private name the
package touches is listed, no module but the library's adapter (pipeline/base/<library>_private.py)
touches one, and a command with a hook missing stops before it starts anything."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from pipeline.base import mlflow_private, private_hooks
from pipeline.base.private_hooks import (
    FALLBACK_LIBRARIES,
    HOOKED_LIBRARIES,
    HOOKS,
    PrivateHookMissing,
    broken_hooks,
    require_hooks,
)

PACKAGE = Path(private_hooks.__file__).parents[1]


@pytest.fixture(autouse=True)
def held_records(monkeypatch, tmp_path):
    """The records of held hooks kept in the test's own directory, empty at its start."""
    records = tmp_path / "hooks-held"
    monkeypatch.setattr(private_hooks, "held_records", lambda: records)
    return records


def test_every_hook_says_what_users_gain_from_it():
    assert [hook.place for hook in HOOKS if len(hook.gain.split()) < 8] == []


def test_every_hook_holds_on_the_installed_versions():
    assert broken_hooks() == []
    assert broken_hooks(FALLBACK_LIBRARIES) == []
    assert {hook.library for hook in HOOKS} == {"ray", "mlflow", "keras", "tensorflow", "python"}


@pytest.mark.parametrize(("module", "name"), [("atexit", "_run_exitfuncs"), ("threading", "_shutdown")])
def test_a_missing_python_exit_function_is_named_with_pythons_version(monkeypatch, module, name):
    import platform

    monkeypatch.delattr(importlib.import_module(module), name)
    assert broken_hooks(FALLBACK_LIBRARIES) == [
        f"foldsweep relies on python {platform.python_version()}'s threading._shutdown, atexit._run_exitfuncs and "
        "os._exit so that a command ends without tearing the interpreter down, its threads stopped and its atexit "
        "handlers run (pipeline.base.processes.leave; without them it exits as Python does, freeing every module "
        "first), but "
        f"{module}.{name} is missing"
    ]


def test_a_renamed_ray_method_is_named_with_rays_version(monkeypatch):
    from ray.tune.execution.tune_controller import TuneController

    monkeypatch.setattr(private_hooks, "_HELD", set())  # as in a process that has not checked Ray yet
    monkeypatch.delattr(TuneController, "_maybe_cache_trial_actor")
    with pytest.raises(PrivateHookMissing) as raised:
        require_hooks(["ray"])
    message = str(raised.value)
    assert f"ray {metadata.version('ray')}'s" in message
    assert "ray.tune.execution.tune_controller.TuneController._maybe_cache_trial_actor is missing" in message
    assert "install the locked versions (make install, from uv.lock)" in message and "\n" not in message


def test_each_librarys_hooks_are_checked_once_per_installation(monkeypatch, held_records):
    """A library's hooks that held are not checked again, in this process or in a new one of the
    same installation (nothing changes a library but reinstalling it); in another installation
    (another version, or its files reinstalled) they are, and a broken one is refused every time."""
    from ray.tune.execution.tune_controller import TuneController

    monkeypatch.setattr(private_hooks, "_HELD", set())
    require_hooks(["ray"])
    assert private_hooks._HELD == {"ray"}
    identity = private_hooks.installation_identity()
    assert sorted(path.name for path in held_records.iterdir()) == [f"ray-{identity}"]
    monkeypatch.delattr(TuneController, "_maybe_cache_trial_actor")
    require_hooks(["ray"])  # held: not checked again
    monkeypatch.setattr(private_hooks, "_HELD", set())  # a new process of the same installation
    require_hooks(["ray"])
    assert private_hooks._HELD == {"ray"}
    monkeypatch.setattr(private_hooks, "_HELD", {"mlflow"})
    monkeypatch.setattr(private_hooks, "installation_identity", lambda: "another-installation")
    for _ in range(2):
        with pytest.raises(PrivateHookMissing, match="_maybe_cache_trial_actor is missing"):
            require_hooks(["mlflow", "ray"])
    assert private_hooks._HELD == {"mlflow"}
    assert sorted(path.name for path in held_records.iterdir()) == [f"ray-{identity}"]


def test_an_installation_is_told_apart_by_versions_and_installed_files(monkeypatch):
    identity = private_hooks.installation_identity()
    assert private_hooks.installation_identity() == identity and len(identity) == 32
    monkeypatch.setattr(
        private_hooks, "installed_version", lambda library: "0.0" if library == "mlflow" else metadata.version(library)
    )
    assert private_hooks.installation_identity() != identity
    monkeypatch.setattr(private_hooks, "installed_version", metadata.version)
    assert private_hooks.installation_identity() == identity
    real = metadata.distribution

    class Rebuilt:  # the same version, another build: its RECORD lists other hashes
        version = real("keras").version

        def read_text(self, name):
            return real("keras").read_text(name).replace("=", "=rebuilt", 1)

    monkeypatch.setattr(metadata, "distribution", lambda name: Rebuilt() if name == "keras" else real(name))
    assert private_hooks.installation_identity() != identity


def test_a_cache_that_cannot_be_written_leaves_the_hooks_checked_each_time(monkeypatch, tmp_path):
    from ray.tune.execution.tune_controller import TuneController

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(private_hooks, "held_records", lambda: tmp_path / "file" / "hooks-held")
    monkeypatch.setattr(private_hooks, "_HELD", set())
    require_hooks(["ray"])
    monkeypatch.setattr(private_hooks, "_HELD", set())
    monkeypatch.delattr(TuneController, "_maybe_cache_trial_actor")
    with pytest.raises(PrivateHookMissing, match="_maybe_cache_trial_actor is missing"):
        require_hooks(["ray"])


def test_a_ray_method_with_another_signature_is_refused(monkeypatch):
    from ray.tune.execution.tune_controller import TuneController

    monkeypatch.setattr(TuneController, "_maybe_cache_trial_actor", lambda self, trial, reason: False)
    assert broken_hooks(["ray"]) == [
        f"foldsweep relies on ray {metadata.version('ray')}'s "
        "ray.tune.execution.tune_controller.TuneController._maybe_cache_trial_actor so that a worker that retires "
        "(max_trials_per_worker) ends with its trial instead of being reused, but "
        "TuneController._maybe_cache_trial_actor no longer takes (self, trial)"
    ]


# The chart view's names as the UI's scripts hold them.
CHART_STATE = " ".join(f"state.{name};" for name in mlflow_private.MLFLOW_VIEW_STATE_NAMES)


def test_an_mlflow_ui_without_the_shared_view_tag_is_named(monkeypatch, tmp_path):
    script = tmp_path / "main.js"
    script.write_text(f'const key = params.get("viewStateShareKey"); tags["mlflow.viewState." + key]; {CHART_STATE}')
    monkeypatch.setattr(mlflow_private, "mlflow_ui_scripts", lambda: [script])
    problems = broken_hooks(["mlflow"])
    assert len(problems) == 1
    assert f"mlflow {metadata.version('mlflow')}'s the experiment tag mlflow.sharedViewState.<key>" in problems[0]
    assert problems[0].endswith("but the MLflow UI no longer reads mlflow.sharedViewState.")


def test_the_real_mlflow_ui_reads_the_tag_foldsweep_writes():
    from pipeline.records.tracking import MLFLOW_SHARED_VIEW_TAG

    scripts = mlflow_private.mlflow_ui_scripts()
    assert scripts and any(MLFLOW_SHARED_VIEW_TAG in script.read_text(errors="replace") for script in scripts)


def an_mlflow_directory(root: Path, *, variables: str) -> Path:
    """What MLflow's hooks read of its installation, with ``variables`` as its environment_variables.py."""
    (root / "store" / "tracking" / "dbmodels").mkdir(parents=True)
    (root / "store" / "tracking" / "dbmodels" / "models.py").write_text(
        '__tablename__ = "experiments"\n__tablename__ = "runs"\n'
    )
    (root / "server" / "js" / "build" / "static" / "js").mkdir(parents=True)
    (root / "server" / "js" / "build" / "static" / "js" / "main.js").write_text(
        f'params.get("viewStateShareKey"); tags["mlflow.sharedViewState." + key]; {CHART_STATE}'
    )
    (root / "environment_variables.py").write_text(variables)
    return root


def test_an_mlflow_without_the_job_execution_switch_is_named(monkeypatch, tmp_path):
    renamed = an_mlflow_directory(
        tmp_path, variables='MLFLOW_ENABLE_JOB_EXECUTION = _BooleanEnvironmentVariable("x", True)\n'
    )
    monkeypatch.setattr(mlflow_private, "mlflow_directory", lambda: renamed)
    problems = broken_hooks(["mlflow"])
    assert len(problems) == 1
    assert problems[0].endswith(
        "so that `foldsweep ui` starts no GenAI job runner processes, but "
        "mlflow.environment_variables.MLFLOW_SERVER_ENABLE_JOB_EXECUTION is missing"
    )


def test_an_mlflow_with_the_job_execution_switch_defined_passes(monkeypatch, tmp_path):
    kept = an_mlflow_directory(
        tmp_path, variables='MLFLOW_SERVER_ENABLE_JOB_EXECUTION = _BooleanEnvironmentVariable(\n    "x", True\n)\n'
    )
    monkeypatch.setattr(mlflow_private, "mlflow_directory", lambda: kept)
    assert broken_hooks(["mlflow"]) == []


def test_checking_mlflows_hooks_loads_no_mlflow():
    """They run before Ray starts, where importing MLflow would delay Ray and a new store's making
    beside it: a process of its own, as what is tested is what the process loads."""
    code = (
        "import json, sys; from pipeline.base.private_hooks import broken_hooks; "
        "problems = broken_hooks(['mlflow']); "
        "print(json.dumps([problems, sorted(name for name in sys.modules if name.split('.')[0] == 'mlflow')]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    problems, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert problems == []
    assert loaded == []


def test_keras_keeping_loss_weights_elsewhere_is_named(monkeypatch):
    without_keras_hook(monkeypatch)
    try:
        problems = broken_hooks(["keras"])
    finally:
        private_hooks._probe_models.cache_clear()
    assert problems == [
        f"foldsweep relies on keras {metadata.version('keras')}'s model._compile_loss._user_loss_weights so that "
        "compile(loss_weights=...) is refused instead of silently trained unweighted, but a model compiled with "
        "loss_weights=[0.5] no longer shows them as _compile_loss._user_loss_weights"
    ]


def test_tensorflow_refusing_a_second_definition_under_one_name_is_named(monkeypatch):
    """Were TensorFlow to tell two traces apart by their custom-gradient names, a worker's second
    trial of a program would fail: the check traces one twice, as a worker does."""
    from pipeline.base import tensorflow_private

    monkeypatch.setattr(tensorflow_private, "GRADIENT_OP_TYPE", "_not_the_gradient_name")
    [problem] = broken_hooks(["tensorflow"])
    assert problem.startswith(
        f"foldsweep relies on tensorflow {metadata.version('tensorflow')}'s "
        "atomic_function.from_func_graph(name, graph)"
    )
    assert "two traces of one function are named __inference_" in problem and "not after their graph" in problem


def test_a_check_that_fails_itself_is_reported_not_raised(monkeypatch):
    def failing() -> str | None:
        raise TypeError("unexpected keyword argument")

    monkeypatch.setattr(private_hooks, "HOOKS", (dataclasses.replace(HOOKS[0], check=failing),))
    assert broken_hooks()[0].endswith("but checking it failed: TypeError: unexpected keyword argument")


# The modules of the hooked libraries that are not their public API, though no part of their path
# starts with an underscore.
INTERNAL_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow.tsl")
# The only modules that may use a private name of a hooked library: its adapter, and the checks.
ADAPTERS = ("ray_private", "keras_private", "tensorflow_private", "mlflow_private", "private_hooks")


def _private_parts(path: str) -> list[str]:
    """The parts of a hooked library's dotted module path that start with an underscore."""
    parts = path.split(".")
    if parts[0] not in HOOKED_LIBRARIES or not all(part.isidentifier() for part in parts):
        return []
    return [part for part in parts if part.startswith("_") and not part.startswith("__")]


def _internal(path: str) -> bool:
    return all(part.isidentifier() for part in path.split(".")) and any(
        path == internal or path.startswith(internal + ".") for internal in INTERNAL_MODULES
    )


def _module_names(path: str) -> list[str]:
    """What importing a hooked library's module ``path`` uses of its private names: the parts that
    start with an underscore, and the path itself where it is an internal module."""
    return _private_parts(path) + ([path] if _internal(path) else [])


def private_uses(source: str) -> dict[str, int]:
    """What one module uses of names private to other code (name -> first line): attributes read
    or set on objects that are not its own (neither a function, class or annotated name it defines
    nor an attribute it sets on self or cls), by name or through getattr, hasattr and setattr;
    names with a leading underscore it imports from a hooked library, and the paths of the
    libraries' private modules it imports or names in a string (all of the string: a module path)."""
    tree = ast.parse(source)
    own: set[str] = set()
    used: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            names = [node.args[1].value]
        elif isinstance(node, ast.Import):
            names = [name for alias in node.names for name in _module_names(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in HOOKED_LIBRARIES:
                names = _module_names(node.module) + [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            path = node.value.rstrip(".")
            names = [node.value] if _private_parts(path) or _internal(path) else []
        for name in names:
            if (name.startswith("_") and not name.startswith("__")) or "." in name:
                used.setdefault(name, node.lineno)
    return {name: line for name, line in used.items() if name not in own}


def package_sources() -> dict[str, str]:
    """Each module of the package (its path in the package) and its source."""
    return {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def _private_names_used() -> dict[str, str]:
    """Private names the package uses of code that is not its own (name -> where)."""
    used: dict[str, str] = {}
    for path, source in package_sources().items():
        for name, line in private_uses(source).items():
            if name.startswith("_"):
                used.setdefault(name, f"{path}:{line}")
    return used


def private_uses_outside_the_adapters(sources: dict[str, str]) -> list[tuple[str, str]]:
    """What modules other than the adapters use of the hooked libraries' private names and
    modules, (where, name) in order: everything ``private_uses`` finds but Python's own hooked names."""
    python_names = {name for hook in HOOKS if hook.library not in HOOKED_LIBRARIES for name in hook.names}
    return sorted(
        (f"{path}:{line}", name)
        for path, source in sources.items()
        if Path(path).stem not in ADAPTERS
        for name, line in private_uses(source).items()
        if name not in python_names
    )


def test_every_private_name_the_package_uses_is_guarded():
    guarded = {name for hook in HOOKS for name in hook.names}
    unguarded = {name: where for name, where in _private_names_used().items() if name not in guarded}
    assert unguarded == {}, f"list these in pipeline/base/private_hooks.py with a check: {unguarded}"
    assert guarded <= set(_private_names_used()), "a hook lists a name the package no longer uses"


def test_only_the_adapters_use_the_hooked_libraries_private_names():
    outside = private_uses_outside_the_adapters(package_sources())
    assert outside == [], f"move these into pipeline/base/<library>_private.py: {outside}"


def test_a_private_name_used_outside_the_adapters_is_found():
    elsewhere = """\"\"\"A module that reaches into Ray, TensorFlow and Keras itself.\"\"\"
import os
from ray._private import node
from tensorflow.python.framework import ops
from ray.tune.search.basic_variant import _TrialIterator

BACKEND = "keras.src.backend.tensorflow.random"


class Own:
    def __init__(self):
        self._kept = 1

    def read(self, model):
        os._exit(0)
        return self._kept, model._flatten_layers(), getattr(ops, "_registry")
"""
    sources = {**package_sources(), "engine/elsewhere.py": elsewhere}
    assert private_uses_outside_the_adapters(sources) == [
        ("engine/elsewhere.py:16", "_flatten_layers"),
        ("engine/elsewhere.py:16", "_registry"),
        ("engine/elsewhere.py:3", "_private"),
        ("engine/elsewhere.py:4", "tensorflow.python.framework"),
        ("engine/elsewhere.py:5", "_TrialIterator"),
        ("engine/elsewhere.py:7", "keras.src.backend.tensorflow.random"),
    ]


@pytest.fixture
def workspace(tmp_path):
    """A tiny spec, its data and experiment; returns the spec's path."""
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "data.npz", x=rng.normal(size=(40, 8, 1)).astype(np.float32), y=(np.arange(40) % 2).astype(np.int32)
    )
    (tmp_path / "model.py").write_text(
        "import keras\ndef build(hp):\n    return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(2, activation='softmax')])\n"
    )
    spec = {
        "name": "hooked",
        "experiment": "model.py",
        "dataset": "data.npz",
        "cv": {"n_splits": 2},
        "search": {"space": {"batch_size": 8}},
        "train": {"epochs": 1},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'store.db'}"},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "spec.yaml"


def without_ray_hook(monkeypatch):
    from ray.tune.execution.tune_controller import TuneController

    monkeypatch.delattr(TuneController, "_maybe_cache_trial_actor")
    monkeypatch.setattr(private_hooks, "_HELD", set())  # the hooks checked again, as by a new process
    return "error: foldsweep relies on ray", "TuneController._maybe_cache_trial_actor is missing"


def without_keras_hook(monkeypatch):
    from keras.src.trainers.compile_utils import CompileLoss

    keep = CompileLoss.__init__

    def renamed(self, *args, **kwargs):
        keep(self, *args, **kwargs)
        self._loss_weights_by_output = self.__dict__.pop("_user_loss_weights")

    monkeypatch.setattr(CompileLoss, "__init__", renamed)
    private_hooks._probe_models.cache_clear()
    monkeypatch.setattr(private_hooks, "_HELD", set())
    return "error: foldsweep relies on keras", "no longer shows them as _compile_loss._user_loss_weights"


@pytest.mark.parametrize("command, breaking", [("run", without_ray_hook), ("trial", without_keras_hook)])
def test_a_command_with_a_hook_missing_exits_1_with_one_line_before_anything_starts(
    without_ray, threads_kept, monkeypatch, workspace, command, breaking
):
    import ray

    from pipeline.cli import app

    before = sorted(path.name for path in workspace.parent.iterdir())
    start, missing = breaking(monkeypatch)
    try:
        result = CliRunner().invoke(app, [command, str(workspace)])
    finally:
        private_hooks._probe_models.cache_clear()

    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start) and missing in lines[0], result.output
    assert not ray.is_initialized()
    assert sorted(path.name for path in workspace.parent.iterdir()) == before


@pytest.mark.training
def test_trial_needs_no_ray_hook(threads_kept, monkeypatch, workspace):
    from pipeline.cli import app

    without_ray_hook(monkeypatch)
    result = CliRunner().invoke(app, ["trial", str(workspace)])
    assert result.exit_code == 0, result.output
    assert "status: ok" in result.output and "epoch 1: fold 0" in result.output
