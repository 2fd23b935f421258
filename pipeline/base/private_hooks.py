"""Every place foldsweep relies on a library's private or undocumented behaviour, each with a check.

A Ray, MLflow, Keras or TensorFlow release (or CPython's) may rename or change what foldsweep reaches
into without notice. Each ``Hook`` names the place, what foldsweep uses it for, what users gain from
it (what a hook costs to keep is weighed against that) and the private names it covers (a test fails
on a private name the package touches that no hook lists). Only the library's adapter uses them
(``ray_private``, ``keras_private``, ``tensorflow_private``, ``mlflow_private``), and the checks
here; ``require_hooks`` runs every check of ``HOOKED_LIBRARIES`` before a command starts anything,
once per installation (exit 1, one line naming the library version and what is missing), never
mid-sweep, and ``tests/test_private_hooks.py`` runs them all in CI against the locked versions,
``FALLBACK_LIBRARIES``' too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import os
import platform
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.base import mlflow_private
from pipeline.base.collector import collector_paused
from pipeline.base.environment import cache_directory, installed_version
from pipeline.base.errors import FoldsweepError
from pipeline.base.keras_private import (
    AFFINE_LAYERS,
    AFFINE_TRANSFORM,
    AFFINE_TRANSFORM_PARAMETERS,
    COUNTER_DRAWN_LAYERS,
    KERAS_IMAGE_MODULE,
    KERAS_RANDOM_DRAWS,
    KERAS_RANDOM_MODULE,
    PREPROCESSING_MODULE,
    compile_arguments,
    holds_seed_generator,
    is_preprocessing_layer,
    weight_decay_exclusions,
)
from pipeline.base.mlflow_private import (
    MLFLOW_JOB_EXECUTION_VARIABLE,
    MLFLOW_SHARED_VIEW_PARAM,
    MLFLOW_SHARED_VIEW_TAG,
    MLFLOW_STORE_TABLES,
    MLFLOW_VIEW_STATE_NAMES,
)
from pipeline.base.ray_private import DASHBOARD_AGENT_COMMAND, RAY_OUTPUT_ENGINE_VARIABLE
from pipeline.base.tensorflow_private import has_xla_kernel

HOOKED_LIBRARIES = ("ray", "mlflow", "keras", "tensorflow")
# Checked by the tests, never before a command: what relies on it falls back to Python's own way.
FALLBACK_LIBRARIES = ("python",)
# What a process that trains (trial, rerun) relies on; Ray Tune and MLflow it does not use.
TRAINING_LIBRARIES = ("keras", "tensorflow")


class PrivateHookMissing(FoldsweepError):
    """An installed library lacks a private hook foldsweep relies on (exit 1)."""


@dataclass(frozen=True)
class Hook:
    """One place foldsweep relies on a library's private or undocumented behaviour."""

    library: str  # the distribution whose version the message names
    place: str  # what foldsweep reaches into
    used_for: str  # what goes wrong without it
    names: tuple[str, ...]  # the private names of that library that foldsweep's code uses for it
    check: Callable[[], str | None]  # what changed, or None when the hook still holds
    gain: str  # what users gain from it, as large as it was measured where it was


def _attribute(module: str, qualified: str) -> Any:
    """What ``module.qualified`` names: any object, looked at by what it is found to be."""
    target: Any = importlib.import_module(module)
    for part in qualified.split("."):
        target = getattr(target, part)
    return target


def _missing(module: str, qualified: str) -> str | None:
    try:
        _attribute(module, qualified)
    except (ImportError, AttributeError):
        return f"{module}.{qualified} is missing"
    return None


def _parameters(function: Callable[..., object]) -> list[str]:
    return list(inspect.signature(function).parameters)


# -- Ray ------------------------------------------------------------------------------------------


def _check_actor_caching() -> str | None:
    module, method = "ray.tune.execution.tune_controller", "TuneController._maybe_cache_trial_actor"
    if problem := _missing(module, method):
        return problem
    controller = _attribute(module, "TuneController")
    if _parameters(controller._maybe_cache_trial_actor) != ["self", "trial"]:
        return f"{method} no longer takes (self, trial)"
    if "self._maybe_cache_trial_actor(" not in inspect.getsource(controller):
        return f"TuneController no longer calls {method.split('.')[1]}"
    return None


def _check_restored_callbacks() -> str | None:
    from ray import tune

    if "_local_tuner" not in getattr(tune.Tuner, "__annotations__", {}):
        return "ray.tune.Tuner._local_tuner is missing"
    if problem := _missing("ray.tune.impl.tuner_internal", "TunerInternal.get_run_config"):
        return problem
    if "callbacks" not in _parameters(tune.RunConfig):
        return "ray.tune.RunConfig no longer takes callbacks"
    return None


def _check_moved_sweep() -> str | None:
    if problem := _missing("ray.train._internal.storage", "StorageContext"):
        return problem
    internal = _attribute("ray.tune.impl.tuner_internal", "TunerInternal")
    if "search_alg=self._tune_config.search_alg" not in inspect.getsource(internal):
        return "TunerInternal no longer runs self._tune_config.search_alg"
    storage = inspect.getsource(_attribute("ray.train._internal.storage", "StorageContext"))
    for attribute in ("storage_fs_path", "experiment_dir_name"):
        if f"self.{attribute} =" not in storage:
            return f"StorageContext no longer keeps {attribute}"
    return None


def _check_variant_generator() -> str | None:
    module = "ray.tune.search.basic_variant"
    for problem in (
        _missing(module, "_TrialIterator"),
        _missing(module, "_VariantIterator"),
        _missing("ray.tune.experiment", "_convert_to_experiment_list"),
    ):
        if problem:
            return problem
    trial_iterator = _attribute(module, "_TrialIterator")
    wanted = {"uuid_prefix", "num_samples", "unresolved_spec", "start", "random_state"}
    if not wanted <= set(_parameters(trial_iterator)):
        return f"_TrialIterator no longer takes {', '.join(sorted(wanted - set(_parameters(trial_iterator))))}"
    if "self.variants and self.variants.has_next()" not in inspect.getsource(trial_iterator.__next__):
        return "_TrialIterator no longer makes its trials of self.variants first"
    state = vars(_attribute(module, "BasicVariantGenerator")())
    missing = [
        name
        for name in ("_iterators", "_trial_generator", "_total_samples", "_random_state", "_uuid_prefix")
        if name not in state
    ]
    return f"BasicVariantGenerator no longer keeps {', '.join(missing)}" if missing else None


def _check_output_engine_switch() -> str | None:
    source = inspect.getsource(importlib.import_module("ray.tune.experimental.output"))
    if RAY_OUTPUT_ENGINE_VARIABLE not in source:
        return f"ray.tune.experimental.output no longer reads {RAY_OUTPUT_ENGINE_VARIABLE}"
    return None


def _check_workers_started_ahead() -> str | None:
    from ray import JobID
    from ray.tune.execution import class_cache

    if not isinstance(getattr(class_cache, "DEFAULT_ENV_VARS", None), dict):
        return "ray.tune.execution.class_cache.DEFAULT_ENV_VARS is missing"
    if "DEFAULT_ENV_VARS" not in inspect.getsource(class_cache._ActorClassCache.get):
        return "ray.tune.execution.class_cache._ActorClassCache.get no longer reads DEFAULT_ENV_VARS"
    if "worker_preload_modules" not in inspect.getsource(
        importlib.import_module("ray._private.workers.default_worker")
    ):
        return "Ray's workers no longer load the modules of RAY_preload_python_modules as they start"
    if not callable(getattr(JobID, "nil", None)):
        return "ray.JobID.nil is missing"
    return None


def _check_lean_head() -> str | None:
    from ray._private import node, services

    start = getattr(node.Node, "start_api_server", None)
    if not callable(start) or not {"include_dashboard", "raise_on_failure"} <= set(_parameters(start)):
        return "ray._private.node.Node.start_api_server(include_dashboard, raise_on_failure) is missing"
    head_source = inspect.getsource(node.Node.start_head_processes)
    if "self.start_api_server(" not in head_source:
        return "Node.start_head_processes no longer starts the API server through start_api_server"
    if "if not self._ray_params.no_monitor:" not in head_source:
        return "Node.start_head_processes no longer skips the monitor on RayParams.no_monitor"
    if "if self._ray_params.include_log_monitor:" not in inspect.getsource(node.Node.start_ray_processes):
        return "Node.start_ray_processes no longer skips the log monitor on RayParams.include_log_monitor"
    node_source = inspect.getsource(node.Node)
    for kept in ("self._webui_url", "self._session_dir", "self._node_id", "def _get_unused_port(self"):
        if kept not in node_source:
            return f"ray._private.node.Node no longer has {kept}"
    raylet = importlib.import_module("ray._raylet")
    for name in (
        "persist_port",
        "METRICS_AGENT_PORT_NAME",
        "METRICS_EXPORT_PORT_NAME",
        "DASHBOARD_AGENT_LISTEN_PORT_NAME",
    ):
        if not hasattr(raylet, name):
            return f"ray._raylet.{name} is missing"
    raylet_start = inspect.getsource(services.start_raylet)
    if '"--minimal"' not in raylet_start:
        return "ray._private.services.start_raylet no longer starts a minimal dashboard agent"
    if f'"{DASHBOARD_AGENT_COMMAND}{{}}"' not in raylet_start or not callable(
        getattr(services, "start_ray_process", None)
    ):
        return "ray._private.services.start_raylet no longer gives the raylet its dashboard agent's command"
    if "start_ray_process(" not in raylet_start or "ray_constants.PROCESS_TYPE_RAYLET" not in raylet_start:
        return "ray._private.services.start_raylet no longer starts the raylet through start_ray_process"
    agent = inspect.getsource(importlib.import_module("ray.dashboard.agent"))
    if agent.count("-1,\n") < 2 or "self.listen_port if self.http_server and launch_http_server else -1" not in agent:
        return "ray.dashboard.agent no longer writes -1 for the ports a minimal agent does not serve"
    return None


def _check_internal_kv() -> str | None:
    module = "ray.experimental.internal_kv"
    for function in ("_internal_kv_initialized", "_internal_kv_put", "_internal_kv_get", "_internal_kv_del"):
        if problem := _missing(module, function):
            return problem
    for function, wanted in (
        ("_internal_kv_put", ("key", "value", "overwrite", "namespace")),
        ("_internal_kv_get", ("key", "namespace")),
        ("_internal_kv_del", ("key", "namespace")),
    ):
        if not set(wanted) <= set(_parameters(_attribute(module, function))):
            return f"{module}.{function} no longer takes {', '.join(wanted)}"
    return None


# -- MLflow ---------------------------------------------------------------------------------------
# MLflow's hooks read its files instead of importing them: the checks run before Ray starts, and
# importing MLflow there (0.6-1.3 s on 2 cores) would keep it out of the making of a new store,
# which runs beside Ray's start, and out of `foldsweep validate`, which needs nothing of it.


def _check_shared_view() -> str | None:
    scripts = mlflow_private.mlflow_ui_scripts()
    if not scripts:
        return "the MLflow UI's scripts (mlflow/server/js/build/static/js) are missing"
    unread = _names_unread(tuple(scripts))
    return f"the MLflow UI no longer reads {' or '.join(unread)}" if unread else None


@functools.cache
def _names_unread(scripts: tuple[Path, ...]) -> tuple[str, ...]:
    """The shared-view names no script mentions (20 MB of JavaScript: read once per process)."""
    wanted = {MLFLOW_SHARED_VIEW_TAG, MLFLOW_SHARED_VIEW_PARAM, *MLFLOW_VIEW_STATE_NAMES}
    for script in scripts:
        text = script.read_text(encoding="utf-8", errors="replace")
        wanted = {name for name in wanted if name not in text}
        if not wanted:
            break
    return tuple(sorted(wanted))


def _check_store_tables() -> str | None:
    directory = mlflow_private.mlflow_directory()
    models = directory / "store" / "tracking" / "dbmodels" / "models.py" if directory else None
    if models is None or not models.is_file():
        return "mlflow.store.tracking.dbmodels.models is missing"
    declared = set(re.findall(r"__tablename__ = \"(\w+)\"", models.read_text(encoding="utf-8")))
    # alembic_version is Alembic's own table, which MLflow's migrations keep under its default name.
    missing = sorted(MLFLOW_STORE_TABLES - {"alembic_version"} - declared)
    return f"MLflow's SQLite store no longer has the tables {missing}" if missing else None


def _check_job_execution_switch() -> str | None:
    directory = mlflow_private.mlflow_directory()
    variables = directory / "environment_variables.py" if directory else None
    defined = (
        variables is not None
        and variables.is_file()
        and re.search(rf"^{MLFLOW_JOB_EXECUTION_VARIABLE} = ", variables.read_text(encoding="utf-8"), re.MULTILINE)
    )
    return None if defined else f"mlflow.environment_variables.{MLFLOW_JOB_EXECUTION_VARIABLE} is missing"


# -- Keras ----------------------------------------------------------------------------------------


@functools.cache
def _probe_models() -> tuple[object, object]:
    """A Sequential with an Input, compiled with loss_weights, and a Functional model, both tiny."""
    import keras

    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    sequential.compile(optimizer="sgd", loss="mse", loss_weights=[0.5])
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    return sequential, functional


def _check_flatten_layers() -> str | None:
    import keras

    method = getattr(keras.layers.Layer, "_flatten_layers", None)
    if method is None:
        return "keras.layers.Layer._flatten_layers is missing"
    if not {"include_self", "recursive"} <= set(_parameters(method)):
        return "keras.layers.Layer._flatten_layers no longer takes include_self and recursive"
    return None


def _check_layer_graph() -> str | None:
    sequential, functional = _probe_models()
    graph = getattr(sequential, "_functional", None)
    if graph is None:
        return "a built keras.Sequential has no _functional graph"
    for model in (graph, functional):
        if not hasattr(model, "_nodes_by_depth") or not hasattr(model, "_run_through_graph"):
            return f"keras {type(model).__name__} models lack _nodes_by_depth or _run_through_graph"
        if "operation_fn" not in _parameters(model._run_through_graph):
            return f"keras {type(model).__name__}._run_through_graph no longer takes operation_fn"
    return None


def _check_compiled_loss_weights() -> str | None:
    sequential, _ = _probe_models()
    weights = getattr(getattr(sequential, "_compile_loss", None), "_user_loss_weights", None)
    if weights != [0.5]:
        return "a model compiled with loss_weights=[0.5] no longer shows them as _compile_loss._user_loss_weights"
    return None


def _check_compile_arguments() -> str | None:
    sequential, _ = _probe_models()
    arguments = compile_arguments(sequential) or {}
    kept = arguments.get("optimizer") is getattr(sequential, "optimizer", None)
    if not kept or arguments.get("loss_weights") != [0.5]:
        return "a compiled model no longer keeps what compile was given as _compile_config.config"
    return None


def _check_weight_decay_exclusions() -> str | None:
    import keras

    dense = keras.layers.Dense(2, name="probe_head")
    dense.build((None, 4))
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[dense.bias], var_names=["probe_head/k"])
    if weight_decay_exclusions(optimizer, [dense.kernel, dense.bias]) != (0, 1):
        return (
            "an optimizer's _use_weight_decay no longer leaves out a variable given to exclude_from_weight_decay "
            "in var_list, or one whose TensorFlow name (probe_head/kernel:0) holds a string of var_names"
        )
    return None


def _check_compile_metrics() -> str | None:
    if problem := _missing("keras.src.trainers.compile_utils", "CompileMetrics"):
        return problem
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    auc = keras.metrics.AUC(name="auc")
    model.compile(loss="mse", metrics=["mae", auc], weighted_metrics=["mse"])
    compiled = getattr(model, "_compile_metrics", None)
    if getattr(compiled, "_user_metrics", None) != ["mae", auc] or getattr(
        compiled, "_user_weighted_metrics", None
    ) != ["mse"]:
        return (
            "a compiled model no longer shows compile(metrics=, weighted_metrics=) as "
            "_compile_metrics._user_metrics and _user_weighted_metrics"
        )
    from keras.src.trainers.compile_utils import CompileMetrics

    for method in ("build", "update_state", "result", "reset_state"):
        if not callable(getattr(CompileMetrics, method, None)):
            return f"keras' CompileMetrics has no {method}"
    return None


def _check_preprocessing_module() -> str | None:
    import keras

    for layer in (keras.layers.RandomRotation(0.2), keras.layers.Rescaling(0.5)):
        if not is_preprocessing_layer(layer):
            return f"keras.layers.{type(layer).__name__} is no longer defined under {PREPROCESSING_MODULE}"
    if is_preprocessing_layer(keras.layers.Dense(2)):
        return f"keras.layers.Dense is defined under {PREPROCESSING_MODULE}"
    return None


def _check_seed_generators() -> str | None:
    import keras

    for layer in (keras.layers.Dropout(0.5), keras.layers.GaussianNoise(0.1), keras.layers.RandomFlip()):
        if not holds_seed_generator(layer):
            return f"keras.layers.{type(layer).__name__} no longer holds a keras.random.SeedGenerator"
    return None


# How the hook's check makes each of COUNTER_DRAWN_LAYERS and the rank of the input it calls it on.
_COUNTER_DRAWN_CHECKED_AS = {
    "GaussianNoise": ((0.1,), 3),
    "SpatialDropout1D": ((0.5,), 3),
    "SpatialDropout2D": ((0.5,), 4),
    "SpatialDropout3D": ((0.5,), 5),
    "RandomFlip": ((), 4),
    "RandomContrast": ((0.5,), 4),
    "RandomBrightness": ((0.5,), 4),
    "RandomCrop": ((2, 2), 4),
    "RandomRotation": ((0.2,), 4),
    "RandomTranslation": ((0.2, 0.2), 4),
    "RandomZoom": ((0.2,), 4),
}


def _check_counter_draws() -> str | None:
    import keras
    import numpy as np

    module = importlib.import_module(KERAS_RANDOM_MODULE)
    for name, parameters in KERAS_RANDOM_DRAWS.items():
        function = getattr(module, name, None)
        if function is None or tuple(_parameters(function)) != parameters:
            return f"{KERAS_RANDOM_MODULE}.{name} no longer takes ({', '.join(parameters)})"
    drawn: list[tuple[str, object]] = []
    originals = {name: getattr(module, name) for name in KERAS_RANDOM_DRAWS}

    def recording(name: str) -> Callable[..., object]:
        def draw(*args: object, **kwargs: object) -> object:
            drawn.append((name, kwargs.get("seed")))
            return originals[name](*args, **kwargs)

        return draw

    try:
        for name in KERAS_RANDOM_DRAWS:
            setattr(module, name, recording(name))
        for layer_name in COUNTER_DRAWN_LAYERS:
            arguments, rank = _COUNTER_DRAWN_CHECKED_AS.get(layer_name, ((0.5,), 3))
            layer = getattr(keras.layers, layer_name)(*arguments)
            drawn.clear()
            layer(np.ones((2,) + (3,) * (rank - 1), np.float32), training=True)
            generators = {id(value) for value in vars(layer).values() if isinstance(value, keras.random.SeedGenerator)}
            if not drawn or any(id(seed) not in generators for _, seed in drawn):
                return (
                    f"keras.layers.{layer_name} no longer draws through {KERAS_RANDOM_MODULE}'s "
                    f"{', '.join(KERAS_RANDOM_DRAWS)} with its own SeedGenerator"
                )
    finally:
        for name, function in originals.items():
            setattr(module, name, function)
    return None


def _check_affine_transform() -> str | None:
    import keras
    import numpy as np

    module = importlib.import_module(KERAS_IMAGE_MODULE)
    original = getattr(module, AFFINE_TRANSFORM, None)
    if original is None or tuple(_parameters(original)) != AFFINE_TRANSFORM_PARAMETERS:
        return f"{KERAS_IMAGE_MODULE}.{AFFINE_TRANSFORM} no longer takes ({', '.join(AFFINE_TRANSFORM_PARAMETERS)})"
    called: list[bool] = []

    def recording(*args: object, **kwargs: object) -> object:
        called.append(True)
        return original(*args, **kwargs)

    try:
        setattr(module, AFFINE_TRANSFORM, recording)
        for layer_name in AFFINE_LAYERS:
            arguments, rank = _COUNTER_DRAWN_CHECKED_AS[layer_name]
            called.clear()
            getattr(keras.layers, layer_name)(*arguments)(np.ones((2,) + (3,) * (rank - 1), np.float32), training=True)
            if not called:
                return f"keras.layers.{layer_name} no longer transforms images through {KERAS_IMAGE_MODULE}.{AFFINE_TRANSFORM}"
    finally:
        setattr(module, AFFINE_TRANSFORM, original)
    return None


def _check_context_state() -> str | None:
    from tensorflow.python.eager import context

    state = context.context()
    missing = [name for name in ("_initialized", "_physical_devices") if not hasattr(state, name)]
    return f"tensorflow.python.eager.context.Context has no {', '.join(missing)}" if missing else None


def _check_graph_optimizer_options() -> str | None:
    from tensorflow.core.protobuf import rewriter_config_pb2
    from tensorflow.python.eager import context

    fields = rewriter_config_pb2.RewriterConfig.DESCRIPTOR.fields_by_name
    if "meta_optimizer_iterations" not in fields or "disable_tfg_optimizer" not in fields:
        return "RewriterConfig has no meta_optimizer_iterations or disable_tfg_optimizer"
    if "config.CopyFrom(self._config)" not in inspect.getsource(context.Context.config.fget):
        return "the eager context's configuration no longer starts from its _config"
    options = inspect.getsource(context.Context.function_call_options.fget)
    if "self.config" not in options or context.Context.function_call_options.fset is None:
        return "a thread's function-call options are no longer taken from the eager context's configuration"
    return None


def _check_op_determinism() -> str | None:
    from tensorflow.python.framework import config

    getter = getattr(config, "is_op_determinism_enabled", None)
    if not callable(getter) or not isinstance(getter(), bool):
        return "tensorflow.python.framework.config.is_op_determinism_enabled() is missing or no longer a bool"
    return None


def _check_content_names() -> str | None:
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import atomic_function, concrete_function
    from tensorflow.python.ops import control_flow_util_v2

    from pipeline.base.compile_cache import CONTENT_NAME_FLOOR, content_names

    if list(inspect.signature(atomic_function.from_func_graph).parameters)[:2] != ["name", "graph"]:
        return "atomic_function.from_func_graph no longer takes (name, graph, ...)"
    for function, call in (
        (concrete_function.ConcreteFunction.from_func_graph, "atomic_function.from_func_graph("),
        (control_flow_util_v2.create_new_tf_function, "return func_graph.name"),
    ):
        if call not in inspect.getsource(function):
            return f"{function.__module__}.{function.__qualname__} no longer has `{call}`"
    # Twice the same cond with a custom gradient (new registry name each trace), both kept alive:
    # one content name, and TensorFlow takes the second definition under it.
    names, kept = [], []
    for _ in range(2):

        @tf.custom_gradient
        def identity(x):
            return tf.identity(x), lambda upstream: upstream

        with content_names():
            traced = tf.function(lambda x: tf.cond(x[0] > 0, lambda: identity(x), lambda: x), autograph=False)  # noqa: B023
            kept.append(traced.get_concrete_function(tf.TensorSpec([1], tf.float32)))
        names.append(kept[-1].name.decode())
    if names[0] != names[1] or int(names[0].rpartition("_")[2]) < CONTENT_NAME_FLOOR:
        return f"two traces of one function are named {names[0]} and {names[1]}, not after their graph"
    # A function that calls another (a launch calling its step, traced once) captures what the
    # callee captured: named by appearance, two traces of it are one program.
    weights, names = tf.Variable([2.0]), []
    for _ in range(2):
        step = tf.function(lambda x: x * weights, autograph=False)  # noqa: B023
        with content_names():
            launch = tf.function(lambda x: step(step(x)), autograph=False)  # noqa: B023
            kept.append(launch.get_concrete_function(tf.TensorSpec([1], tf.float32)))
        names.append(kept[-1].name.decode())
    if names[0] != names[1]:
        return (
            f"two traces of a function calling another are named {names[0]} and {names[1]}: "
            "FunctionCaptures.capture_by_value(graph, tensor, name) names captures otherwise"
        )
    return None


def _check_exit_functions() -> str | None:
    import atexit
    import os
    import threading

    if not callable(getattr(threading, "_shutdown", None)):
        return "threading._shutdown is missing"
    if not callable(getattr(atexit, "_run_exitfuncs", None)):
        return "atexit._run_exitfuncs is missing"
    return None if callable(getattr(os, "_exit", None)) else "os._exit is missing"


def _check_compiled_calls() -> str | None:
    from tensorflow.python.framework import ops

    if not callable(getattr(ops.Operation, "_set_attr", None)):
        return "tensorflow.python.framework.ops.Operation._set_attr is missing"
    return None


def _check_shared_steps() -> str | None:
    from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction

    call = getattr(ConcreteFunction, "_call_flat", None)
    if not callable(call) or _parameters(call) != ["self", "tensor_inputs", "captured_inputs"]:
        return "ConcreteFunction._call_flat(tensor_inputs, captured_inputs) is missing"
    return None


def _check_gradient_registry() -> str | None:
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import custom_gradient

    registry = getattr(getattr(ops, "gradient_registry", None), "_registry", None)
    if not isinstance(registry, dict):
        return "tensorflow.python.framework.ops.gradient_registry._registry is no longer a dict"
    if '"CustomGradient-%s"' not in inspect.getsource(custom_gradient.generate_name):
        return "tf.custom_gradient no longer registers its gradients as CustomGradient-<uid>"
    return None


def _check_xla_kernels() -> str | None:
    if not has_xla_kernel("Conv2D") or has_xla_kernel("ImageProjectiveTransformV3"):
        return (
            "tensorflow.python.framework.kernels.get_registered_kernels_for_op no longer tells ops XLA compiles "
            "(Conv2D) from those it does not (ImageProjectiveTransformV3)"
        )
    return None


HOOKS: tuple[Hook, ...] = (
    Hook(
        "ray",
        "ray.tune.execution.tune_controller.TuneController._maybe_cache_trial_actor",
        "a worker that retires (max_trials_per_worker) ends with its trial instead of being reused",
        ("_maybe_cache_trial_actor",),
        _check_actor_caching,
        gain=(
            "workers retire, by trials, memory mappings or memory, without a trial failing or being retried: a sweep "
            "of hundreds of trials runs without a worker stopped at vm.max_map_count (docs/reliability.md)"
        ),
    ),
    Hook(
        "ray",
        "ray.tune.Tuner._local_tuner.get_run_config().callbacks",
        "--resume records the resumed trials in this process (the restored callbacks are the old driver's)",
        ("_local_tuner",),
        _check_restored_callbacks,
        gain=(
            "a resumed sweep is recorded in its MLflow runs and shown as it runs; otherwise its trials report to the "
            "interrupted driver's callbacks and none is recorded"
        ),
    ),
    Hook(
        "ray",
        "ray.tune.Tuner._local_tuner._tune_config.search_alg and ray.train._internal.storage.StorageContext",
        "a sweep resumed from another directory makes its new trials there, not where it was recorded",
        ("_tune_config", "_internal"),
        _check_moved_sweep,
        gain=(
            "a sweep copied, moved or unpacked elsewhere can be resumed there; otherwise each new trial fails at its "
            "first checkpoint, or writes into the old directory where it still exists"
        ),
    ),
    Hook(
        "ray",
        "ray.tune.search.basic_variant's _TrialIterator, _VariantIterator, "
        "ray.tune.experiment._convert_to_experiment_list and BasicVariantGenerator's "
        "_iterators, _trial_generator, _total_samples, _random_state and _uuid_prefix",
        "random and grid search never make a config twice (pipeline.inputs.searchers makes Ray Tune's trials of the "
        "space's own draw)",
        (
            "_TrialIterator",
            "_VariantIterator",
            "_convert_to_experiment_list",
            "_iterators",
            "_random_state",
            "_uuid_prefix",
            "_total_samples",
            "_trial_generator",
        ),
        _check_variant_generator,
        gain=(
            "every trial of random and grid search trains a config of its own: Ray Tune's own draws trained 5-6 "
            "distinct configs in 8 trials of a space of 8"
        ),
    ),
    Hook(
        "ray",
        "ray._private.node.Node: its RayParams' no_monitor and include_log_monitor, start_api_server and "
        "_webui_url, and start_raylet with its session directory, node id, _get_unused_port and the minimal "
        "dashboard agent's ports (ray._raylet.persist_port); the raylet's command for that agent "
        "(ray._private.services.start_raylet, through start_ray_process)",
        "a sweep's local Ray starts without the processes it does not use and without waiting for its agents "
        "(pipeline.base.ray_private.lean_local_head)",
        ("_private", "_raylet", "_ray_params", "_session_dir", "_node_id", "_webui_url", "_get_unused_port"),
        _check_lean_head,
        gain=(
            "a sweep starts and ends sooner: the 4-config grid's fixed cost 7.2-7.7 s against 9.5-9.8 s on 2 cores, "
            "ray.init 0.4-0.5 s against 2.0-2.2 s and ray.shutdown 0.3-0.6 s against 1.1-1.4 s (benchmarks/RESULTS.md, "
            "2026-12-01, what the lean local Ray still saves); the dashboard agent's stand-in takes another 0.4 s off "
            "the quickstart's start-up (2026-12-03, night)"
        ),
    ),
    Hook(
        "ray",
        "ray.tune.execution.class_cache: DEFAULT_ENV_VARS, the runtime environment _ActorClassCache gives trial "
        "actors; the workers' RAY_preload_python_modules and the nil job id (RAY_JOB_ID) of a worker started ahead",
        "a sweep's first trials start in workers that loaded TensorFlow while the driver prepared the sweep "
        "(pipeline.base.ray_private.trial_actors_in_workers_started_ahead)",
        ("_ActorClassCache",),
        _check_workers_started_ahead,
        gain=(
            "a sweep's first trials start in workers that loaded TensorFlow beside the driver: the quickstart's "
            "fixed cost 8.4-10.1 s against 7.9-12.4 s, 0.83 of it at the median of 7 alternating pairs on 2 cores "
            "(benchmarks/RESULTS.md, 2026-12-02, workers started ahead)"
        ),
    ),
    Hook(
        "ray",
        f"the {RAY_OUTPUT_ENGINE_VARIABLE}=0 environment variable",
        "Ray Tune's own progress tables stay out of foldsweep's output",
        (),
        _check_output_engine_switch,
        gain="the terminal shows foldsweep's progress table alone, not Ray Tune's own tables printed over it",
    ),
    Hook(
        "ray",
        "ray.experimental.internal_kv's put, get and delete by namespace, from workers and the driver",
        "the progress view says what each trial's worker does before its first epoch (pipeline.contract.phases)",
        ("_internal_kv_initialized", "_internal_kv_put", "_internal_kv_get", "_internal_kv_del"),
        _check_internal_kv,
        gain=(
            "each running trial's row says what it does (starting TensorFlow, placing the data, compiling) from its "
            "first second, not nothing until its first epoch ends"
        ),
    ),
    Hook(
        "mlflow",
        f"the experiment tag {MLFLOW_SHARED_VIEW_TAG}<key> and ?{MLFLOW_SHARED_VIEW_PARAM}=<key>, with the "
        f"view state's {', '.join(MLFLOW_VIEW_STATE_NAMES)}",
        "`foldsweep ui` and the parent run's link open the sweep's trials best first, and its charts in sections",
        (),
        _check_shared_view,
        gain=(
            "the printed address opens the sweep in the UI ready to read: its trials best first with their scores and "
            "parameters as columns, its charts in sections (docs/recorded.md)"
        ),
    ),
    Hook(
        "mlflow",
        f"the SQLite store's tables {', '.join(sorted(MLFLOW_STORE_TABLES))}",
        "a --tracking-uri file that is not an MLflow store is refused instead of migrated",
        (),
        _check_store_tables,
        gain=(
            "another program's SQLite file given as the store is refused (exit 2) instead of being altered by MLflow's "
            "migrations"
        ),
    ),
    Hook(
        "mlflow",
        f"the {MLFLOW_JOB_EXECUTION_VARIABLE} environment variable",
        "`foldsweep ui` starts no GenAI job runner processes",
        (),
        _check_job_execution_switch,
        gain=(
            "`foldsweep ui` spares the ~18 s of CPU MLflow's GenAI job runner (a job process and six task-queue "
            "consumers) takes to start, for jobs training runs never have (docs/reliability.md)"
        ),
    ),
    Hook(
        "keras",
        "keras.layers.Layer._flatten_layers(include_self, recursive)",
        "random layers, a layer under mixed precision (refused) and the stacked form's layers are found in nested "
        "models",
        ("_flatten_layers",),
        _check_flatten_layers,
        gain=(
            "nested models (a keras.applications backbone, a Sequential of augmentation layers) are planned, stacked "
            "and checked layer by layer, not as one opaque layer"
        ),
    ),
    Hook(
        "keras",
        "Sequential._functional, Functional._nodes_by_depth and _run_through_graph(operation_fn=)",
        "stacked folds run the model's own layer graph with per-fold weights",
        ("_functional", "_nodes_by_depth", "_run_through_graph"),
        _check_layer_graph,
        gain=(
            "stacked folds, one XLA program training all k folds: 1.3-1.45x (MNIST-1D) and 1.85-1.95x (protein "
            "windows) the throughput of unfused folds at batch 8 with cpu: 1, one compilation instead of k "
            "(docs/speed.md, Fold-fused training)"
        ),
    ),
    Hook(
        "keras",
        "model._compile_loss._user_loss_weights",
        "compile(loss_weights=...) is refused instead of silently trained unweighted",
        ("_compile_loss", "_user_loss_weights"),
        _check_compiled_loss_weights,
        gain=(
            "a model compiled with loss_weights is refused with what to change, not trained on another loss than the "
            "one it was compiled with"
        ),
    ),
    Hook(
        "keras",
        "model._compile_config.config",
        "the refit model is saved compiled with the optimizer that trained it where the spec replaced or changed "
        "the one its build compiled (pipeline.engine.trainer)",
        ("_compile_config",),
        _check_compile_arguments,
        gain=(
            "a refit model trained with the spec's optimizer, learning rate or clipping loads with that optimizer "
            "and its trained state, so fit on it goes on as it trained, not with the build's optimizer at step 0"
        ),
    ),
    Hook(
        "keras",
        "model._compile_metrics._user_metrics/_user_weighted_metrics and "
        "keras.src.trainers.compile_utils.CompileMetrics",
        "every metric a model compiles is built, named and accumulated per fold as Keras' evaluate does",
        ("_compile_metrics", "_user_metrics", "_user_weighted_metrics"),
        _check_compile_metrics,
        gain=(
            "every metric a model compiles (AUC, RMSE, a Metric subclass) is scored per fold as Keras' evaluate scores "
            "it, recorded and usable as the objective, with no code of the researcher's"
        ),
    ),
    Hook(
        "keras",
        "Optimizer._use_weight_decay(variable)",
        "what a compiled optimizer's exclude_from_weight_decay(...) was told reaches every fold's optimizer",
        ("_use_weight_decay",),
        _check_weight_decay_exclusions,
        gain=(
            "an optimizer told to leave biases (or any variables) out of weight decay trains every fold so, as fit "
            "does; the optimizer's config, from which each fold's is made, does not carry it"
        ),
    ),
    Hook(
        "keras",
        f"{PREPROCESSING_MODULE}, where Keras defines its preprocessing layers",
        "a Keras preprocessing layer is traced for ops XLA has no kernel for, and Keras' other layers are not "
        "(pipeline.engine.xla_support)",
        (),
        _check_preprocessing_module,
        gain=(
            "Keras' own layers but its preprocessing ones are not traced to look for ops XLA lacks: a "
            "keras.applications backbone plans without tracing its forward pass (1.3-1.7 s for a MobileNetV2 at "
            "32x32x3, benchmarks/RESULTS.md, 2026-11-29)"
        ),
    ),
    Hook(
        "keras",
        "the keras.random.SeedGenerator held by every layer that draws random numbers",
        "models with random layers foldsweep cannot draw for are never stacked (each fold draws its own numbers)",
        (),
        _check_seed_generators,
        gain=(
            "a model with a random layer foldsweep cannot draw for keeps Keras' generator and trains unstacked, each "
            "fold drawing its own numbers: the right results, not numbers shared by the folds"
        ),
    ),
    Hook(
        "keras",
        f"{KERAS_RANDOM_MODULE}'s {', '.join(KERAS_RANDOM_DRAWS)}, looked up at each draw by "
        f"keras.layers.{', '.join(COUNTER_DRAWN_LAYERS)} with their own SeedGenerator",
        "foldsweep draws those layers' numbers inside its compiled step, per fold, with Keras' rates, noise shapes "
        "and scaling (pipeline.engine.draws)",
        (),
        _check_counter_draws,
        gain=(
            "models with Dropout, noise or augmentation layers keep XLA and stacked folds: a dropout mask takes ~15 us "
            "in the compiled step against ~250 us for Keras' draw without XLA, and Dropout costs the engine little "
            "(docs/speed.md)"
        ),
    ),
    Hook(
        "keras",
        f"{KERAS_IMAGE_MODULE}.{AFFINE_TRANSFORM}({', '.join(AFFINE_TRANSFORM_PARAMETERS)}), looked up at each call by "
        f"keras.layers.{', '.join(AFFINE_LAYERS)}",
        "foldsweep transforms those layers' images with ops XLA compiles while it draws their numbers "
        "(pipeline.engine.image_transforms), so that their model's step can be compiled and stacked",
        (),
        _check_affine_transform,
        gain=(
            "models with RandomRotation, RandomTranslation or RandomZoom compile with XLA and stack their folds, on a "
            "GPU too, instead of training without XLA"
        ),
    ),
    Hook(
        "tensorflow",
        "atomic_function.from_func_graph(name, graph), through which every traced function is "
        "named, FunctionCaptures.capture_by_value(graph, tensor, name), which names a called function's captures "
        "in its caller, and TensorFlow taking definitions that differ only in custom-gradient names as one",
        "trials of one program would never find each other's compiled XLA programs, or a trial would fail "
        "(pipeline.base.compile_cache's content names)",
        (),
        _check_content_names,
        gain=(
            "trials with the same program find it in the compile cache: an empty cache cuts a 12-config sweep's "
            "compile time 1.9x (28 of its 42 programs loaded), a warm one 3.3x (benchmarks/RESULTS.md, 2026-11-23)"
        ),
    ),
    Hook(
        "tensorflow",
        "Operation._set_attr, marking one call of a function for XLA to compile (_XlaMustCompile), and XLA "
        "lowering a function that call's function calls, marked _noinline, once however often it is called",
        "each unrolled step of a compiled launch is lowered to XLA again, a larger cold compile and a warm start "
        "from the compile cache twice as long (pipeline.base.compile_cache.compile_call)",
        ("_set_attr",),
        _check_compiled_calls,
        gain=(
            "a launch of 8 unrolled steps compiles in two thirds of the time warm (2.1 s against 3.2-3.3 s) and 15% "
            "faster cold (6.3 s against 7.2-7.6 s; benchmarks/RESULTS.md, 2026-11-26)"
        ),
    ),
    Hook(
        "tensorflow",
        "ConcreteFunction._call_flat(tensor_inputs, captured_inputs), calling a traced function with other "
        "variables in place of those it captured",
        "each fold of a trial traces its own training step again, not the first fold's once "
        "(pipeline.engine.fold_engine.shared_step)",
        ("_call_flat",),
        _check_shared_steps,
        gain=(
            "a trial's folds side by side or in turn trace one training step, not one each: ~0.8 s less warm compile "
            "for a small 1D model, and a MobileNetV2's 3-epoch trial, whose folds share it once their graphs match, "
            "1.41x as fast as the naive loop against 1.16x while each traced its own (benchmarks/RESULTS.md, "
            "2026-11-29)"
        ),
    ),
    Hook(
        "tensorflow",
        "ops.gradient_registry._registry, where tf.custom_gradient registers CustomGradient-<uid>",
        "a worker's memory does not grow by every trial's traced graphs (pipeline.engine.lifespan.release_trial)",
        ("_registry",),
        _check_gradient_registry,
        gain=(
            "a reused worker grows by a third of what it otherwise would per trial (3.5 MiB against 10.5 MiB for a "
            "tiny MNIST-1D trial, benchmarks/RESULTS.md, 2026-11-25), so it runs about 3x as many trials before it "
            "retires for memory"
        ),
    ),
    Hook(
        "tensorflow",
        "tensorflow.python.framework.config.is_op_determinism_enabled() (not in tf.config)",
        "a trial's plan and the compile cache's key miss tf.config.experimental.enable_op_determinism() "
        "(pipeline.base.accelerator)",
        (),
        _check_op_determinism,
        gain=(
            "a run with op determinism switched on in code never loads a program compiled without it, and its plan "
            "says so (docs/gpus.md)"
        ),
    ),
    Hook(
        "tensorflow",
        "the eager context's _initialized and _physical_devices",
        "a process whose TensorFlow already read its XLA flags would count compile-cache hits it never had",
        ("_initialized", "_physical_devices"),
        _check_context_state,
        gain=(
            "a process whose TensorFlow started before foldsweep (a notebook) reports no compile-cache hits it never "
            "had, and keeps no cache directory it inherited"
        ),
    ),
    Hook(
        "tensorflow",
        "the eager context's _config, from which each thread's function-call options (Grappler's options for the "
        "functions it calls) are taken",
        "train.graph_optimizer: light is not applied, and a trial's functions are optimized in TensorFlow's two "
        "rounds while its plan records one (pipeline.base.tensorflow_private.use_graph_optimizer)",
        ("_config",),
        _check_graph_optimizer_options,
        gain=(
            "the quickstart's trials compile 1.9 s less of 16 s, the same numbers to the last bit "
            "(benchmarks/RESULTS.md, 2026-12-03)"
        ),
    ),
    Hook(
        "tensorflow",
        "tensorflow.python.framework.kernels.get_registered_kernels_for_op, whose device types include XLA's",
        "a model with an op XLA cannot compile (RandomRotation's image transform) gets an XLA step on a GPU, "
        "which fails when first called (pipeline.engine.xla_support)",
        (),
        _check_xla_kernels,
        gain=(
            "a model with an op XLA cannot compile (RandomShear's transform, MixUp's gammas, tf.numpy_function) trains "
            "without XLA instead of failing at its first step on a GPU, and train.jit_compile: true on it is refused "
            "at validate"
        ),
    ),
    Hook(
        "python",
        "threading._shutdown, atexit._run_exitfuncs and os._exit",
        "a command ends without tearing the interpreter down, its threads stopped and its atexit handlers run "
        "(pipeline.base.processes.leave; without them it exits as Python does, freeing every module first)",
        ("_shutdown", "_run_exitfuncs", "_exit"),
        _check_exit_functions,
        gain=(
            "a command that ran a sweep ends 2-3 s sooner, not freeing TensorFlow's, Ray's and MLflow's modules one by "
            "one (benchmarks/RESULTS.md, 2026-11-26)"
        ),
    ),
)


def _version(library: str) -> str:
    if library == "python":
        return platform.python_version()
    return installed_version(library) or "(not installed)"


def broken_hooks(libraries: Sequence[str] = HOOKED_LIBRARIES) -> list[str]:
    """One line for each hook of ``libraries`` that no longer holds."""
    problems = []
    for hook in HOOKS:
        if hook.library not in libraries:
            continue
        try:
            problem = hook.check()
        except Exception as exc:  # a changed library may fail the check itself in any way
            problem = f"checking it failed: {type(exc).__name__}: {exc}"
        if problem:
            problems.append(
                f"foldsweep relies on {hook.library} {_version(hook.library)}'s {hook.place} so that "
                f"{hook.used_for}, but {problem}"
            )
    return problems


# The libraries whose hooks all held when this process checked them. A library does not change
# under a running process, so each is checked once: a process that prepares many sweeps or trials
# (a notebook, the test suite) would otherwise pay for the checks (building small models) each time.
_HELD: set[str] = set()


@collector_paused()  # the checks load the libraries (Ray Tune, MLflow's store), which stay
def require_hooks(libraries: Sequence[str] = HOOKED_LIBRARIES) -> None:
    """Stop before anything starts when a hook no longer holds (each library's hooks checked once
    per installation, ``installation_identity``, and once per process).

    Raises:
        PrivateHookMissing: one line per broken hook, and how to get the locked versions back.
    """
    unchecked = [library for library in libraries if library not in _HELD]
    if not unchecked:
        return
    identity = installation_identity()
    recorded = {library for library in unchecked if os.path.isfile(_held_record(library, identity))}
    unchecked = [library for library in unchecked if library not in recorded]
    problems = broken_hooks(unchecked) if unchecked else []
    if problems:
        raise PrivateHookMissing("; ".join(problems) + ": install the locked versions (make install, from uv.lock)")
    _HELD.update(recorded, unchecked)
    for library in unchecked:
        _record_held(library, identity)


def installation_identity() -> str:
    """What a record of held hooks holds for: foldsweep's checks (the source of ``pipeline.base``,
    this module and every module of foldsweep the checks read), the Python running them, and
    each hooked library's version and installed files (its ``RECORD``, which lists each file
    with its hash). Another installation, or another build of a library, is checked again."""
    digest = hashlib.sha256(sys.version.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    for library in HOOKED_LIBRARIES:
        try:
            installed = metadata.distribution(library).read_text("RECORD") or ""
        except metadata.PackageNotFoundError:
            installed = "(not installed)"
        digest.update(f"{library} {installed_version(library)}\n{installed}".encode())
    return digest.hexdigest()[:32]


def held_records() -> Path:
    """Where a library's hooks are recorded as held for an installation (``installation_identity``),
    one empty file per library, so that each installation's hooks are checked by the first command
    that needs them, not by every command (the Keras checks build small models on the driver's
    way to its first trial)."""
    return cache_directory() / "hooks-held"


def _held_record(library: str, identity: str) -> Path:
    return held_records() / f"{library}-{identity}"


def _record_held(library: str, identity: str) -> None:
    """Record ``library``'s hooks as held for ``identity`` (nothing is recorded where the cache
    cannot be written: the next command checks again). Records of other installations stay:
    several environments may share the cache."""
    record = _held_record(library, identity)
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.touch()
