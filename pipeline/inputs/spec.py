"""Sweep specs: load a YAML file into typed, frozen objects, checking every rule on the way.

This module imports no heavy library so that ``foldsweep validate`` answers at once. Every
failure is a ``SpecError`` whose message names the file, the YAML key, the rule and the value.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, get_args, overload

import yaml

from pipeline.base.errors import SpecError
from pipeline.inputs.scoring import KNOWN_DIRECTIONS, OWN_SCORES, Direction, direction_of

# Each vocabulary's words are written once, as a Literal type; its tuple is read from that.
SplitterName = Literal["kfold", "stratified", "group", "stratified_group"]
SPLITTERS: tuple[SplitterName, ...] = get_args(SplitterName)
SEARCH_ALGORITHMS: tuple[str, ...] = ("random", "grid", "optuna")
SCHEDULERS: tuple[str, ...] = ("fifo", "asha", "median")
# Which epoch of a trial it is scored at: the best of its mean CV curve (as KerasTuner), or its last.
EpochSelection = Literal["best_epoch", "last"]
EPOCH_SELECTIONS: tuple[EpochSelection, ...] = get_args(EpochSelection)
# How TensorFlow's graph optimizer (Grappler) works through each traced function before its
# first run (train.graph_optimizer): "light" runs its passes in one round and without its MLIR
# (TFG) pipelines, "full" as TensorFlow does by default (two rounds, with them). A second round
# may rewrite more of a graph, and so change its float rounding (pipeline.contract.plan records it).
GraphOptimizer = Literal["light", "full"]
GRAPH_OPTIMIZERS: tuple[GraphOptimizer, ...] = get_args(GraphOptimizer)
# Gradient clipping (`clipping`, a training hyperparameter): each kind and the Keras optimizer
# argument that applies it (pipeline.engine.recipe passes it, pipeline.engine.stacked mirrors it).
NO_CLIPPING = "none"
# The largest seed NumPy's legacy RandomState takes, which seeds scikit-learn's splitters
# (``random_state``), the searchers' draws and the built-in datasets made with one.
LARGEST_LEGACY_SEED = 2**32 - 1
CLIPPING_ARGUMENTS: Mapping[str, str] = {"norm": "clipnorm", "value": "clipvalue", "global_norm": "global_clipnorm"}
CLIPPING_KINDS: tuple[str, ...] = (NO_CLIPPING, *CLIPPING_ARGUMENTS)
# A Keras metric identifier or name: what train.metric, train.metrics and a monitor may hold.
_METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODES: tuple[Direction, ...] = get_args(Direction)
# cv.groups: whether a dataset's groups must be kept whole in every fold (a grouped splitter),
# or are ignored on purpose (recorded with the sweep).
GroupRule = Literal["respect", "ignore"]
GROUP_RULES: tuple[GroupRule, ...] = get_args(GroupRule)
GROUPED_SPLITTERS: tuple[SplitterName, ...] = ("group", "stratified_group")
# The optimizers foldsweep makes itself (`optimizer`, a training hyperparameter): each one's class
# in keras.optimizers, named (the spec is read before TensorFlow may start), and fixed arguments.
OPTIMIZERS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "sgd": ("SGD", {"momentum": 0.9}),
    "rmsprop": ("RMSprop", {}),
}
ParamKind = Literal["choice", "grid", "uniform", "loguniform", "randint", "qrandint"]
PARAM_KINDS: tuple[ParamKind, ...] = get_args(ParamKind)

# Training hyperparameters foldsweep itself applies; every other name in `search.space` must be
# a hyperparameter that the experiment's build(hp) asks for. `epochs` defaults to train.epochs;
# `clip_threshold` only counts when `clipping` is not none.
TRAINING_DEFAULTS: Mapping[str, Any] = {
    "batch_size": 32,
    "learning_rate": 1e-3,
    "optimizer": "adam",
    "epochs": None,
    "clipping": NO_CLIPPING,
    "clip_threshold": 1.0,
}


@dataclass(frozen=True)
class ParamSpec:
    """One entry of `search.space`: a fixed value or a distribution with its arguments."""

    kind: Literal["fixed", ParamKind]
    args: tuple[Any, ...]

    def values(self) -> tuple[Any, ...]:
        """The finite set of values this entry can take (fixed, choice, grid); else empty."""
        if self.kind == "fixed":
            return self.args
        if self.kind in ("choice", "grid"):
            return self.args
        return ()


# How the images of an image folder are read (``dataset: {images: DIR, color_mode: ...}``): the
# modes of Keras' image_dataset_from_directory, which gives 3, 1 and 4 channels.
COLOR_MODES = ("rgb", "grayscale", "rgba")
DEFAULT_COLOR_MODE = "rgb"  # Keras' default too


@dataclass(frozen=True)
class DatasetSpec:
    """A built-in dataset (``name`` with generator ``options``), a file (``path``), or a folder of
    class subfolders of image files (``path`` with ``images`` true, options ``image_size`` and
    ``color_mode``)."""

    name: str | None = None
    path: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    images: bool = False

    @property
    def label(self) -> str:
        return self.name if self.name is not None else str(self.path)


@dataclass(frozen=True)
class CVSpec:
    splitter: SplitterName = "stratified"
    n_splits: int = 5
    seed: int = 0
    n_repeats: int = 1
    groups: GroupRule = "respect"

    @property
    def grouped(self) -> bool:
        """Whether the splitter keeps each group on one side of every fold."""
        return self.splitter in GROUPED_SPLITTERS

    @property
    def replicas(self) -> int:
        """Models a trial trains: every fold of every repeat."""
        return self.n_splits * self.n_repeats

    def describe(self) -> str:
        """``5 folds``, or ``3 x 5 folds (15 replicas)``."""
        if self.n_repeats == 1:
            return f"{self.n_splits} folds"
        return f"{self.n_repeats} x {self.n_splits} folds ({self.replicas} replicas)"


@dataclass(frozen=True)
class SchedulerSpec:
    """Early stopping on the per-epoch CV mean: fifo (none), asha, or median stopping."""

    name: str = "fifo"
    grace_period: int = 1
    reduction_factor: int = 3
    min_samples_required: int = 3


@dataclass(frozen=True)
class SearchSpec:
    algorithm: str = "random"
    num_samples: int = 1
    seed: int = 0
    space: Mapping[str, ParamSpec] = field(default_factory=dict)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)

    def trials_at_most(self, num_samples: int) -> int | None:
        """At most how many trials the search runs, as far as the spec alone tells before the
        model is loaded: ``num_samples``, where nothing is a grid (each grid point runs
        ``num_samples`` configs); None where it cannot tell."""
        if self.algorithm == "grid" or any(param.kind == "grid" for param in self.space.values()):
            return None
        return num_samples


@dataclass(frozen=True)
class Objective:
    """The CV score trials are ranked on: ``mean_val_<metric>``, higher or lower is better."""

    metric: str = "accuracy"
    mode: Direction = "max"

    @classmethod
    def for_metric(cls, metric: str, mode: Direction | None = None) -> Objective:
        """The metric with the direction in which it improves (loss: lower is better): ``mode``
        for a metric of foldsweep's it does not know the direction of."""
        return cls(metric=metric, mode=mode or OWN_SCORES[metric])

    @property
    def key(self) -> str:
        """The reported key schedulers and the leaderboard rank on."""
        return f"mean_val_{self.metric}"

    @property
    def spread_key(self) -> str:
        return f"std_val_{self.metric}"

    @property
    def fold_key(self) -> str:
        """Each replica's score: ``split{j}_<fold_key>``."""
        return f"val_{self.metric}"

    def sort_key(self, value: float) -> float:
        """Ascending sort key: best first."""
        return -value if self.mode == "max" else value

    def better(self, value: float, than: float) -> bool:
        return self.sort_key(value) < self.sort_key(than)


# A switch foldsweep decides by default and a spec can force (YAML auto | true | false).
AutoSwitch = Literal["auto", "on", "off"]
# fit(class_weight=...): "balanced" (scikit-learn's rule, from each training fold's labels) or
# {label: weight}.
ClassWeight = Literal["balanced"] | Mapping[int, float]


@dataclass(frozen=True)
class EarlyStoppingSpec:
    """A trial's own patience on its mean CV curve, as Keras' ``EarlyStopping`` on ``val_<monitor>``."""

    patience: int
    monitor: str = "accuracy"
    min_delta: float = 0.0
    start_from_epoch: int = 0
    baseline: float | None = None
    # The monitored metric's direction where foldsweep does not know it (train.mode for train.metric).
    mode: Direction | None = None

    @property
    def objective(self) -> Objective:
        """The curve watched and its direction (loss: lower is better)."""
        return Objective.for_metric(self.monitor, self.mode)

    def describe(self) -> str:
        extras = [f"min_delta: {self.min_delta:g}"] if self.min_delta else []
        extras += [f"start_from_epoch: {self.start_from_epoch}"] if self.start_from_epoch else []
        extras += [f"baseline: {self.baseline:g}"] if self.baseline is not None else []
        return "{" + ", ".join([f"patience: {self.patience}", f"monitor: {self.monitor}", *extras]) + "}"


@dataclass(frozen=True)
class TrainSpec:
    epochs: int = 10
    metric: str = "accuracy"
    mode: Direction = "max"
    # Keras metric identifiers scored besides the model's compiled metrics (for uncompiled models).
    metrics: tuple[str, ...] = ()
    # A Keras loss identifier for a model that compiles none (required for float targets).
    loss: str | None = None
    # ``ClassWeight``; None trains the loss unweighted.
    class_weight: ClassWeight | None = None
    seed: int = 0
    from_logits: bool = False
    # Of foldsweep's own loss: each label's target spread over the classes by this share.
    label_smoothing: float = 0.0
    jit_compile: AutoSwitch = "auto"
    fused: AutoSwitch = "auto"
    steps_per_launch: int | Literal["auto"] = "auto"
    # An uncompiled training step inlined at each call of the epoch, as trials recorded before it
    # was called as a function of its own: slower to optimize, their float rounding.
    inline_step: bool = False
    # An epoch's short last batch padded to the batch size and masked, where that trains the same
    # samples with the same numbers but for float rounding: one compiled program per batch size,
    # not one more per distinct last batch (``pipeline.contract.plan``); false computes it as is.
    pad_last_batch: bool = True
    # TensorFlow's graph optimizer in one light round (``GraphOptimizer``): less of each trial's
    # compile; "full" runs it as TensorFlow does, as trials recorded before it ran.
    graph_optimizer: GraphOptimizer = "light"
    refit: bool = True
    select: EpochSelection = "best_epoch"
    early_stopping: EarlyStoppingSpec | None = None  # off unless the spec (or a HyperModel.fit) asks
    # Compiled XLA programs are kept on disk and reused by later trials, reruns and sweeps
    # (pipeline.base.compile_cache); FOLDSWEEP_COMPILE_CACHE=off switches it off for a machine.
    compile_cache: bool = True


@dataclass(frozen=True)
class ResourcesSpec:
    cpu: float = 1.0
    gpu: float = 0.0
    max_concurrent: int | None = None
    max_failures: int = 0
    address: str | None = None
    # Trials one worker process runs before a fresh one takes over; auto: as its memory
    # mappings near the kernel's limit (pipeline.engine.lifespan).
    max_trials_per_worker: int | Literal["auto"] = "auto"
    # MiB a worker process may hold before a fresh one takes over; auto: a trial's share of the
    # host's memory (pipeline.engine.lifespan).
    max_worker_memory: int | Literal["auto"] = "auto"


@dataclass(frozen=True)
class TrackingSpec:
    uri: str = "sqlite:///mlflow.db"
    # Register the refit as a new version of this registered model (none: nothing registered).
    register_model: str | None = None
    # Move this alias of the registered model to the new version (none: no alias moves).
    model_alias: str | None = None
    # The driver's host sampled (CPU, memory, disk, network, GPU) on the parent run, by MLflow's monitor.
    system_metrics: bool = True


# What ``tracking.model_alias: true`` moves; MLflow keeps ``latest`` and ``v<number>`` for itself.
DEFAULT_MODEL_ALIAS = "champion"
_ALIAS = re.compile(r"[A-Za-z0-9_-]+")
_RESERVED_ALIAS = re.compile(r"latest|v\d+", re.IGNORECASE)


def check_registered_model_name(name: str, *, source: str) -> None:
    """A registered model's name MLflow accepts: not empty, no ``/`` nor ``:``, not ``.`` or ``..``.

    Raises:
        SpecError: any other.
    """
    if not name.strip() or "/" in name or ":" in name or name in (".", ".."):
        raise SpecError(
            f"{source} must be the name of a registered model (not empty, no / nor :, not . or ..), got {name!r}"
        )


def check_model_alias(alias: str, *, source: str) -> None:
    """An alias MLflow accepts: letters, digits, ``_`` and ``-``, not ``latest`` nor ``v<number>``.

    Raises:
        SpecError: any other.
    """
    if not _ALIAS.fullmatch(alias) or _RESERVED_ALIAS.fullmatch(alias):
        raise SpecError(
            f"{source} must be letters, digits, _ and - (not latest nor v<number>, which MLflow keeps), got {alias!r}"
        )


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep spec. ``source_text`` is the YAML as written, kept for MLflow."""

    name: str
    experiment: str
    dataset: DatasetSpec
    cv: CVSpec
    search: SearchSpec
    train: TrainSpec
    resources: ResourcesSpec
    tracking: TrackingSpec
    source_path: Path
    source_text: str

    @property
    def experiment_path(self) -> Path:
        """The experiment file as written in the spec (``resolve_path`` finds it)."""
        return Path(self.experiment.rsplit(":", 1)[0])

    def search_directories(self) -> list[Path]:
        """Where a relative path of the spec is looked for, in order: the working directory, the
        spec's directory, and the directories above it up to its project's root (the first with a
        ``pyproject.toml`` or ``.git``), so that a shipped spec works from any directory."""
        spec_directory = self.source_path.parent.resolve()
        root = next(
            (
                directory
                for directory in (spec_directory, *spec_directory.parents)
                if (directory / "pyproject.toml").exists() or (directory / ".git").exists()
            ),
            None,
        )
        above = [
            directory for directory in spec_directory.parents if root is not None and directory.is_relative_to(root)
        ]
        return list(dict.fromkeys([Path.cwd(), spec_directory, *above]))

    def resolve_path(self, path: str | Path, *, key: str) -> Path:
        """A path of the spec (YAML key ``key``), made absolute: see ``search_directories``.

        Raises:
            SpecError: the path exists in none of them; the message lists where it looked.
        """
        written = Path(path).expanduser()
        if written.is_absolute():
            if written.exists():
                return written
            raise SpecError(f"{self.source_path}: {key}: file not found: {str(path)!r}")
        directories = self.search_directories()
        for directory in directories:
            if (directory / written).exists():
                return (directory / written).resolve()
        raise SpecError(
            f"{self.source_path}: {key}: file not found: {str(path)!r}; looked in "
            + ", ".join(str(directory) for directory in directories)
        )

    def resolved_dataset(self) -> DatasetSpec:
        """The dataset entry with a file path made absolute (built-ins as they are)."""
        if self.dataset.path is None:
            return self.dataset
        key = "dataset.images" if self.dataset.images else "dataset"
        return replace(self.dataset, path=str(self.resolve_path(self.dataset.path, key=key)))

    @property
    def longest_epochs(self) -> int:
        """The most epochs a trial of the sweep trains: the largest of ``search.space.epochs``
        (integer values or [low, high(, q)] bounds, by the spec's rules), else ``train.epochs``."""
        searched = self.search.space.get("epochs")
        if searched is None:
            return self.train.epochs
        return int(max(searched.values() or searched.args[:2]))

    @property
    def experiment_attr(self) -> str:
        return self.experiment.rsplit(":", 1)[1] if ":" in self.experiment else "build"

    @property
    def objective(self) -> Objective:
        """What schedulers, searchers and the leaderboard rank on."""
        return Objective(metric=self.train.metric, mode=self.train.mode)

    def with_fit_class_weight(self, class_weight: Mapping[int, float] | None) -> SweepSpec:
        """The spec with a HyperModel.fit's class_weight as its ``train.class_weight``, where the
        spec sets none (the spec's own wins)."""
        if class_weight is None or self.train.class_weight is not None:
            return self
        return replace(self, train=replace(self.train, class_weight=dict(class_weight)))

    def with_fit_early_stopping(self, rule: EarlyStoppingSpec | None) -> SweepSpec:
        """The spec with a HyperModel.fit's EarlyStopping as its ``train.early_stopping``, where
        the spec sets none (the spec's own wins)."""
        if rule is None or self.train.early_stopping is not None:
            return self
        return replace(self, train=replace(self.train, early_stopping=rule))


def default_of(cls: type, name: str) -> Any:
    """The default a spec dataclass declares for its field ``name``: the one place it is written
    (the parser reads it from there, never writing it again), for a class with required fields."""
    for declared in fields(cls):
        if declared.name == name:
            if declared.default is not MISSING:
                return declared.default
            if declared.default_factory is not MISSING:
                return declared.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec file.

    Raises:
        SpecError: the file is missing or not YAML, or any key breaks a rule.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: spec file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{path}: a spec must be UTF-8 text (YAML); byte {exc.start} is {exc.object[exc.start]:#04x}, "
            "which is not UTF-8 (a binary file, or another encoding?)"
        ) from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec: {exc.strerror or exc}") from None
    try:
        data = read_yaml(text)
    except DuplicateKeyError as exc:
        raise SpecError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{path}: not valid YAML{where}: {problem}") from None
    return parse_spec(data, source_path=path, source_text=text)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice; YAML would silently keep the last one."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that a mapping repeats (``train:`` written twice), and
    reading numbers as YAML 1.2 and researchers write them: PyYAML follows YAML 1.1, where a float
    needs a dot, so ``1e-4`` would be the string '1e-4'."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(
                    f"key {key!r} appears twice in the same mapping, at lines {seen[key]} and {line}: YAML would "
                    "silently keep the last one; merge them into one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's float (core schema), which also reads 1e-4, 1E-3 and .5; PyYAML's own 1.1 forms
# (1.0e-4, 1_000.5, 190:20:30.15) still match its resolver, which comes first.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """A YAML document (a spec, a ``--set`` value) read as ``load_spec`` reads one.

    Raises:
        yaml.YAMLError: not YAML, or a mapping that repeats a key (``DuplicateKeyError``).
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)


def parse_spec(data: Any, *, source_path: Path, source_text: str = "") -> SweepSpec:
    """Validate an already-parsed YAML document (see ``load_spec``)."""
    root = _Section(data, "", str(source_path))
    name = root.string("name", required=True, pattern_hint="a non-empty name")
    experiment = root.string("experiment", required=True)
    if not experiment.rsplit(":", 1)[0].endswith(".py"):
        root.fail("experiment", "must be a path to a .py file, optionally followed by :function", experiment)
    dataset = _parse_dataset(root)
    cv = _parse_cv(root.section("cv"))
    search = _parse_search(root.section("search"))
    train = _parse_train(root.section("train"))
    resources = _parse_resources(root.section("resources"))
    tracking = root.section("tracking").done_with(_parse_tracking)
    root.finish()
    spec = SweepSpec(
        name=name,
        experiment=experiment,
        dataset=dataset,
        cv=cv,
        search=search,
        train=train,
        resources=resources,
        tracking=tracking,
        source_path=source_path,
        source_text=source_text,
    )
    _check_scheduler_can_act(spec)
    return spec


def _parse_dataset(root: _Section) -> DatasetSpec:
    raw = root.peek("dataset")
    if raw is None:
        root.fail(
            "dataset", "is required: a built-in name (e.g. mnist1d), a file path, or a mapping with name or path", None
        )
    if isinstance(raw, str):
        root.take("dataset")
        if not raw.strip():
            root.fail("dataset", "must not be empty", raw)
        looks_like_file = "/" in raw or "." in Path(raw).name
        return DatasetSpec(path=raw) if looks_like_file else DatasetSpec(name=raw)
    section = root.section("dataset")
    if section.peek("images") is not None:
        return _parse_image_folder(section)
    name = section.string("name")
    file = section.string("path")
    if (name is None) == (file is None):
        section.fail(
            "name",
            "exactly one of dataset.name, dataset.path and dataset.images must be given",
            {"name": name, "path": file},
        )
    options = {key: section.take(key) for key in list(section.remaining())}
    for key, value in options.items():
        if not isinstance(value, (int, float, str, bool)):
            section.fail(key, "must be a number, string or boolean", value)
    return DatasetSpec(name=name, path=file, options=options)


def _parse_image_folder(section: _Section) -> DatasetSpec:
    """``dataset: {images: DIR, image_size: [H, W], color_mode: rgb}``: DIR holds a subfolder of
    image files per class (or train/ and test/ folders that each do), as Keras'
    image_dataset_from_directory reads them."""
    folder = section.string("images", required=True)
    for other in ("name", "path"):
        if section.peek(other) is not None:
            section.fail(
                other, "exactly one of dataset.name, dataset.path and dataset.images must be given", section.peek(other)
            )
    options: dict[str, Any] = {"color_mode": section.one_of("color_mode", COLOR_MODES, default=DEFAULT_COLOR_MODE)}
    size = section.take("image_size") if section.peek("image_size") is not None else None
    if size is not None:
        if (
            not isinstance(size, list)
            or len(size) != 2
            or not all(isinstance(side, int) and not isinstance(side, bool) and side >= 1 for side in size)
        ):
            section.fail("image_size", "must be [height, width], two integers >= 1", size)
        options["image_size"] = list(size)
    section.finish()
    return DatasetSpec(path=folder, options=options, images=True)


def _parse_cv(section: _Section) -> CVSpec:
    default = CVSpec()
    splitter = section.one_of("splitter", SPLITTERS, default=default.splitter)
    n_splits = section.integer("n_splits", default=default.n_splits, minimum=2)
    seed = section.integer("seed", default=default.seed, minimum=0, maximum=LARGEST_LEGACY_SEED)
    n_repeats = section.integer("n_repeats", default=default.n_repeats, minimum=1)
    groups = section.one_of("groups", GROUP_RULES, default=default.groups)
    if groups == "ignore" and splitter in GROUPED_SPLITTERS:
        section.fail(
            "groups",
            f"ignore contradicts cv.splitter {splitter}, which keeps every group whole; drop "
            "cv.groups, or use cv.splitter kfold | stratified to split without the groups",
            groups,
        )
    section.finish()
    return CVSpec(splitter=splitter, n_splits=n_splits, seed=seed, n_repeats=n_repeats, groups=groups)


def _parse_search(section: _Section) -> SearchSpec:
    default = SearchSpec()
    algorithm = section.one_of("algorithm", SEARCH_ALGORITHMS, default=default.algorithm)
    num_samples = section.integer("num_samples", default=default.num_samples, minimum=1)
    seed = section.integer("seed", default=default.seed, minimum=0, maximum=LARGEST_LEGACY_SEED)
    space_section = section.section("space")
    space = {key: _parse_param(space_section, key) for key in list(space_section.remaining())}
    for key, param in space.items():
        if algorithm == "grid" and param.kind not in ("fixed", "choice", "grid"):
            space_section.fail(key, "must be a fixed value, choice or grid when search.algorithm is grid", param.kind)
        if algorithm == "optuna" and param.kind == "grid":
            space_section.fail(key, "cannot be a grid with search.algorithm optuna (use choice)", param.kind)
    scheduler = _parse_scheduler(section)
    section.finish()
    return SearchSpec(algorithm=algorithm, num_samples=num_samples, seed=seed, space=space, scheduler=scheduler)


def _parse_scheduler(search: _Section) -> SchedulerSpec:
    default = SchedulerSpec()
    raw = search.peek("scheduler")
    if raw is None or isinstance(raw, str):
        name = search.one_of("scheduler", SCHEDULERS, default=default.name)
        return SchedulerSpec(name=name)
    section = search.section("scheduler")
    name = section.one_of("name", SCHEDULERS, default=default.name)
    scheduler = SchedulerSpec(
        name=name,
        grace_period=section.integer("grace_period", default=default.grace_period, minimum=1),
        reduction_factor=section.integer("reduction_factor", default=default.reduction_factor, minimum=2),
        min_samples_required=section.integer("min_samples_required", default=default.min_samples_required, minimum=1),
    )
    section.finish()
    return scheduler


def _check_scheduler_can_act(spec: SweepSpec) -> None:
    """ASHA and median stopping compare trials from ``grace_period`` epochs on: a grace period
    that reaches the last epoch leaves them nothing to stop."""
    scheduler = spec.search.scheduler
    if scheduler.name == "fifo":
        return
    longest = spec.longest_epochs
    where = "search.space.epochs" if "epochs" in spec.search.space else "train.epochs"
    if scheduler.grace_period >= longest:
        raise SpecError(
            f"{spec.source_path}: search.scheduler.grace_period must be below the epochs a trial trains ({where}: at most "
            f"{longest}), or {scheduler.name} can never stop a trial early, got grace_period={scheduler.grace_period}; "
            "lower it or use scheduler fifo"
        )


def _parse_param(section: _Section, key: str) -> ParamSpec:
    raw = section.take(key)
    where = section.key_path(key)
    if isinstance(raw, Mapping):
        if len(raw) != 1:
            section.fail(key, f"must be a fixed value or a mapping with exactly one of {', '.join(PARAM_KINDS)}", raw)
        kind, args = next(iter(raw.items()))
        if kind not in PARAM_KINDS:
            section.fail(
                key, f"distribution must be one of {', '.join(PARAM_KINDS)}{_suggest(kind, PARAM_KINDS)}", kind
            )
        param = _parse_distribution(section.file, f"{where}.{kind}", kind, args)
    elif isinstance(raw, list):
        section.fail(key, "a list is ambiguous: write {choice: [...]} or {grid: [...]}", raw)
    elif raw is None:
        section.fail(key, "must have a value", raw)
    else:
        param = ParamSpec("fixed", (raw,))
    if key in TRAINING_DEFAULTS:
        check_training_param(section.file, where, key, param)
    return param


def _parse_distribution(file: str, where: str, kind: ParamKind, args: Any) -> ParamSpec:
    def fail(rule: str) -> NoReturn:
        raise SpecError(f"{file}: {where} {rule}, got {args!r}")

    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            fail("must be a non-empty list of values")
        if any(isinstance(value, (list, Mapping)) or value is None for value in args):
            fail("values must be numbers, strings or booleans")
        return ParamSpec(kind, tuple(args))
    arity = 3 if kind == "qrandint" else 2
    shape = "[low, high, q]" if kind == "qrandint" else "[low, high]"
    if not isinstance(args, list) or len(args) != arity:
        fail(f"must be a list {shape}")
    integral = kind in ("randint", "qrandint")
    for value in args:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(f"must be finite numbers {shape}")
        if integral and not float(value).is_integer():
            fail(f"must be integers {shape}")
    low, high = args[0], args[1]
    if low >= high:
        fail("needs low < high")
    if kind == "loguniform" and low <= 0:
        fail("needs low > 0 (log scale)")
    if kind == "qrandint" and args[2] <= 0:
        fail("needs q > 0")
    if integral:
        return ParamSpec(kind, tuple(int(value) for value in args))
    return ParamSpec(kind, tuple(float(value) for value in args))


# Training hyperparameters ruled by sign and type.
POSITIVE_INTEGER_PARAMS: tuple[str, ...] = ("batch_size", "epochs")
POSITIVE_NUMBER_PARAMS: tuple[str, ...] = ("learning_rate", "clip_threshold")


def check_training_param(file: str, where: str, name: str, param: ParamSpec) -> None:
    """Range rules of the training hyperparameters, on every value they can take."""
    values = param.values()
    bounds = param.args[:2] if not values else ()
    if name in POSITIVE_INTEGER_PARAMS:
        if param.kind in ("uniform", "loguniform"):
            raise SpecError(
                f"{file}: {where} must take integer values (use choice, grid, randint or qrandint), got {param.kind}"
            )
        for value in (*values, *bounds):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{file}: {where} must be a positive integer (every value it takes), got {value!r}")
    elif name in POSITIVE_NUMBER_PARAMS:
        for value in (*values, *bounds):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SpecError(f"{file}: {where} must be a number > 0 (every value it takes), got {value!r}")
    elif name in ("optimizer", "clipping"):
        allowed = tuple(OPTIMIZERS) if name == "optimizer" else CLIPPING_KINDS
        if not values:
            raise SpecError(
                f"{file}: {where} must be a fixed value or a choice/grid of {', '.join(allowed)}, got {param.kind}"
            )
        for value in values:
            if value not in allowed:
                raise SpecError(
                    f"{file}: {where} must be one of {', '.join(allowed)}{_suggest(value, allowed)}, got {value!r}"
                )


def _parse_train(section: _Section) -> TrainSpec:
    default = TrainSpec()
    epochs = section.integer("epochs", default=default.epochs, minimum=1)
    metric = _metric_name(section, "metric", default=default.metric)
    metrics = _metric_names(section, "metrics")
    mode = _mode_for(section, metric)
    loss = section.string("loss", pattern_hint="a Keras loss identifier (e.g. mean_squared_error, huber)")
    class_weight = _class_weight(section)
    seed = section.integer("seed", default=default.seed, minimum=0)
    from_logits = section.boolean("from_logits", default=default.from_logits)
    label_smoothing = section.number("label_smoothing", default=default.label_smoothing, minimum=0.0)
    if label_smoothing >= 1:
        section.fail(
            "label_smoothing",
            "must be a number below 1 (the share of a label spread over the classes)",
            label_smoothing,
        )
    jit_compile = _auto_or_boolean(section, "jit_compile", default=default.jit_compile)
    fused = _auto_or_boolean(section, "fused", default=default.fused)
    steps_per_launch = _auto_or_positive_integer(section, "steps_per_launch", default=default.steps_per_launch)
    inline_step = section.boolean("inline_step", default=default.inline_step)
    pad_last_batch = section.boolean("pad_last_batch", default=default.pad_last_batch)
    graph_optimizer = section.one_of("graph_optimizer", GRAPH_OPTIMIZERS, default=default.graph_optimizer)
    refit = section.boolean("refit", default=default.refit)
    select = section.one_of("select", EPOCH_SELECTIONS, default=default.select)
    compile_cache = section.boolean("compile_cache", default=default.compile_cache)
    early_stopping = (
        _parse_early_stopping(section, objective=Objective(metric, mode))
        if section.peek("early_stopping") is not None
        else None
    )
    section.finish()
    return TrainSpec(
        epochs=epochs,
        metric=metric,
        mode=mode,
        metrics=metrics,
        loss=loss,
        class_weight=class_weight,
        seed=seed,
        from_logits=from_logits,
        label_smoothing=label_smoothing,
        jit_compile=jit_compile,
        fused=fused,
        steps_per_launch=steps_per_launch,
        inline_step=inline_step,
        pad_last_batch=pad_last_batch,
        graph_optimizer=graph_optimizer,
        refit=refit,
        select=select,
        early_stopping=early_stopping,
        compile_cache=compile_cache,
    )


def _metric_name(section: _Section, key: str, *, default: str) -> str:
    value = section.take(key)
    if value is None:
        return default
    if not isinstance(value, str) or not _METRIC_NAME.match(value):
        section.fail(
            key,
            "must be a metric's name (loss, accuracy, or a Keras metric the model compiles or "
            "train.metrics names, e.g. auc or mean_absolute_error)",
            value,
        )
    return value.removeprefix("val_")


def _class_weight(section: _Section) -> ClassWeight | None:
    value = section.take("class_weight")
    if value is None or value == "balanced":
        return value
    rule = (
        "must be balanced or a mapping of integer class labels to weights > 0 (as fit(class_weight=...)), "
        "e.g. {0: 1.0, 1: 5.0}"
    )
    if not isinstance(value, dict) or not value:
        section.fail("class_weight", rule, value)
    for label, weight in value.items():
        if (
            isinstance(label, bool)
            or not isinstance(label, int)
            or label < 0
            or isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or weight <= 0
        ):
            section.fail("class_weight", rule, value)
    return {int(label): float(weight) for label, weight in value.items()}


def _metric_names(section: _Section, key: str) -> tuple[str, ...]:
    value = section.take(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(name, str) and _METRIC_NAME.match(name) for name in value):
        section.fail(key, "must be a list of Keras metric identifiers (e.g. [auc, mae, RootMeanSquaredError])", value)
    return tuple(value)


def _checked_mode(section: _Section, metric: str, known: Direction | None, *, of: str, why: str = "") -> Direction:
    """The section's ``mode`` for ``metric`` (named ``of`` in messages): ``known`` where it is
    known (a mode against it is refused, ``why`` saying what it would do), else required."""
    mode = section.one_of("mode", MODES, default=known)
    if mode is None:
        section.fail(
            "mode",
            f"is required for {of} {metric}{_misspelt_metric(metric)}: neither Keras nor KerasTuner knows whether "
            f"a higher {metric} is better (max) or worse (min)",
            None,
        )
    if known is not None and mode != known:
        section.fail("mode", f"must be {known} for {of} {metric}{why}", mode)
    return mode


def _mode_for(section: _Section, metric: str) -> Direction:
    """``mode`` for ``metric``: its own direction where Keras or KerasTuner know it (a mode against
    it is refused), else the spec's, which is then required."""
    direction = direction_of(metric)
    better = "higher" if direction == "max" else "lower"
    why = (
        f" ({better} {metric} is better; a mode against it would rank the worst trial first): drop train.mode, "
        "the metric decides it"
    )
    return _checked_mode(section, metric, direction, of="train.metric", why=why)


def _parse_early_stopping(train: _Section, *, objective: Objective) -> EarlyStoppingSpec:
    section = train.section("early_stopping")
    patience = section.integer("patience", default=None, minimum=1)
    if patience is None:
        section.fail("patience", "is required (epochs without improvement before a trial stops, >= 1)", None)
    monitor = _metric_name(section, "monitor", default=objective.metric)
    known = objective.mode if monitor == objective.metric else direction_of(monitor)
    mode = _checked_mode(section, monitor, known, of="monitor")
    min_delta = section.number("min_delta", default=default_of(EarlyStoppingSpec, "min_delta"), minimum=0.0)
    start_from_epoch = section.integer(
        "start_from_epoch", default=default_of(EarlyStoppingSpec, "start_from_epoch"), minimum=0
    )
    baseline = section.take("baseline")
    if baseline is not None and (
        isinstance(baseline, bool) or not isinstance(baseline, (int, float)) or not math.isfinite(baseline)
    ):
        section.fail("baseline", "must be a number", baseline)
    section.finish()
    return EarlyStoppingSpec(
        patience=patience,
        monitor=monitor,
        min_delta=min_delta,
        start_from_epoch=start_from_epoch,
        baseline=None if baseline is None else float(baseline),
        mode=None if monitor in OWN_SCORES else mode,
    )


def _auto_or_boolean(section: _Section, key: str, *, default: AutoSwitch) -> AutoSwitch:
    value = section.take(key)
    if value is None:
        return default
    if value != "auto" and not isinstance(value, bool):
        section.fail(key, "must be auto, true or false", value)
    return "auto" if value == "auto" else ("on" if value else "off")


def _auto_or_positive_integer(section: _Section, key: str, *, default: int | Literal["auto"]) -> int | Literal["auto"]:
    value = section.take(key)
    if value is None:
        return default
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        section.fail(key, "must be auto or an integer >= 1", value)
    return value


def with_registration(spec: SweepSpec, *, register_model: str | None, model_alias: str | None) -> SweepSpec:
    """``spec`` with ``--register-model`` and ``--model-alias`` over its ``tracking`` settings.

    Raises:
        SpecError: an alias MLflow refuses, or an alias without a model to register.
    """
    if register_model is None and model_alias is None:
        return spec
    if register_model is not None:
        check_registered_model_name(register_model, source="--register-model")
    if model_alias is not None:
        check_model_alias(model_alias, source="--model-alias")
    tracking = replace(
        spec.tracking,
        register_model=register_model or spec.tracking.register_model,
        model_alias=model_alias or spec.tracking.model_alias,
    )
    if tracking.model_alias is not None and tracking.register_model is None:
        raise SpecError(
            f"--model-alias moves an alias of the registered model, but neither --register-model nor "
            f"{spec.source_path}: tracking.register_model names one, got --model-alias {model_alias!r}"
        )
    return replace(spec, tracking=tracking)


def _parse_tracking(section: _Section) -> TrackingSpec:
    uri = section.string("uri", default=TrackingSpec().uri)
    register = section.string("register_model", pattern_hint="the name of a registered model")
    if register is not None:
        check_registered_model_name(register, source=f"{section.file}: {section.key_path('register_model')}")
    given = section.take("model_alias")
    alias = DEFAULT_MODEL_ALIAS if given is True else None if given is False else given
    if alias is not None:
        if not isinstance(alias, str):
            section.fail("model_alias", f"must be true (alias {DEFAULT_MODEL_ALIAS}) or an alias", given)
        check_model_alias(alias, source=f"{section.file}: {section.key_path('model_alias')}")
        if register is None:
            section.fail("model_alias", "moves an alias of tracking.register_model, which is not set", given)
    system_metrics = section.boolean("system_metrics", default=TrackingSpec().system_metrics)
    return TrackingSpec(uri=uri, register_model=register, model_alias=alias, system_metrics=system_metrics)


def _parse_resources(section: _Section) -> ResourcesSpec:
    default = ResourcesSpec()
    cpu = section.number("cpu", default=default.cpu, minimum=0.0, strict=True)
    gpu = _gpu_share(section, default=default.gpu)
    max_concurrent = section.integer("max_concurrent", default=default.max_concurrent, minimum=1)
    max_failures = section.integer("max_failures", default=default.max_failures, minimum=0)
    address = section.string(
        "address", default=default.address, pattern_hint="a Ray address such as 127.0.0.1:6379 or auto"
    )
    max_trials_per_worker = _auto_or_positive_integer(
        section, "max_trials_per_worker", default=default.max_trials_per_worker
    )
    max_worker_memory = _auto_or_positive_integer(section, "max_worker_memory", default=default.max_worker_memory)
    section.finish()
    return ResourcesSpec(
        cpu=cpu,
        gpu=gpu,
        max_concurrent=max_concurrent,
        max_failures=max_failures,
        address=address,
        max_trials_per_worker=max_trials_per_worker,
        max_worker_memory=max_worker_memory,
    )


def _gpu_share(section: _Section, *, default: float) -> float:
    """A trial's GPUs: a share of one GPU (trials packed onto it), or one whole GPU.

    Ray hands out GPUs above 1 whole only, and foldsweep trains a trial's folds on one device
    (``pipeline.engine.resident.training_device``): a trial reserving 2 would keep the second
    idle and from every other trial, so it is refused rather than left idle.
    """
    gpu = section.number("gpu", default=default, minimum=0.0)
    if gpu > 1 and not gpu.is_integer():
        section.fail("gpu", "must be a share of one GPU (at most 1) or a whole number of GPUs", gpu)
    if gpu > 1:
        section.fail(
            "gpu",
            "must be at most 1: foldsweep trains all the folds of a trial on one GPU, so a trial "
            "reserving more would leave the others idle; to run more trials at once, give each a share "
            "(gpu: 0.5 runs two trials on a GPU) or raise resources.max_concurrent",
            int(gpu),
        )
    return gpu


def _misspelt_metric(metric: str) -> str:
    """A metric Keras knows whose name is one slip away from ``metric`` (``acuracy``), as a hint; a
    name of the researcher's own (``my_score``, or an abbreviation of a known one) gets none."""
    return _suggest(metric, sorted({*OWN_SCORES, *KNOWN_DIRECTIONS}), cutoff=0.85, abbreviations=False)


def _suggest(
    value: Any, choices: tuple[str, ...] | list[str], *, cutoff: float = 0.6, abbreviations: bool = True
) -> str:
    text = str(value)
    close = difflib.get_close_matches(text, list(choices), n=1, cutoff=cutoff)
    # Abbreviations ("grace" for "grace_period") score low on similarity but are the usual typo.
    if abbreviations:
        close = close or [choice for choice in choices if len(text) >= 3 and choice.startswith(text)][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


_Word = TypeVar("_Word", bound=str)


class _Section:
    """Reads one YAML mapping key by key; whatever is left at ``finish()`` is an unknown key."""

    def __init__(self, data: Any, path: str, file: str):
        self.file = file
        self.path = path
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            label = path or "the spec"
            raise SpecError(f"{file}: {label} must be a mapping of keys to values, got {data!r}")
        self._data = dict(data)
        self._seen: list[str] = []

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else str(key)

    def fail(self, key: str, rule: str, value: Any) -> NoReturn:
        raise SpecError(f"{self.file}: {self.key_path(key)} {rule}, got {value!r}")

    def peek(self, key: str) -> Any:
        self._seen.append(key)  # a key read only when present is a known key all the same
        return self._data.get(key)

    def take(self, key: str) -> Any:
        self._seen.append(key)
        return self._data.pop(key, None)

    def remaining(self) -> list[str]:
        return list(self._data)

    def section(self, key: str) -> _Section:
        return _Section(self.take(key), self.key_path(key), self.file)

    def done_with(self, read: Any) -> Any:
        value = read(self)
        self.finish()
        return value

    def finish(self) -> None:
        for key in self._data:
            known = tuple(k for k in self._seen if isinstance(k, str))
            hint = _suggest(key, known)
            expected = f"; known keys: {', '.join(sorted(set(known)))}" if known else ""
            raise SpecError(f"{self.file}: unknown key {self.key_path(key)!r}{hint}{expected}")

    @overload
    def string(self, key: str, *, default: str, pattern_hint: str = ...) -> str: ...
    @overload
    def string(self, key: str, *, required: Literal[True], pattern_hint: str = ...) -> str: ...
    @overload
    def string(self, key: str, *, default: None = None, pattern_hint: str = ...) -> str | None: ...

    def string(
        self, key: str, *, default: str | None = None, required: bool = False, pattern_hint: str = "a string"
    ) -> str | None:
        value = self.take(key)
        if value is None:
            if required:
                self.fail(key, f"is required ({pattern_hint})", value)
            return default
        if not isinstance(value, str) or not value.strip():
            self.fail(key, f"must be {pattern_hint}", value)
        return value

    @overload
    def one_of(self, key: str, choices: tuple[_Word, ...], *, default: _Word) -> _Word: ...
    @overload
    def one_of(self, key: str, choices: tuple[_Word, ...], *, default: _Word | None) -> _Word | None: ...

    def one_of(self, key: str, choices: tuple[_Word, ...], *, default: _Word | None) -> _Word | None:
        value = self.take(key)
        if value is None:
            return default
        if value not in choices:
            self.fail(key, f"must be one of {', '.join(choices)}{_suggest(value, choices)}", value)
        return value

    @overload
    def integer(self, key: str, *, default: int, minimum: int | None = None, maximum: int | None = None) -> int: ...
    @overload
    def integer(
        self, key: str, *, default: None, minimum: int | None = None, maximum: int | None = None
    ) -> int | None: ...

    def integer(
        self, key: str, *, default: int | None, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        value = self.take(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, "must be an integer", value)
        too_small = minimum is not None and value < minimum
        if maximum is not None and (too_small or value > maximum):
            bounds = f"from {minimum} to {maximum}" if minimum is not None else f"<= {maximum}"
            self.fail(key, f"must be an integer {bounds}", value)
        if too_small:
            self.fail(key, f"must be an integer >= {minimum}", value)
        return value

    def number(self, key: str, *, default: float, minimum: float, strict: bool = False) -> float:
        value = self.take(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, "must be a number", value)
        if value < minimum or (strict and value == minimum):
            self.fail(key, f"must be a number {'>' if strict else '>='} {minimum:g}", value)
        return float(value)

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self.take(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(key, "must be true or false", value)
        return value
