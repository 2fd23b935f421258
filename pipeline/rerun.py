"""One trial in this process, without Ray: a recorded trial again (`rerun`) or one config of a spec
(`trial`), through the sweep's own ``TrialRunner``, with per-epoch output and numeric checks."""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from pipeline.datasets import load_dataset
from pipeline.errors import DataError, InputError, TrackingError
from pipeline.folds import FoldPlan, make_folds
from pipeline.spec import TRAINING_DEFAULTS, SweepSpec, parse_spec
from pipeline.tracking import PARENT_TAG, ROLE_TAG, TRIAL_CONFIG_ARTIFACT, Tracker, trial_status

RERUN_OF_TAG = "foldsweep.rerun_of"


@dataclass(frozen=True)
class RecordedTrial:
    """What MLflow holds of a trial that a rerun needs."""

    run_id: str
    run_name: str
    parent_run_id: str
    spec: SweepSpec
    config: dict[str, Any]
    manifest: dict[str, Any]
    experiment_path: Path


@dataclass(frozen=True)
class NumericsFinding:
    """The first op TensorFlow's numeric checking caught producing NaN/Inf."""

    op_type: str
    node: str
    layer: str

    def describe(self) -> str:
        return f"op {self.op_type} (node {self.node}) in layer {self.layer}"


def parse_assignments(assignments: Sequence[str]) -> dict[str, Any]:
    """``name=value`` pairs, values read as YAML scalars (``3``, ``0.5``, ``true``, ``adam``)."""
    values: dict[str, Any] = {}
    for assignment in assignments:
        name, sep, raw = assignment.partition("=")
        if not sep or not name.strip():
            raise InputError(f"--set must be name=value, got {assignment!r}")
        values[name.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return values


def load_recorded_trial(tracker: Tracker, run_id: str) -> RecordedTrial:
    """Read a trial's config, its sweep's spec and fold manifest from the tracking store.

    Raises:
        TrackingError: unknown run id, or a run that is not a foldsweep trial.
    """
    from mlflow.exceptions import MlflowException

    try:
        run = tracker.client.get_run(run_id)
    except MlflowException:
        raise TrackingError(f"RUN_ID: no run with id {run_id!r} in {tracker.uri}") from None
    if run.data.tags.get(ROLE_TAG) not in ("trial", "rerun"):
        raise TrackingError(f"RUN_ID: run {run_id!r} is not a foldsweep trial (tag {ROLE_TAG}="
                            f"{run.data.tags.get(ROLE_TAG)!r})")
    parent_id = run.data.tags[PARENT_TAG]
    with tempfile.TemporaryDirectory() as directory:
        config = json.loads(Path(tracker.client.download_artifacts(run_id, TRIAL_CONFIG_ARTIFACT, directory)).read_text())
        spec_text = Path(tracker.client.download_artifacts(parent_id, "spec.yaml", directory)).read_text()
        manifest = json.loads(Path(tracker.client.download_artifacts(parent_id, "fold_manifest.json", directory)).read_text())
    parent = tracker.client.get_run(parent_id)
    spec = parse_spec(yaml.safe_load(spec_text), source_path=Path(f"spec.yaml of sweep run {parent_id}"),
                      source_text=spec_text)
    experiment_path = Path(parent.data.params.get("experiment_path", spec.experiment_path))
    return RecordedTrial(run_id, run.info.run_name, parent_id, spec, config, manifest, experiment_path)


def recorded_folds(recorded: RecordedTrial) -> tuple[Any, FoldPlan]:
    """The recorded sweep's dataset and folds, rebuilt; refused if either no longer matches.

    Raises:
        DataError: the data's fingerprint or the folds' index hashes differ from the record.
    """
    dataset = load_dataset(recorded.spec.dataset)
    expected = recorded.manifest["dataset_fingerprint"]
    if dataset.fingerprint != expected:
        raise DataError(
            f"dataset: {recorded.spec.dataset.label!r} no longer matches the data of sweep run "
            f"{recorded.parent_run_id}: fingerprint {dataset.fingerprint[:16]}... now, {expected[:16]}... recorded")
    plan = make_folds(recorded.spec.cv, dataset)
    if plan.manifest()["folds"] != recorded.manifest["folds"]:
        raise DataError(f"cv: the folds rebuilt from the spec differ from those recorded in sweep run "
                        f"{recorded.parent_run_id} (fold_manifest.json)")
    return dataset, plan


def apply_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    """The config with ``--set`` values; a name that is no hyperparameter of the trial is refused."""
    for name in overrides:
        if name not in known:
            raise InputError(f"--set {name}: not a hyperparameter of this trial; known: {', '.join(sorted(known))}")
    return {**config, **overrides}


def check_fold(fold: int | None, n_splits: int) -> list[int]:
    if fold is None:
        return list(range(n_splits))
    if not 0 <= fold < n_splits:
        raise InputError(f"--fold must be between 0 and {n_splits - 1} (the sweep has {n_splits} folds), got {fold}")
    return [fold]


def run_in_process(*, spec: SweepSpec, experiment_path: Path, dataset: Any, plan: FoldPlan, config: Mapping[str, Any],
                   conditions: Mapping[str, Any], fold_ids: Sequence[int], epochs: int | None, eager: bool,
                   check_numerics: bool, on_epoch: Callable[[dict[str, Any]], None]) -> tuple[str, NumericsFinding | None, dict]:
    """Run one trial here through ``TrialRunner``; returns (status, numerics finding, last result)."""
    import tensorflow as tf

    from pipeline.fused import side_by_side_loops
    from pipeline.hypermodel import load_builder
    from pipeline.resident import configure_devices, resident_data
    from pipeline.trial import TrialRunner, TrialSettings, configure_threads

    notice = configure_devices(spec.resources.gpu)
    configure_threads(spec.resources.cpu, side_by_side_loops(spec.train.fused, n_folds=len(fold_ids), eager=eager,
                                                             check_numerics=check_numerics))
    settings = TrialSettings(
        experiment_path=str(experiment_path), experiment_attr=spec.experiment_attr,
        dataset_fingerprint=dataset.fingerprint, epochs=spec.train.epochs, seed=spec.train.seed,
        from_logits=spec.train.from_logits, jit_compile=spec.train.jit_compile, cpus=spec.resources.cpu,
        gpus=spec.resources.gpu, conditions=dict(conditions), fused=spec.train.fused,
        steps_per_launch=spec.train.steps_per_launch,
    )
    runner = TrialRunner(
        config, data=resident_data(dataset.fingerprint, dataset.x, dataset.y),
        folds=[plan.folds[k] for k in fold_ids], fold_ids=fold_ids, settings=settings,
        build_fn=load_builder(experiment_path, spec.experiment_attr), epochs=epochs, eager=eager,
        # XLA-compiled steps are opaque to TensorFlow's numeric checking.
        jit_compile="off" if check_numerics or eager else None, device_notice=notice, check_numerics=check_numerics,
    )
    if check_numerics:
        tf.debugging.enable_check_numerics()
    result: dict[str, Any] = {}
    try:
        while not result.get("done"):
            result = runner.step()
            on_epoch(result)
    except tf.errors.InvalidArgumentError as exc:
        if not check_numerics:
            raise
        return "nan", numerics_finding(str(exc), runner.trainer.models), result
    finally:
        if check_numerics:
            tf.debugging.disable_check_numerics()
    return trial_status(result), None, result


def numerics_finding(message: str, models: Sequence[Any]) -> NumericsFinding:
    """Op type, graph node and layer out of TensorFlow's check-numerics error text."""
    op = re.search(r'graph op "([^"]+)"', message) or re.search(r"op of type (\w+)", message)
    node = re.search(r"Detected at node (\S+?)/CheckNumerics", message)
    node_name = node.group(1) if node else ""
    layers = {layer.name: type(layer).__name__ for model in models for layer in model.layers}
    scopes = node_name.split("/")
    # Graph name scopes are layer names, uniquified with a _N suffix when traced more than once.
    candidates = [*scopes[:-1], *(re.sub(r"_\d+$", "", scope) for scope in scopes[:-1])]
    layer = next((scope for scope in candidates[1:] if scope in layers), None)
    if layer is not None:
        layer = f"{layer} ({layers[layer]})"
    else:
        layer = scopes[-2] if len(scopes) > 1 else "?"
    return NumericsFinding(op_type=op.group(1) if op else "?", node=node_name or "?", layer=layer)


def epoch_line(result: Mapping[str, Any], fold_ids: Sequence[int], metric: str) -> str:
    """`epoch 3: fold 0 val_loss 0.4123 val_accuracy 0.8812 | fold 1 ... | mean_val_accuracy 0.87`"""
    def number(value: Any) -> str:
        return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4f}"

    folds = " | ".join(
        f"fold {k} train_loss {number(result[f'split{k}_train_loss'])} val_loss {number(result[f'split{k}_val_loss'])} "
        f"val_accuracy {number(result[f'split{k}_val_accuracy'])}" for k in fold_ids)
    line = f"epoch {result['epoch']}: {folds} | mean_val_{metric} {number(result[f'mean_val_{metric}'])}"
    if result.get("nan_failures"):
        line += (f" | NaN in fold {result['nan_fold']} at epoch {result['nan_epoch']}, step {result['nan_step']}")
    return line


def single_config(spec: SweepSpec, domains: Mapping[str, Any], hyperparameters: Any,
                  overrides: Mapping[str, Any]) -> dict[str, Any]:
    """One config of a spec without searching: its fixed values, ``--set`` values, and defaults
    (the hypermodel's, or foldsweep's training defaults) for what the spec leaves open.

    Raises:
        InputError: a spec entry is a distribution and no ``--set`` gives its value.
    """
    from ray.tune.search import sample

    model_defaults = {hp.name: hp.default for hp in hyperparameters.space}
    config: dict[str, Any] = {}
    open_entries = []
    for name, domain in domains.items():
        if name in overrides:
            config[name] = overrides[name]
        elif not isinstance(domain, (sample.Domain, dict)):
            config[name] = domain
        elif name in spec.search.space:
            open_entries.append(name)
        elif name in model_defaults:
            config[name] = model_defaults[name]
        else:
            config[name] = TRAINING_DEFAULTS[name]
    if open_entries:
        raise InputError("search.space: a single trial needs one value for "
                         + ", ".join(f"{name} ({spec.search.space[name].kind} in the spec)" for name in open_entries)
                         + "; give it with --set " + " --set ".join(f"{name}=..." for name in open_entries))
    return config
