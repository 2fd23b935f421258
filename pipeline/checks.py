"""A spec checked against its data and model, before anything runs: ``validate``, ``run`` and
``trial`` call this module, and a sweep starts only from what it returns.

Two stages, as TensorFlow loads between them. ``check_inputs``, before it (well under a second:
a missing file, a misnamed array or a bad label is reported at once): the store, the
experiment's file, the data, its labels and groups, the Ray address; then it starts splitting
the folds beside the command (``folds_beside``). ``prepare``, once the model can be built: the
model against the data (its input shape, outputs against labels and loss, the objective among
its metrics, its replicas in a trial's memory), then the folds (``make_checked_folds``) and the
batch sizes against them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.base.errors import DataError, ExperimentError, SpecError
from pipeline.base.private_hooks import HOOKED_LIBRARIES, require_hooks
from pipeline.inputs.datasets import Dataset, channel_axis_hint, load_dataset
from pipeline.inputs.spec import GROUPED_SPLITTERS, SweepSpec

if TYPE_CHECKING:  # each loads TensorFlow or scikit-learn, which check_inputs runs without
    from pipeline.engine.runner import TrialSettings
    from pipeline.inputs.folds import FoldPlan
    from pipeline.inputs.space import SearchSpace


@dataclass(frozen=True)
class CheckedInputs:
    """What a sweep reads, checked: the store's URI, the experiment's file, the data, its folds."""

    tracking_uri: str
    experiment_path: Path
    dataset: Dataset
    dataset_path: str | None  # a data file, absolute (None for a built-in)
    num_samples: int
    address: str | None
    wait_for_folds: Callable[[], FoldPlan]  # the folds, split beside the command (``folds_beside``)
    warnings: tuple[str, ...] = ()  # what may be a mistake but is not refused


def check_inputs(
    spec: SweepSpec, *, tracking_uri: str | None = None, num_samples: int | None = None, address: str | None = None
) -> CheckedInputs:
    """Every check of a spec's inputs that needs no model, TensorFlow, Ray or folds; the folds
    start splitting once they pass.

    Raises:
        InputError: the store, experiment file, data or Ray address cannot work as asked.
    """
    from pipeline.inputs.folds import folds_beside
    from pipeline.records.stores import check_tracking_uri

    uri = tracking_uri or spec.tracking.uri
    check_tracking_uri(uri, source="--tracking-uri" if tracking_uri else f"{spec.source_path}: tracking.uri")
    if num_samples is not None and num_samples < 1:
        raise DataError(f"--num-samples must be >= 1, got {num_samples}")
    experiment_path = spec.resolve_path(spec.experiment_path, key="experiment")
    dataset_spec = spec.resolved_dataset()
    _refuse_a_file_named_as_a_builtin(spec)
    dataset = load_dataset(dataset_spec)
    source = dataset_spec.path or dataset.name  # what the messages name: the file, or the built-in
    _check_classes(dataset, source)
    _check_groups_kept_whole(spec, dataset, source)
    address = _checked_address(spec, address)
    warnings = []
    if spec.cv.groups == "ignore" and dataset.groups is None:
        warnings.append(f"cv.groups: ignore has nothing to ignore: {source!r} has no groups")
    return CheckedInputs(
        tracking_uri=uri,
        experiment_path=experiment_path,
        dataset=dataset,
        dataset_path=dataset_spec.path,
        num_samples=num_samples or spec.search.num_samples,
        address=address,
        wait_for_folds=folds_beside(spec.cv, dataset),
        warnings=tuple(warnings),
    )


def make_checked_folds(spec: SweepSpec, inputs: CheckedInputs) -> tuple[FoldPlan, tuple[str, ...]]:
    """The sweep's folds (``spec.cv``'s, which ``check_inputs`` started splitting), each training
    on two classes at least, and the warnings they earn (a grouped fold whose classes stray from
    the data's).

    Raises:
        DataError: more splits than the data allows, or a fold that trains on one class.
    """
    from pipeline.inputs.folds import class_balance_warning

    dataset = inputs.dataset
    folds = inputs.wait_for_folds()
    _check_folds_have_classes(spec, dataset, folds, inputs.dataset_path or dataset.name)
    warning = class_balance_warning(folds, dataset.y)
    return folds, (warning,) if warning else ()


def _refuse_a_file_named_as_a_builtin(spec: SweepSpec) -> None:
    """A dataset written without its file's suffix (``my_data`` beside my_data.npz) is read as the
    name of a built-in: where no built-in has it and a data file does, say which file.

    Raises:
        DataError: a file of that name and a data suffix is where the spec's paths are looked for.
    """
    from pipeline.inputs.datasets import BUILTINS

    name = spec.dataset.name
    if name is None or name in BUILTINS:
        return
    for directory in spec.search_directories():
        for candidate in (directory / f"{name}.npz", directory / name):
            if candidate.exists():
                written = f"{candidate.name}/" if candidate.is_dir() else candidate.name
                raise DataError(
                    f"{spec.source_path}: dataset: {name!r} is the name of no built-in dataset "
                    f"({', '.join(sorted(BUILTINS))}); a data file is named with its path: did you mean "
                    f"{written!r} ({str(candidate)!r})?"
                )


@dataclass(frozen=True)
class PreparedSweep:
    """A sweep whose inputs have all been checked: spec, experiment, data, folds, space."""

    spec: SweepSpec
    experiment_path: Path
    experiment: Any
    dataset: Dataset
    dataset_path: str | None  # a data file, absolute (None for a built-in)
    folds: FoldPlan
    space: SearchSpace
    tracking_uri: str
    num_samples: int
    address: str | None = None
    warnings: tuple[str, ...] = ()  # what may be a mistake but is not refused
    head_notes: tuple[str, ...] = ()  # how the default model's loss and metrics are given the labels

    @property
    def trial_count(self) -> int:
        """The trials the sweep runs (``SearchSpace.trial_count`` of its ``num_samples``)."""
        return self.space.trial_count(self.num_samples)

    def summary(self) -> str:
        """What ``validate`` found: the experiment, the data, the folds, the space and the trials."""
        val_sizes = ", ".join(str(fold["val_size"]) for fold in self.folds.manifest()["folds"])
        return (
            f"experiment {self.spec.experiment}, dataset {self.dataset.name} {self.dataset.x.shape}, "
            f"{self.spec.cv.describe()} (val sizes {val_sizes}), {len(self.space.domains)} hyperparameters, "
            f"{self.spec.search.algorithm} search, {self.trial_count} trials"
        )

    def sweep_plan(self) -> str:
        """What ``run`` starts: ``8 trials x 5 folds, 20 epochs, dataset mnist1d (4000, 40, 1),
        tracking sqlite:///mlflow.db``."""
        epochs = self.spec.train.epochs
        return (
            f"{self.trial_count} trials x {self.spec.cv.describe()}, {epochs} epoch{'' if epochs == 1 else 's'}, "
            f"dataset {self.dataset.name} {self.dataset.x.shape}, tracking {self.tracking_uri}"
        )

    def notes(self) -> list[str]:
        """What of the hypermodel's own compile and fit() the trials use and what the spec
        replaces, and how one-hot labels are split and scored."""
        notes = [*compile_notes(self.spec, self.experiment), *self.head_notes]
        if self.dataset.one_hot:
            notes.append(
                f"labels: one-hot rows of {self.dataset.one_hot_classes} classes, split by class; the loss and "
                "metrics get the rows, as fit gives them"
            )
        return notes

    def stacking_note(self) -> str:
        """Whether the default model has a stacked form (its folds trainable as one program, where
        the plan stacks them: one compute thread or a GPU, small batches), what of it is held once
        for every fold, or why it has none."""
        import keras

        from pipeline.engine.stacked import held_once_variables, model_blocker

        model = self.experiment.build({}, self.dataset.input_shape)
        try:
            blocker = model_blocker(model, random_draws="counter")
            held, trained = held_once_variables(model), model.trainable_variables
        finally:
            keras.backend.clear_session(free_memory=False)
        if blocker:
            return f"stacked form: none ({blocker}); its folds are never stacked"
        frozen = f", {len(held)} frozen held once for every fold" if held else ""
        return (
            f"stacked form: yes ({len(trained)} weights trained per fold{frozen}), for the trials the plan stacks "
            "(small batches on one compute thread or a GPU); each trial says how its folds train"
        )

    def trial_settings(self) -> TrialSettings:
        """What every trial of the sweep is run with (in Ray's workers, and by the refit)."""
        from pipeline.engine.runner import TrialSettings

        return TrialSettings.from_spec(
            self.spec,
            experiment_path=self.experiment_path,
            dataset_fingerprint=self.dataset.fingerprint,
            conditions=self.space.conditions,
            fit_arguments=self.experiment.fit_arguments,
        )


def prepare(
    spec: SweepSpec,
    *,
    tracking_uri: str | None = None,
    num_samples: int | None = None,
    address: str | None = None,
    hooks: Sequence[str] = HOOKED_LIBRARIES,
    inputs: CheckedInputs | None = None,
) -> PreparedSweep:
    """Check everything a sweep needs without starting Ray or writing to the tracking store.

    ``hooks``: the libraries whose private hooks are checked (``trial`` uses neither Ray Tune nor MLflow).
    ``inputs``: what ``check_inputs`` already made of the spec's inputs (the commands check them
    before TensorFlow loads); checked here otherwise.

    Raises:
        PrivateHookMissing: an installed library lacks what foldsweep reaches into (``private_hooks``).
        InputError: the experiment, dataset, folds or tracking URI cannot work as asked.
    """
    if inputs is None:
        inputs = check_inputs(spec, tracking_uri=tracking_uri, num_samples=num_samples, address=address)
    require_hooks(hooks)
    experiment, spec, space = load_experiment_and_space(spec, inputs.experiment_path, reference=spec.experiment)
    dataset = inputs.dataset
    head = _check_model_fits_data(spec, experiment, dataset, inputs.dataset_path or dataset.name)
    folds, fold_warnings = make_checked_folds(spec, inputs)
    _check_batch_fits_folds(spec, space, folds)
    return PreparedSweep(
        spec=spec,
        experiment_path=inputs.experiment_path,
        experiment=experiment,
        dataset=dataset,
        dataset_path=inputs.dataset_path,
        folds=folds,
        space=space,
        tracking_uri=inputs.tracking_uri,
        num_samples=inputs.num_samples,
        address=inputs.address,
        warnings=(*inputs.warnings, *_head_warnings(spec, head, dataset), *fold_warnings),
        head_notes=_head_notes(head, dataset),
    )


def prepare_driver(
    spec: SweepSpec,
    *,
    tracking_uri: str | None = None,
    num_samples: int | None = None,
    address: str | None = None,
    refit_here: bool = False,
    doing: Callable[[str], None] = lambda text: None,
    inputs_checked: Callable[[CheckedInputs], None] = lambda inputs: None,
) -> PreparedSweep:
    """``prepare`` in the process that drives the sweep (``run``, and ``validate``, which checks
    as it does): what needs no model first (``check_inputs``, before TensorFlow loads), then
    TensorFlow, with the XLA compile cache where the refit trains in this process
    (``refit_here``), and without GPUs. ``doing`` hears each stage as it starts;
    ``inputs_checked``, the inputs once they pass, before TensorFlow loads.

    Raises:
        PrivateHookMissing: an installed library lacks what foldsweep reaches into (``private_hooks``).
        InputError: the experiment, dataset, folds or tracking URI cannot work as asked.
    """
    from pipeline.base.quiet import import_tensorflow_and_keras

    doing(f"checking the data and folds of {spec.source_path}")
    inputs = check_inputs(spec, tracking_uri=tracking_uri, num_samples=num_samples, address=address)
    inputs_checked(inputs)
    doing(f"loading TensorFlow and building the model of {spec.experiment}")
    import_tensorflow_and_keras()
    if refit_here and spec.train.refit and spec.train.compile_cache:
        # The refit compiles in this process (on CPU, below), whose TensorFlow reads its XLA
        # flags in prepare.
        from pipeline.base.compile_cache import activate, device_kind

        activate(device_kind=device_kind(0))
    from pipeline.engine.runtime import hide_gpus

    # The driver holds no GPU memory: its TensorFlow (the default model built in prepare, the
    # refit) sees no GPU, and every GPU is the trials'. So the refit trains on CPU: TensorFlow
    # fixes its devices here, long before the refit, and a GPU visible to the driver would keep
    # a CUDA context, and all the memory the refit grew into (TensorFlow's allocator never
    # gives it back), for the whole sweep. A check needs no GPU either, and takes none from a
    # sweep running there.
    hide_gpus()
    return prepare(spec, inputs=inputs)


def load_experiment_and_space(
    spec: SweepSpec, experiment_path: Path, *, reference: str | None = None
) -> tuple[Any, SweepSpec, SearchSpace]:
    """The spec's hypermodel, loaded from ``experiment_path`` (``load_experiment``, its messages
    naming ``reference``); the spec with what the hypermodel's fit() sets that the spec leaves
    open (early stopping, class weights); and the search space over both's hyperparameters.

    Raises:
        ExperimentError: the hypermodel cannot be loaded or built (``load_experiment``).
        SpecError: the spec searches what the hypermodel does not declare (``build_space``).
    """
    from pipeline.inputs.hypermodel import load_experiment
    from pipeline.inputs.space import build_space

    experiment = load_experiment(experiment_path, spec.experiment_attr, reference=reference)
    spec = spec.with_fit_early_stopping(experiment.fit_early_stopping).with_fit_class_weight(
        experiment.fit_class_weight
    )
    space = build_space(spec, experiment.hyperparameters, own_optimizer=experiment.compiled_optimizer is not None)
    return experiment, spec, space


def compile_notes(spec: SweepSpec, experiment: Any) -> list[str]:
    """What of a hypermodel's own compile and fit() the trials use, and what the spec replaces."""
    notes = []
    optimizer = experiment.compiled_optimizer
    schedule = experiment.compiled_schedule
    if optimizer is not None:
        named = [name for name in ("optimizer", "learning_rate") if name in spec.search.space]
        if "optimizer" in named:
            rate = f"its {schedule} schedule" if schedule else "its learning rate"
            notes.append(
                f"search.space.optimizer replaces the {optimizer} optimizer that {spec.experiment} compiles "
                f"({rate} and settings too); the model's own loss is kept"
            )
        elif "learning_rate" in named and schedule:
            notes.append(
                f"search.space.learning_rate replaces the {schedule} schedule of the {optimizer} optimizer "
                f"that {spec.experiment} compiles with a constant; its other settings and loss are kept"
            )
        elif "learning_rate" in named:
            notes.append(
                f"search.space.learning_rate replaces the learning rate of the {optimizer} optimizer that "
                f"{spec.experiment} compiles; its other settings and loss are kept"
            )
        else:
            rate = f" with its {schedule} schedule" if schedule else ""
            notes.append(
                f"the {optimizer} optimizer{rate} and loss that {spec.experiment} compiles are used, one copy per fold"
            )
        clipping = experiment.compiled_clipping
        if clipping and "clipping" in spec.search.space and "optimizer" not in named:
            notes.append(
                f"search.space.clipping replaces the {clipping} of the {optimizer} optimizer that {spec.experiment} "
                "compiles: the trials clip as their clipping says, none not at all"
            )
        elif clipping and "optimizer" not in named:
            notes.append(
                f"the {optimizer} optimizer clips the gradients with its {clipping}; the trials' clipping param, none, "
                "is the spec's (search.space.clipping would replace it)"
            )
    from keras_tuner.src.engine.hyperparameters import hp_types

    declared_by_name = {hp.name: hp for hp in experiment.hyperparameters.space}
    for name, source in experiment.fit_arguments.items():
        constant = declared_by_name.get(source)  # a constant the fit passes is a fixed hyperparameter
        if source == name and isinstance(constant, hp_types.Fixed):
            replaced = f" (in place of train.epochs {spec.train.epochs})" if name == "epochs" else ""
            notes.append(f"{name} is {constant.value!r}, as {spec.experiment}'s fit() passes it{replaced}")
        else:
            notes.append(f"{name} comes from {spec.experiment}'s fit() (hyperparameter {source!r})")
    declared = set(declared_by_name)
    for name in ("batch_size", "epochs"):
        if name in declared and name not in experiment.fit_arguments and name not in spec.search.space:
            notes.append(
                f"{name} is the hyperparameter {spec.experiment}'s build(hp) declares: each trial trains with its "
                "value (KerasTuner's own fit() takes it only from a HyperModel.fit)"
            )
    rule = experiment.fit_early_stopping
    if rule is not None:
        if spec.train.early_stopping == rule:
            notes.append(
                f"EarlyStopping(monitor='val_{rule.monitor}', patience={rule.patience}) in {spec.experiment}'s "
                f"fit() becomes train.early_stopping: {rule.describe()}, on the trial's mean CV curve (one "
                "decision for all folds)"
            )
        elif spec.train.early_stopping is not None:  # the spec's own rule (a spec without one takes fit()'s)
            notes.append(
                f"the spec's train.early_stopping {spec.train.early_stopping.describe()} replaces the "
                f"EarlyStopping in {spec.experiment}'s fit()"
            )
        if experiment.fit_restores_best_weights and spec.train.select == "best_epoch":
            differs = (
                f", not at the epoch of the best val_{rule.monitor} that fit would restore"
                if rule.monitor != spec.train.metric
                else ""
            )
            notes.append(
                "restore_best_weights=True is what train.select: best_epoch does: each trial is scored at its best "
                f"epoch of {spec.objective.key}, as KerasTuner scores a trial by its objective, and the refit trains "
                f"that many epochs{differs}"
            )
        elif experiment.fit_restores_best_weights:
            notes.append(
                f"restore_best_weights=True is not applied: train.select {spec.train.select} scores each trial at "
                "its last epoch, and the refit trains as many"
            )
    return notes


def _check_classes(dataset: Dataset, source: str) -> None:
    """A classifier needs two classes: with one, every trial scores a trivial accuracy of 1."""
    if dataset.y.dtype.kind == "f" or dataset.y.ndim > 1:  # regression targets; labels per position (at validate)
        return
    classes = np.unique(dataset.y)
    if len(classes) < 2:
        raise DataError(
            f"dataset: y of {source!r} has a single class (every label is {int(classes[0])}); "
            "a classifier needs samples of at least two classes"
        )


def _check_groups_kept_whole(spec: SweepSpec, dataset: Dataset, source: str) -> None:
    """Data that carries groups (windows of one protein, recordings of one patient) is split with
    them kept whole, unless the spec ignores them on purpose: a splitter that ignores them puts
    near-copies of a validation sample in its training fold, and the scores come out optimistic
    (stratified CV scored a protein-window config 0.753 where group CV scored it 0.574)."""
    if dataset.groups is None or spec.cv.grouped or spec.cv.groups == "ignore":
        return
    n_groups = len(np.unique(dataset.groups))
    raise SpecError(
        f"{spec.source_path}: cv.splitter {spec.cv.splitter} ignores the groups of {source!r} ({n_groups:,} groups "
        f"over {len(dataset.y):,} samples): samples of one group would land on both sides of a fold, and the CV "
        f"scores would be optimistic; use cv.splitter: {' | '.join(GROUPED_SPLITTERS)}, or set cv.groups: ignore "
        "to split without them on purpose (recorded with the sweep)"
    )


def _check_folds_have_classes(spec: SweepSpec, dataset: Dataset, folds: Any, source: str) -> None:
    if dataset.y.dtype.kind == "f" or dataset.y.ndim > 1:
        return
    for j, fold in enumerate(folds.folds):
        classes = np.unique(dataset.y[fold.train])
        if len(classes) < 2:
            hint = (
                " (stratified_group keeps the classes' proportions in every fold)"
                if spec.cv.splitter == "group"
                else ""
            )
            raise DataError(
                f"{spec.source_path}: cv.splitter {spec.cv.splitter}: fold {j} of {source!r} trains on a "
                f"single class ({int(classes[0])}), so its model can only learn to predict it; use fewer "
                f"cv.n_splits, more groups, or another splitter{hint}"
            )


def _checked_address(spec: SweepSpec, address: str | None) -> str | None:
    """The Ray cluster to join (None: a local Ray), refused at once where nothing answers."""
    # Ray itself would join the cluster $RAY_ADDRESS names: it is an input like the flag and the key.
    source = "--address" if address else "resources.address" if spec.resources.address else "RAY_ADDRESS"
    address = address or spec.resources.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_ray_address(address, source=source)
    if address is None and spec.resources.cpu > (os.cpu_count() or 1):
        raise SpecError(
            f"{spec.source_path}: resources.cpu must be <= the CPUs of this machine "
            f"({os.cpu_count()}), got {spec.resources.cpu:g}"
        )
    return address


def check_ray_address(address: str, *, source: str = "--address") -> None:
    """Refuse a Ray address where nothing listens, at once: ray.init would wait minutes for it.

    Raises:
        InputError: malformed address, or no answer on its port.
    """
    import socket

    from pipeline.base.errors import InputError

    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"{source} must be host:port (e.g. 127.0.0.1:6379), got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as exc:
        raise InputError(f"{source}: no Ray cluster answers at {address!r}: {exc.strerror or exc}") from None


def _check_batch_fits_folds(spec: SweepSpec, space: SearchSpace, folds: FoldPlan) -> None:
    smallest = min(len(fold.train) for fold in folds.folds)
    largest = space.largest_value("batch_size")
    if largest is not None and largest > smallest:
        raise SpecError(
            f"{spec.source_path}: search.space.batch_size must be <= the smallest training fold "
            f"({smallest} samples), got {largest}"
        )


# The real samples the default model's outputs are checked on against its loss.
HEAD_CHECK_SAMPLES = 64


def _check_model_fits_data(spec: SweepSpec, experiment: Any, dataset: Dataset, source: str) -> Any:
    """The model takes the dataset's samples (built on their shape when it declares no input),
    its outputs are what its loss reads them as, and it has an output for every label of ``y``
    and ``y_test`` (labels 0 and 1 for a one-unit binary head). Returns the default model's head
    (``pipeline.inputs.hypermodel.ModelHead``)."""
    expected = experiment.input_shape
    if expected is not None and (
        len(expected) != len(dataset.input_shape)
        or any(want is not None and want != have for want, have in zip(expected, dataset.input_shape))
    ):
        raise DataError(
            f"dataset: samples of {source!r} have shape {dataset.input_shape}, but the model of "
            f"{spec.experiment} expects inputs of shape {tuple(expected)}{channel_axis_hint(dataset.input_shape)}"
        )
    head = experiment.head(
        dataset.x[:HEAD_CHECK_SAMPLES],
        train=spec.train,
        labels=dataset.y[:HEAD_CHECK_SAMPLES],
        one_hot=dataset.one_hot,
    )
    if dataset.one_hot and head.units != dataset.one_hot_classes:  # (one unit is refused by its loss)
        raise DataError(
            f"dataset: y of {source!r} holds one-hot rows of {dataset.one_hot_classes} classes, but the model of "
            f"{spec.experiment} has {head.units} outputs: fit cannot compare the two, end the model in "
            f"Dense({dataset.one_hot_classes}, ...)"
        )
    for name, labels in (("y", dataset.y), ("y_test", dataset.y_test)):
        if labels is None:
            continue
        if head.loss.regression:
            _check_targets_fit_outputs(spec, head, labels, name, source)
        elif head.loss.per_position:
            _check_positions_fit_outputs(spec, head, labels, name, source)
        elif head.loss.binary:
            others = sorted(set(np.unique(labels).tolist()) - {0, 1})
            if others:
                raise DataError(
                    f"dataset: {name} of {source!r} has labels {sorted(np.unique(labels).tolist())}, but the "
                    f"model of {spec.experiment} has one output unit, a binary classifier of labels 0 and 1 "
                    f"(got {others[:10]} besides): for {int(labels.max()) + 1} classes end the model in "
                    f"Dense({int(labels.max()) + 1}, activation='softmax')"
                )
        elif int(labels.max()) >= head.units:
            raise DataError(
                f"dataset: labels of {source!r} go up to {int(labels.max())}, but the model of {spec.experiment} "
                f"has only {head.units} outputs (in {name})"
            )
    if head.loss.per_position and spec.train.class_weight is not None:
        raise SpecError(
            f"{spec.source_path}: train.class_weight is not yet applied to labels per position (a padded "
            f"position's label indexes no weight): drop it, got {spec.train.class_weight!r}"
        )
    if head.loss.regression and spec.train.class_weight is not None:
        raise SpecError(
            f"{spec.source_path}: train.class_weight weighs classes, and {source!r} holds float "
            f"(regression) targets, which have none: drop it, got {spec.train.class_weight!r}"
        )
    _check_objective_computed(spec, head.scorers, classifier=not head.loss.regression)
    _check_replicas_fit(spec, head.parameters)
    if spec.train.jit_compile == "on":
        _check_xla_compiles(spec, experiment, dataset)
    return head


def _head_notes(head: Any, dataset: Dataset) -> tuple[str, ...]:
    """How integer labels reach a loss that takes one-hot rows, and the metrics beside it."""
    if not head.loss.one_hot or dataset.one_hot or head.loss.regression:
        return ()
    metrics = " and the metrics" if head.scorers else ""
    return (
        f"labels: integer classes, given to the loss {head.loss.name}{metrics} as one-hot rows, as fit gives "
        "them to_categorical(y) (fit refuses the integers under a loss that takes rows)",
    )


def _head_warnings(spec: SweepSpec, head: Any, dataset: Dataset) -> tuple[str, ...]:
    """What of the default model's head trains and is scored as the researcher wrote it but may
    not be what they meant: Keras' "accuracy" of a logit, thresholded at 0.5; more output units
    than the labels have classes."""
    warnings = []
    if head.loss.logits_thresholded_at_half:
        warnings.append(
            f"{spec.experiment} compiles metrics=['accuracy'] on one output unit that its loss "
            f"{head.loss.describe()} reads as logits: Keras' accuracy counts an output above 0.5 as class 1 "
            "(BinaryAccuracy's threshold) whatever the outputs are, and val_accuracy is scored as fit scores it. "
            "For the share of logits on the side of 0 of their label, compile "
            "keras.metrics.BinaryAccuracy(threshold=0.0)"
        )
    loss = head.loss
    if not (loss.regression or loss.per_position or loss.binary or dataset.one_hot):
        classes = int(np.max(dataset.y)) + 1
        if head.units > classes:
            warnings.append(
                f"the model of {spec.experiment} has {head.units} output units, and the labels of the dataset are "
                f"0..{classes - 1} ({classes} classes): the {head.units - classes} units no label names only learn "
                f"to say no; if that is not meant, end the model in Dense({classes}, ...)"
            )
    return tuple(warnings)


def _check_xla_compiles(spec: SweepSpec, experiment: Any, dataset: Dataset) -> None:
    """XLA, forced by the spec, can compile the default model's step (``xla_blocker``)."""
    import keras

    from pipeline.contract.plan import forced_xla_refusal, model_random_draws
    from pipeline.engine.xla_support import xla_blocker

    model = experiment.build({}, dataset.input_shape)
    try:
        counter = model_random_draws("auto", model) == "counter"
        blocker = xla_blocker(model, dataset.input_shape, counter_draws=counter)
    finally:
        keras.backend.clear_session(free_memory=False)
    if blocker is not None:
        raise SpecError(f"{spec.source_path}: {forced_xla_refusal(f'the model of {spec.experiment}', blocker)}")


def _check_positions_fit_outputs(spec: SweepSpec, head: Any, labels: np.ndarray, name: str, source: str) -> None:
    """Labels per position fill the model's output but its class axis, are classes of it, and are
    negative only where the loss ignores them (``ignore_class``)."""
    loss = head.loss
    target, output = tuple(labels.shape[1:]), tuple(head.output_shape)
    if target != output[:-1]:
        raise DataError(
            f"dataset: {name} of {source!r} holds integer labels of shape {target} per sample (one per position), but "
            f"the model of {spec.experiment} outputs shape {output} per sample and its loss {loss.describe()} wants a "
            f"label for each of its leading axes {output[:-1]} (its last axis, {output[-1]}, are the classes): "
            "make the two agree"
        )
    kept = labels[labels != loss.ignore_class] if loss.ignore_class is not None else labels
    if kept.size and kept.min() < 0:
        raise DataError(
            f"dataset: {name} of {source!r} has negative labels per position (e.g. {int(kept.min())}) that its loss "
            f"{loss.describe()} does not ignore: padded positions need "
            f"keras.losses.SparseCategoricalCrossentropy(ignore_class={int(kept.min())})"
        )
    if kept.size and int(kept.max()) >= head.units:
        raise DataError(
            f"dataset: labels of {source!r} go up to {int(kept.max())}, but the model of {spec.experiment} "
            f"has only {head.units} outputs per position (in {name})"
        )


def _check_targets_fit_outputs(spec: SweepSpec, head: Any, targets: np.ndarray, name: str, source: str) -> None:
    """Float targets of one sample have the shape of the model's output for it, or one axis less
    against a last axis of 1 (a target per sample against Dense(1), as Keras' losses take it)."""
    target, output = tuple(targets.shape[1:]), tuple(head.output_shape)
    if target == output or (target + (1,)) == output:
        return
    raise DataError(
        f"dataset: {name} of {source!r} holds float (regression) targets of shape {target} per sample, but the model "
        f"of {spec.experiment} outputs shape {output} per sample and its loss {head.loss.describe()} compares the two "
        f"element by element: end the model in Dense({int(np.prod(target)) if target else 1}) (reshaped to {target or '(1,)'}), "
        "or store targets of its output's shape"
    )


def _check_objective_computed(spec: SweepSpec, scorers: Sequence[Any], *, classifier: bool = True) -> None:
    """``train.metric`` (and an early stopping monitor) is a scalar score the model computes."""
    from pipeline.inputs.scoring import objective_problem

    train = spec.train
    for scorer in scorers:
        if not scorer.scalar:
            raise ExperimentError(
                f"experiment: the model of {spec.experiment} compiles the metric {scorer.name}, which gives several "
                "values per fold (one per class, as F1Score(average=None)); foldsweep records one value per metric "
                "and fold: compile it with average='macro' or 'weighted', or drop it"
            )
    watched = [("train", train.metric, train.mode)]
    if train.early_stopping is not None:
        watched.append(("train.early_stopping", train.early_stopping.monitor, train.early_stopping.objective.mode))
    for section, metric, mode in watched:
        problem = objective_problem(metric, mode, scorers, classifier=classifier)
        if problem:
            key, rule = problem
            key = "monitor" if section != "train" and key == "metric" else key
            raise SpecError(f"{spec.source_path}: {section}.{key} {rule}, got {metric!r}")


# float32 weights, their gradients and two optimizer slots (Adam's moments): what each replica
# of a trial holds at the least, whatever its batch.
BYTES_PER_PARAMETER = 4 * 4


def _check_replicas_fit(spec: SweepSpec, parameters: int) -> None:
    """A trial trains all ``cv.n_repeats x cv.n_splits`` replicas at once: refuse a count whose
    models alone (the default model's size) would not fit in the memory a trial has."""
    from pipeline.engine.runtime import memory_per_trial_mb

    cv, resources = spec.cv, spec.resources
    budget = memory_per_trial_mb(cpus=resources.cpu, gpus=resources.gpu, max_concurrent=resources.max_concurrent)
    needed_mb = cv.replicas * parameters * BYTES_PER_PARAMETER / 2**20
    if budget is not None and needed_mb > budget[0]:
        raise SpecError(
            f"{spec.source_path}: cv.n_repeats: {cv.n_repeats} repeats x {cv.n_splits} folds = {cv.replicas:,} "
            f"replicas of the default model ({parameters:,} parameters) need at least {needed_mb:,.0f} MiB of "
            f"weights, gradients and optimizer state per trial, more than the {budget[0]:,} MiB a trial has "
            f"({budget[1]}); lower cv.n_repeats, got {cv.n_repeats}"
        )
