"""Every place foldsweep reaches into Ray's private API, each a small function: no other module of
foldsweep touches a private name of Ray (``tests/test_private_hooks.py`` checks it).

What each gives users, and the check that it still holds on the installed Ray, is its hook in
``pipeline.base.private_hooks``. Ray is imported inside the functions: the base layer loads as
every command starts, Ray only where a command uses it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

# Ray Tune's default console output (its "new" output engine) prints over foldsweep's progress lines.
RAY_OUTPUT_ENGINE_VARIABLE = "RAY_AIR_NEW_OUTPUT"


# -- Ray Tune's controller ------------------------------------------------------------------------


@contextlib.contextmanager
def trial_actors_not_kept_after(retiring: Callable[[Mapping[str, Any]], bool]) -> Iterator[None]:
    """While the block runs, Ray Tune keeps no ended trial's actor for the next trial where
    ``retiring`` is true of the trial's last result: that trial starts in a fresh actor.

    Ray Tune decides alone whether it keeps an actor (``TuneController._maybe_cache_trial_actor``),
    and a ``reset_config`` that refuses the next trial fails that trial."""
    from ray.tune.execution.tune_controller import TuneController

    keep_for_reuse = TuneController._maybe_cache_trial_actor

    def unless_retiring(controller: Any, trial: Any) -> bool:
        if retiring(trial.last_result or {}):
            return False
        return keep_for_reuse(controller, trial)

    # Ray Tune's own method, replaced while the block runs: the point of this function
    TuneController._maybe_cache_trial_actor = unless_retiring  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        TuneController._maybe_cache_trial_actor = keep_for_reuse  # type: ignore[method-assign]


@contextlib.contextmanager
def trial_actors_in_workers_started_ahead() -> Iterator[None]:
    """While the block runs, Ray Tune starts trial actors without a runtime environment of its
    own, so that a local Ray can place them in the workers it started ahead of them.

    Ray Tune gives every trainable's actor the environment variables of
    ``class_cache.DEFAULT_ENV_VARS`` (``PL_DISABLE_FORK``, for PyTorch Lightning) as a runtime
    environment, and Ray places an actor only in a worker started for its runtime environment:
    never in the workers it starts for the driver as it connects."""
    from ray.tune.execution import class_cache

    defaults = dict(class_cache.DEFAULT_ENV_VARS)
    class_cache.DEFAULT_ENV_VARS.clear()
    try:
        yield
    finally:
        class_cache.DEFAULT_ENV_VARS.update(defaults)


def started_ahead_of_any_job() -> bool:
    """Whether this Ray worker process was started before any job asked for a worker: Ray starts
    workers ahead for a driver as it connects, and gives them the nil job id (RAY_JOB_ID)."""
    from ray import JobID

    return os.environ.get("RAY_JOB_ID") == JobID.nil().hex()


# -- a restored Tuner -----------------------------------------------------------------------------


def report_restored_to(tuner: Any, callbacks: list[Any]) -> None:
    """A restored Tuner reports to ``callbacks``: its run config carries the callbacks the
    interrupted driver pickled, which have lost their link to this process."""
    tuner._local_tuner.get_run_config().callbacks = callbacks


def restored_here(tuner: Any) -> bool:
    """Whether a restored Tuner was restored in this process (Ray Client's is restored on the
    cluster, where nothing of it can be changed from here)."""
    return tuner._local_tuner is not None


def restored_tune_config(tuner: Any) -> Any:
    """The ``TuneConfig`` a restored Tuner runs with (its searcher, its concurrency limit)."""
    return tuner._local_tuner._tune_config


def move_storages(state: Any, experiment_path: str) -> None:
    """Point every storage context in ``state`` (a search algorithm's, nested in Ray's own objects,
    dicts and sequences) at ``experiment_path``, as Ray's restore does for the trials it made."""
    path = Path(experiment_path)
    for storage in _storages(state):
        storage.storage_fs_path = path.parent.as_posix()
        storage.experiment_dir_name = path.name


def _storages(state: Any) -> Iterator[Any]:
    from ray.train._internal.storage import StorageContext

    seen: set[int] = set()
    pending = [state]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, StorageContext):
            yield item
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
        elif type(item).__module__.startswith("ray.") and hasattr(item, "__dict__"):
            pending.extend(vars(item).values())


# -- searchers ------------------------------------------------------------------------------------


def add_drawn_trials(generator: Any, experiments: Any, draw: Callable[[dict[str, Any], int, Any], list[Any]]) -> None:
    """``BasicVariantGenerator.add_configurations`` with each experiment's variants those of
    ``draw(spec, num_samples, random_state)``, from the generator's own random state: the
    generator makes its trials of them, and saves and restores them as it does its own."""
    from ray.tune.experiment import _convert_to_experiment_list
    from ray.tune.search.basic_variant import _TrialIterator, _VariantIterator

    for experiment in _convert_to_experiment_list(experiments):
        drawn = draw(experiment.spec, experiment.spec.get("num_samples", 1), generator._random_state)
        # Ray's annotations of these private names are narrower than Ray's own use of them: its
        # BasicVariantGenerator passes its own random state and chains its trial generator too.
        trials = _TrialIterator(
            uuid_prefix=generator._uuid_prefix,
            num_samples=0,
            unresolved_spec=experiment.spec,
            start=generator._total_samples,
            random_state=generator._random_state,
        )
        # A trial iterator makes trials of its variants first: here they are all of them.
        trials.variants = _VariantIterator(drawn)  # type: ignore[assignment]
        generator._total_samples += len(drawn)
        generator._iterators.append(trials)
        generator._trial_generator = itertools.chain(generator._trial_generator, trials)


# -- the key-value store --------------------------------------------------------------------------
# Ray's internal key-value store (in its GCS, reachable from every worker of the cluster): what Ray
# Serve and Ray's own libraries pass small facts through. Each function does nothing where this
# process is connected to no Ray.


def kv_put(key: bytes, value: bytes, *, namespace: str) -> None:
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_get_all(keys: Iterable[bytes], *, namespace: str) -> dict[bytes, bytes]:
    """The value of each of ``keys`` that has one."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return {}
    found = {}
    for key in keys:
        value = internal_kv._internal_kv_get(key, namespace=namespace)
        if value is not None:
            found[key] = value
    return found


def kv_delete(key: bytes, *, namespace: str) -> None:
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(key, namespace=namespace)


# -- a local head ---------------------------------------------------------------------------------


@contextlib.contextmanager
def lean_local_head() -> Iterator[None]:
    """A local head started with what a sweep uses of it and no more (ray.init exposes none of
    these choices), and registered without waiting for processes it does not need yet.

    - No API server: ``include_dashboard=False`` still starts one, to run nothing but Ray's usage
      statistics (no dashboard, jobs or state API). ray.init waited 0.7 s for it to come up. The
      head keeps Ray's own web address for a head without a dashboard: none.
    - No autoscaler monitor: a local Ray has a fixed size, with nothing to scale. No log monitor:
      it sends the workers' output to the driver, which asks for none (``log_to_driver=False``;
      the output stays in the session's log files). Each loads Ray in a Python process of its own,
      0.7 s of CPU that the sweep's start-up needs on a small machine.
    - The raylet registers the node (what ray.init waits for) without waiting for its agents,
      Python processes that take ~1.2 s to start beside it. It waits for the dashboard agent to
      write its ports to the session directory, and for the runtime env agent's port unless it was
      given one. Where the dashboard agent runs minimal (Ray without its dashboard's dependencies,
      as foldsweep installs it), the ports it writes are known beforehand: -1, no service. They
      are written first, with Ray's own ``persist_port``. The runtime env agent gets a port picked
      as Ray picks its head's others (``ray start --runtime-env-agent-port`` gives it one too); the
      raylet tries it until it listens.
    - No minimal dashboard agent: it loads no module and serves nothing (those ports), and only
      waits for the raylet, after loading Ray in a Python process of its own: 0.7 s of CPU while
      the sweep starts on a small machine. The raylet requires a command for it and ends when it
      ends, so it starts a stand-in that only waits, and ends with the raylet
      (``DASHBOARD_AGENT_STAND_IN``). The runtime env agent stays: Ray runs every task that has a
      runtime environment through it.
    """
    from ray._private import node, ray_constants, services
    from ray._private.utils import get_dashboard_dependency_error
    from ray._raylet import (  # type: ignore[attr-defined]  # the compiled module's stub names few of its names
        DASHBOARD_AGENT_LISTEN_PORT_NAME,
        METRICS_AGENT_PORT_NAME,
        METRICS_EXPORT_PORT_NAME,
        persist_port,
    )

    originals = {name: getattr(node.Node, name) for name in ("__init__", "start_api_server", "start_raylet")}

    # Node.__init__ takes a ``head`` argument: the node is positional-only in each replacement.
    def init(head: Any, /, ray_params: Any, *arguments: Any, **keywords: Any) -> None:
        ray_params.no_monitor = True
        ray_params.include_log_monitor = False
        originals["__init__"](head, ray_params, *arguments, **keywords)

    def start_api_server(head: Any, /, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
        head._webui_url = ""

    def start_raylet(head: Any, /, *arguments: Any, **keywords: Any) -> Any:
        if get_dashboard_dependency_error() is None:
            return originals["start_raylet"](head, *arguments, **keywords)
        for name in (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, DASHBOARD_AGENT_LISTEN_PORT_NAME):
            persist_port(head._session_dir, head._node_id, name, -1)
        if not head._ray_params.runtime_env_agent_port:
            head._ray_params.runtime_env_agent_port = head._get_unused_port()
        launch = services.start_ray_process

        def start_ray_process(command: list[str], process_type: str, *rest: Any, **options: Any) -> Any:
            if process_type == ray_constants.PROCESS_TYPE_RAYLET:
                command = [_with_agent_stand_in(part) for part in command]
            return launch(command, process_type, *rest, **options)

        services.start_ray_process = start_ray_process
        try:
            return originals["start_raylet"](head, *arguments, **keywords)
        finally:
            services.start_ray_process = launch

    for name, replacement in {
        "__init__": init,
        "start_api_server": start_api_server,
        "start_raylet": start_raylet,
    }.items():
        setattr(node.Node, name, replacement)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(node.Node, name, original)


# What a local head's raylet starts in place of the minimal dashboard agent (``lean_local_head``):
# a process that waits while the raylet, its parent (RAY_RAYLET_PID, which the raylet gives its
# agents), runs. The raylet stops it first when it stops; where the raylet was killed, this ends
# it within a second. The raylet's arguments for the agent are left in sys.argv.
DASHBOARD_AGENT_STAND_IN = (
    "import os, time\n"
    "raylet = int(os.environ.get('RAY_RAYLET_PID') or os.getppid())\n"
    "while os.getppid() == raylet:\n"
    "    time.sleep(1)\n"
)
DASHBOARD_AGENT_COMMAND = "--dashboard_agent_command="


def _with_agent_stand_in(argument: str) -> str:
    """A raylet's command-line ``argument``, with the stand-in for the dashboard agent's command."""
    import subprocess
    import sys

    if not argument.startswith(DASHBOARD_AGENT_COMMAND):
        return argument
    return DASHBOARD_AGENT_COMMAND + subprocess.list2cmdline([sys.executable, "-S", "-c", DASHBOARD_AGENT_STAND_IN])
