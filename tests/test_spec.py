"""Every spec rule refuses bad input with a message naming the key, the rule and the value."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from helpers import DELETE, Replace

from pipeline.base.errors import SpecError
from pipeline.inputs import spec as spec_module
from pipeline.inputs.spec import (
    CVSpec,
    EarlyStoppingSpec,
    ParamSpec,
    ResourcesSpec,
    SchedulerSpec,
    SearchSpec,
    TrackingSpec,
    TrainSpec,
    default_of,
    load_spec,
    parse_spec,
    read_yaml,
)

BAD_SPECS = [
    # (overrides, expected message fragment)
    ({"name": DELETE}, "name is required"),
    ({"name": ""}, "name must be a non-empty name, got ''"),
    ({"experiment": "experiments/model.txt:build"}, "experiment must be a path to a .py file"),
    ({"experiment": 5}, "experiment must be a string, got 5"),
    ({"dataset": DELETE}, "dataset is required"),
    ({"dataset": ""}, "dataset must not be empty"),
    ({"dataset": {"name": "mnist1d", "path": "x.npz"}}, "exactly one of dataset.name, dataset.path and dataset.images"),
    (
        {"dataset": Replace({"images": "photos", "name": "mnist1d"})},
        "dataset.name exactly one of dataset.name, dataset.path and dataset.images must be given, got 'mnist1d'",
    ),
    (
        {"dataset": Replace({"images": "photos", "image_size": [32, 32, 3]})},
        "dataset.image_size must be [height, width], two integers >= 1, got [32, 32, 3]",
    ),
    ({"dataset": Replace({"images": "photos", "color_mode": "rgb8"})}, "dataset.color_mode must be one of"),
    ({"dataset": Replace({"images": "photos", "resize": True})}, "unknown key 'dataset.resize'"),
    ({"dataset": {"name": "mnist1d", "num_samples": [1]}}, "dataset.num_samples must be a number, string or boolean"),
    ({"trian": {"epochs": 1}}, "unknown key 'trian' (did you mean 'train'?)"),
    ({"cv": {"n_split": 3}}, "unknown key 'cv.n_split' (did you mean 'n_splits'?)"),
    ({"cv": "kfold"}, "cv must be a mapping of keys to values, got 'kfold'"),
    (
        {"cv": {"splitter": "kfolds"}},
        "cv.splitter must be one of kfold, stratified, group, stratified_group (did you mean 'kfold'?), got 'kfolds'",
    ),
    ({"cv": {"n_splits": 1}}, "cv.n_splits must be an integer >= 2, got 1"),
    ({"cv": {"n_splits": 2.5}}, "cv.n_splits must be an integer, got 2.5"),
    ({"cv": {"n_splits": True}}, "cv.n_splits must be an integer, got True"),
    ({"cv": {"seed": -1}}, "cv.seed must be an integer from 0 to 4294967295, got -1"),
    ({"cv": {"seed": 2**32}}, "cv.seed must be an integer from 0 to 4294967295, got 4294967296"),
    ({"search": {"seed": 2**32}}, "search.seed must be an integer from 0 to 4294967295, got 4294967296"),
    ({"search": {"num_samples": 0}}, "search.num_samples must be an integer >= 1, got 0"),
    ({"search": {"seed": "zero"}}, "search.seed must be an integer, got 'zero'"),
    ({"search": {"algorithm": "bayes"}}, "search.algorithm must be one of random"),
    (
        {"search": {"space": {"filters": {"choice": []}}}},
        "search.space.filters.choice must be a non-empty list of values, got []",
    ),
    (
        {"search": {"space": {"filters": {"choice": 16}}}},
        "search.space.filters.choice must be a non-empty list of values, got 16",
    ),
    (
        {"search": {"space": {"dropout": {"uniform": [0.5, 0.1]}}}},
        "search.space.dropout.uniform needs low < high, got [0.5, 0.1]",
    ),
    (
        {"search": {"space": {"dropout": {"uniform": [0.1]}}}},
        "search.space.dropout.uniform must be a list [low, high], got [0.1]",
    ),
    (
        {"search": {"space": {"learning_rate": {"loguniform": [0, 0.1]}}}},
        "search.space.learning_rate.loguniform needs low > 0 (log scale), got [0, 0.1]",
    ),
    (
        {"search": {"space": {"filters": {"randint": [8, 16.5]}}}},
        "search.space.filters.randint must be integers [low, high], got [8, 16.5]",
    ),
    (
        {"search": {"space": {"filters": {"qrandint": [8, 64, 0]}}}},
        "search.space.filters.qrandint needs q > 0, got [8, 64, 0]",
    ),
    ({"search": {"space": {"filters": {"normal": [0, 1]}}}}, "search.space.filters distribution must be one of"),
    (
        {"search": {"space": {"filters": {"choice": [8], "grid": [8]}}}},
        "search.space.filters must be a fixed value or a mapping with exactly one of",
    ),
    (
        {"search": {"space": {"filters": [8, 16]}}},
        "search.space.filters a list is ambiguous: write {choice: [...]} or {grid: [...]}",
    ),
    ({"search": {"space": {"filters": None}}}, "search.space.filters must have a value, got None"),
    (
        {"search": {"space": {"batch_size": 0}}},
        "search.space.batch_size must be a positive integer (every value it takes), got 0",
    ),
    (
        {"search": {"space": {"batch_size": {"choice": [8, -4]}}}},
        "search.space.batch_size must be a positive integer (every value it takes), got -4",
    ),
    ({"search": {"space": {"batch_size": {"uniform": [4, 64]}}}}, "search.space.batch_size must take integer values"),
    (
        {"search": {"space": {"learning_rate": -0.1}}},
        "search.space.learning_rate must be a number > 0 (every value it takes), got -0.1",
    ),
    (
        {"search": {"space": {"optimizer": "adamm"}}},
        "search.space.optimizer must be one of adam, adamw, sgd, rmsprop (did you mean 'adam'?), got 'adamm'",
    ),
    (
        {"search": {"space": {"optimizer": {"uniform": [0, 1]}}}},
        "search.space.optimizer must be a fixed value or a choice/grid",
    ),
    ({"train": {"epochs": 0}}, "train.epochs must be an integer >= 1, got 0"),
    ({"train": {"metric": "val accuracy"}}, "train.metric must be a metric's name (loss, accuracy, or a Keras metric"),
    # Neither Keras nor KerasTuner knows which way a researcher's own metric improves.
    (
        {"train": {"metric": "mcc", "mode": DELETE}},
        "train.mode is required for train.metric mcc: neither Keras nor KerasTuner knows "
        "whether a higher mcc is better (max) or worse (min), got None",
    ),
    (  # a slip of a metric Keras knows is not taken for a metric of the researcher's own
        {"train": {"metric": "acuracy", "mode": DELETE}},
        "train.mode is required for train.metric acuracy (did you mean 'accuracy'?)",
    ),
    ({"train": {"metric": "mae", "mode": "max"}}, "train.mode must be min for train.metric mae"),
    ({"train": {"metrics": "auc"}}, "train.metrics must be a list of Keras metric identifiers"),
    (
        {"train": {"class_weight": {0: 1.0, 1: -2}}},
        "train.class_weight must be balanced or a mapping of integer class labels to weights > 0",
    ),
    ({"train": {"class_weight": "inverse"}}, "train.class_weight must be balanced or a mapping"),
    ({"train": {"mode": "maximize"}}, "train.mode must be one of max, min"),
    # A mode against its metric's direction would crown the worst trial and refit it.
    (
        {"train": {"metric": "loss", "mode": "max"}},
        "train.mode must be min for train.metric loss (lower loss is better; a mode against it would rank the worst "
        "trial first): drop train.mode, the metric decides it, got 'max'",
    ),
    ({"train": {"metric": "accuracy", "mode": "min"}}, "train.mode must be max for train.metric accuracy"),
    (
        {"train": {"early_stoping": {"patience": 2}}},
        "unknown key 'train.early_stoping' (did you mean 'early_stopping'?)",
    ),
    ({"cv": {"groups": "ignored"}}, "cv.groups must be one of respect, ignore (did you mean 'ignore'?), got 'ignored'"),
    ({"cv": {"splitter": "group", "groups": "ignore"}}, "cv.groups ignore contradicts cv.splitter group"),
    ({"train": {"from_logits": "yes"}}, "train.from_logits must be true or false, got 'yes'"),
    (
        {"train": {"label_smoothing": 1}},
        "train.label_smoothing must be a number below 1 (the share of a label spread over the classes), got 1.0",
    ),
    ({"train": {"label_smoothing": -0.1}}, "train.label_smoothing must be a number >= 0, got -0.1"),
    ({"train": {"jit_compile": "sometimes"}}, "train.jit_compile must be auto, true or false, got 'sometimes'"),
    ({"train": {"fused": "yes"}}, "train.fused must be auto, true or false, got 'yes'"),
    ({"train": {"steps_per_launch": 0}}, "train.steps_per_launch must be auto or an integer >= 1, got 0"),
    ({"train": {"steps_per_launch": "many"}}, "train.steps_per_launch must be auto or an integer >= 1, got 'many'"),
    ({"resources": {"cpu": 0}}, "resources.cpu must be a number > 0, got 0"),
    ({"resources": {"gpu": -0.5}}, "resources.gpu must be a number >= 0, got -0.5"),
    (
        {"resources": {"gpu": 1.5}},
        "resources.gpu must be a share of one GPU (at most 1) or a whole number of GPUs, got 1.5",
    ),
    (
        {"resources": {"gpu": 2}},
        "resources.gpu must be at most 1: foldsweep trains all the folds of a trial on one "
        "GPU, so a trial reserving more would leave the others idle; to run more trials at "
        "once, give each a share (gpu: 0.5 runs two trials on a GPU) or raise "
        "resources.max_concurrent, got 2",
    ),
    ({"resources": {"max_concurrent": 0}}, "resources.max_concurrent must be an integer >= 1, got 0"),
    ({"tracking": {"uri": 42}}, "tracking.uri must be a string, got 42"),
    ({"tracking": {"url": "sqlite:///x.db"}}, "unknown key 'tracking.url' (did you mean 'uri'?)"),
    (
        {"tracking": {"model_alias": True}},
        "tracking.model_alias moves an alias of tracking.register_model, which is not set, got True",
    ),
    (
        {"tracking": {"register_model": "cnn", "model_alias": "v2"}},
        "tracking.model_alias must be letters, digits, _ and - (not latest nor v<number>, which MLflow keeps), "
        "got 'v2'",
    ),
    ({"tracking": {"register_model": ""}}, "tracking.register_model must be the name of a registered model, got ''"),
    (
        {"tracking": {"register_model": "team/cnn"}},
        "tracking.register_model must be the name of a registered model (not empty, no / nor :, not . or ..), "
        "got 'team/cnn'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SPECS, ids=[m[:48] for _, m in BAD_SPECS])
def test_bad_spec_is_refused_with_its_rule(write_spec, overrides, message):
    path = write_spec(overrides)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"{path}: ")


WRONG_KEY = {"no_such_key": 1}
SECTIONS = {
    "cv": ({"cv": WRONG_KEY}, CVSpec),
    "search": ({"search": WRONG_KEY}, SearchSpec),
    "search.scheduler": ({"search": {"scheduler": {"name": "asha", **WRONG_KEY}}}, SchedulerSpec),
    "train": ({"train": WRONG_KEY}, TrainSpec),
    "train.early_stopping": ({"train": {"early_stopping": {"patience": 2, **WRONG_KEY}}}, EarlyStoppingSpec),
    "resources": ({"resources": WRONG_KEY}, ResourcesSpec),
    "tracking": ({"tracking": WRONG_KEY}, TrackingSpec),
}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_an_unknown_key_lists_every_key_its_section_knows(write_spec, section):
    overrides, fields_of = SECTIONS[section]
    with pytest.raises(SpecError) as caught:
        load_spec(write_spec(overrides))
    assert f"unknown key '{section}.no_such_key'" in str(caught.value)
    known = str(caught.value).split("known keys: ")[1].split(", ")
    assert known == sorted(field.name for field in dataclasses.fields(fields_of))


def test_numbers_read_as_researchers_write_them(write_spec):
    """YAML 1.1 (PyYAML's) reads 1e-4 as a string; a spec reads it, 1E-2 and .5 as numbers."""
    path = write_spec({"search": {"space": {"learning_rate": "LR", "dropout": "DROPOUT"}}})
    path.write_text(path.read_text().replace("LR", "{loguniform: [1e-4, 1E-2]}").replace("DROPOUT", ".5"))
    spec = load_spec(path)
    assert spec.search.space["learning_rate"] == ParamSpec("loguniform", (1e-4, 1e-2))
    assert spec.search.space["dropout"] == ParamSpec("fixed", (0.5,))
    assert read_yaml("[1e-4, -2E3, +.5e1, 3, 1.0e-4, 1e, e3, 1.2.3, adam]") == [
        1e-4,
        -2000.0,
        5.0,
        3,
        1e-4,
        "1e",
        "e3",
        "1.2.3",
        "adam",
    ]


def test_missing_file_is_named(tmp_path: Path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_the_line(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ncv:\n  n_splits: [3\n")
    with pytest.raises(SpecError, match=r"not valid YAML at line \d+"):
        load_spec(path)


def test_top_level_must_be_a_mapping(tmp_path: Path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="the spec must be a mapping"):
        load_spec(path)


def test_valid_spec_fills_defaults(write_spec):
    spec = load_spec(write_spec({"cv": {"splitter": DELETE}, "train": {"mode": DELETE, "metric": "loss"}}))
    assert spec.name == "tiny"
    assert spec.cv.splitter == "stratified"
    assert spec.cv.n_splits == 2 and spec.cv.n_repeats == 1 and spec.cv.replicas == 2
    assert spec.train.select == "best_epoch"  # scored at the best epoch of the mean CV curve, as KerasTuner
    assert spec.train.mode == "min"  # the natural direction of the chosen metric

    assert spec.objective.key == "mean_val_loss" and spec.objective.better(0.1, than=0.2)
    assert spec.resources.gpu == 0.0
    assert spec.train.label_smoothing == 0.0  # foldsweep's own loss, unsmoothed, as Keras' default
    assert load_spec(write_spec({"train": {"label_smoothing": 0.1}})).train.label_smoothing == 0.1
    assert spec.experiment_attr == "build"
    assert spec.search.space["kernel_size"] == ParamSpec("choice", (3, 5))
    assert spec.search.space["filters"] == ParamSpec("fixed", (16,))
    assert spec.dataset.name == "mnist1d" and spec.dataset.options == {"num_samples": 400}
    assert "name: tiny" in spec.source_text


@pytest.mark.parametrize(
    ("metric", "mode"),
    [
        ("auc", "max"),
        ("val_auc", "max"),
        ("mae", "min"),
        ("root_mean_squared_error", "min"),
        ("precision", "max"),
        ("r2_score", "max"),
    ],
)
def test_a_keras_metric_as_objective_gets_its_direction(write_spec, metric, mode):
    spec = load_spec(write_spec({"train": {"mode": DELETE, "metric": metric, "metrics": ["auc"]}}))
    assert (spec.objective.metric, spec.objective.mode) == (metric.removeprefix("val_"), mode)
    assert spec.train.metrics == ("auc",)


def test_class_weights_are_balanced_or_given_per_label(write_spec):
    assert load_spec(write_spec({"train": {"class_weight": "balanced"}})).train.class_weight == "balanced"
    assert load_spec(write_spec({"train": {"class_weight": {0: 1, 1: 4.5}}})).train.class_weight == {0: 1.0, 1: 4.5}
    assert load_spec(write_spec({})).train.class_weight is None


def test_a_metric_of_unknown_direction_ranks_by_the_mode_given_and_early_stopping_watches_it(write_spec):
    spec = load_spec(write_spec({"train": {"metric": "mcc", "mode": "max", "early_stopping": {"patience": 2}}}))
    assert spec.objective.key == "mean_val_mcc" and spec.objective.mode == "max"
    assert spec.train.early_stopping.objective == spec.objective


def test_an_image_folder_is_a_path_read_as_images(write_spec):
    spec = load_spec(write_spec({"dataset": Replace({"images": "photos", "image_size": [64, 48]})}))
    assert spec.dataset.images and spec.dataset.path == "photos"
    assert spec.dataset.options == {"color_mode": "rgb", "image_size": [64, 48]}


def test_string_dataset_is_a_name_or_a_file(write_spec):
    assert load_spec(write_spec({"dataset": "mnist1d"})).dataset.name == "mnist1d"
    assert load_spec(write_spec({"dataset": "data/mine.npz"})).dataset.path == "data/mine.npz"


def test_integer_bounds_are_kept_as_integers(write_spec):
    spec = load_spec(write_spec({"search": {"space": {"filters": {"qrandint": [8, 64, 8]}}}}))
    assert spec.search.space["filters"] == ParamSpec("qrandint", (8, 64, 8))


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), (True, "on"), (False, "off")])
def test_jit_compile_and_fusion_can_be_forced(write_spec, value, expected):
    assert load_spec(write_spec({"train": {"jit_compile": value}})).train.jit_compile == expected
    assert load_spec(write_spec({"train": {"fused": value}})).train.fused == expected


def test_pad_last_batch_is_on_unless_turned_off_and_reaches_the_plans_choices(write_spec):
    from pipeline.engine.recipe import TrainingRecipe

    assert TrainingRecipe.from_spec(load_spec(write_spec({}))).choices.pad_last_batch is True
    spec = load_spec(write_spec({"train": {"pad_last_batch": False}}))
    assert spec.train.pad_last_batch is False and TrainingRecipe.from_spec(spec).choices.pad_last_batch is False
    with pytest.raises(SpecError, match="train.pad_last_batch must be true or false, got 'auto'"):
        load_spec(write_spec({"train": {"pad_last_batch": "auto"}}))


def test_the_graph_optimizer_is_light_unless_asked_full_and_reaches_the_plans_choices(write_spec):
    from pipeline.engine.recipe import TrainingRecipe

    assert TrainingRecipe.from_spec(load_spec(write_spec({}))).choices.graph_optimizer == "light"
    spec = load_spec(write_spec({"train": {"graph_optimizer": "full"}}))
    assert spec.train.graph_optimizer == "full" and TrainingRecipe.from_spec(spec).choices.graph_optimizer == "full"
    with pytest.raises(SpecError, match="train.graph_optimizer must be one of light, full, got 'off'"):
        load_spec(write_spec({"train": {"graph_optimizer": "off"}}))


def test_the_refit_is_registered_only_when_asked_and_the_flags_override_the_spec(write_spec):
    from pipeline.inputs.spec import with_registration

    plain = load_spec(write_spec({}))
    assert (plain.tracking.register_model, plain.tracking.model_alias) == (None, None)
    assert plain.tracking.system_metrics is True
    assert load_spec(write_spec({"tracking": {"system_metrics": False}})).tracking.system_metrics is False
    asked = load_spec(write_spec({"tracking": {"register_model": "cnn", "model_alias": True}}))
    assert (asked.tracking.register_model, asked.tracking.model_alias) == ("cnn", "champion")
    flagged = with_registration(plain, register_model="protein-cnn", model_alias="production")
    assert (flagged.tracking.register_model, flagged.tracking.model_alias) == ("protein-cnn", "production")
    assert with_registration(asked, register_model=None, model_alias="staging").tracking.register_model == "cnn"
    with pytest.raises(SpecError, match="--model-alias moves an alias of the registered model, but neither"):
        with_registration(plain, register_model=None, model_alias="champion")
    with pytest.raises(SpecError, match="--model-alias must be letters, digits, _ and -.*got 'latest'"):
        with_registration(plain, register_model="cnn", model_alias="latest")
    with pytest.raises(SpecError, match="--register-model must be the name of a registered model.*got 'lab:cnn'"):
        with_registration(plain, register_model="lab:cnn", model_alias=None)


def test_inline_step_is_off_unless_asked_and_reaches_the_plans_choices(write_spec):
    from pipeline.engine.recipe import TrainingRecipe

    assert load_spec(write_spec({})).train.inline_step is False
    spec = load_spec(write_spec({"train": {"inline_step": True}}))
    assert TrainingRecipe.from_spec(spec).choices.inline_step is True
    with pytest.raises(SpecError, match="train.inline_step must be true or false, got 'yes please'"):
        load_spec(write_spec({"train": {"inline_step": "yes please"}}))


@pytest.mark.parametrize(("value", "expected"), [(None, "auto"), ("auto", "auto"), (8, 8)])
def test_steps_per_launch_is_auto_or_a_number(write_spec, value, expected):
    train = {} if value is None else {"steps_per_launch": value}
    assert load_spec(write_spec({"train": train})).train.steps_per_launch == expected


@pytest.mark.parametrize("gpu", [0, 0.25, 1, 1.0])
def test_a_trial_takes_a_share_of_one_gpu_or_one_gpu(write_spec, gpu):
    assert load_spec(write_spec({"resources": {"gpu": gpu}})).resources.gpu == gpu


SHIPPED_SPECS = sorted((Path(__file__).resolve().parents[1] / "sweeps").glob("*.yaml"))


@pytest.mark.training
@pytest.mark.parametrize("where", ["root", "sweeps", "elsewhere"])
def test_every_shipped_spec_validates_from_any_directory(where, tmp_path, monkeypatch):
    """Every shipped spec from a directory of their own; from the repository and its sweeps/, the
    quickstart as the README writes it (the specs name their experiment and data alike)."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    repo = SHIPPED_SPECS[0].parents[1]
    directory = {"root": repo, "sweeps": repo / "sweeps", "elsewhere": tmp_path}[where]
    monkeypatch.chdir(directory)
    before = sorted(path.name for path in directory.iterdir())
    specs = SHIPPED_SPECS if where == "elsewhere" else [repo / "sweeps" / "quickstart.yaml"]
    for spec in specs:
        written = spec.relative_to(repo) if where == "root" else spec.name if where == "sweeps" else spec
        result = CliRunner().invoke(app, ["validate", str(written)])
        assert result.exit_code == 0, (spec.name, result.output)
        assert result.output.startswith(f"ok {written}"), result.output
    assert sorted(path.name for path in directory.iterdir()) == before


MINIMAL_SPEC = {"name": "minimal", "experiment": "experiment.py", "dataset": "mnist1d"}


def test_an_empty_section_parses_to_its_dataclass_defaults():
    """Every default is declared once, on the dataclass: a key left out is read as its field's default."""
    spec = parse_spec(MINIMAL_SPEC, source_path=Path("minimal.yaml"))
    assert (spec.cv, spec.search, spec.train, spec.resources, spec.tracking) == (
        CVSpec(),
        SearchSpec(),
        TrainSpec(),
        ResourcesSpec(),
        TrackingSpec(),
    )
    with_sections = parse_spec(
        {**MINIMAL_SPEC, "search": {"scheduler": {"name": "fifo"}}, "train": {"early_stopping": {"patience": 2}}},
        source_path=Path("minimal.yaml"),
    )
    assert with_sections.search.scheduler == SchedulerSpec()
    assert with_sections.train.early_stopping == EarlyStoppingSpec(patience=2)


def test_the_parser_writes_no_default_of_its_own():
    """A literal ``default=`` in spec.py would be a default written a second time (beside its
    dataclass field), free to drift from it; the parser reads each from the field instead."""
    tree = ast.parse(Path(spec_module.__file__).read_text())
    literals = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg == "default" and isinstance(keyword.value, ast.Constant) and keyword.value.value is not None
    ]
    assert literals == []


@pytest.mark.parametrize(
    "cls", [CVSpec, SchedulerSpec, SearchSpec, TrainSpec, EarlyStoppingSpec, ResourcesSpec, TrackingSpec]
)
def test_default_of_reads_the_field(cls):
    defaults = {
        field.name: default_of(cls, field.name)
        for field in dataclasses.fields(cls)
        if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    }
    made = cls(patience=1) if cls is EarlyStoppingSpec else cls()
    assert defaults == {name: getattr(made, name) for name in defaults}
    with pytest.raises(ValueError, match="has no field 'nope'"):
        default_of(cls, "nope")


@pytest.mark.parametrize(
    ("epochs", "longest"),
    [(None, 4), (6, 6), ({"choice": [3, 7, 5]}, 7), ({"randint": [2, 9]}, 9), ({"qrandint": [2, 12, 2]}, 12)],
)
def test_the_longest_epochs_a_trial_trains(epochs, longest):
    """What ASHA's max_t and the scheduler's grace-period check both read."""
    space = {"search": {"space": {"epochs": epochs}}} if epochs is not None else {}
    spec = parse_spec({**MINIMAL_SPEC, "train": {"epochs": 4}, **space}, source_path=Path("minimal.yaml"))
    assert spec.longest_epochs == longest


@pytest.mark.parametrize(
    ("search", "at_most"),
    [
        ({"num_samples": 3}, 3),
        ({"num_samples": 3, "space": {"learning_rate": {"loguniform": [0.001, 0.01]}}}, 3),
        ({"num_samples": 3, "space": {"batch_size": {"grid": [8, 32]}}}, None),
        ({"algorithm": "grid", "num_samples": 1, "space": {"batch_size": {"choice": [8, 32]}}}, None),
    ],
)
def test_a_search_without_a_grid_runs_at_most_num_samples_trials(write_spec, search, at_most):
    spec = load_spec(write_spec({"search": search}))
    assert spec.search.trials_at_most(spec.search.num_samples) == at_most
