"""Every input a user gives, refused the same way: exit 2 and one message that names the key, flag
or file, with no traceback, before anything is written, and no Ray left running. Each case runs the
command in a workspace of real files (specs, data, experiments, stores) and checks afterwards
that every file there, the stores included, is byte for byte what it was, and nothing was added.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tracker

LOOP_MODEL = """
import keras


def build(hp):
    model = keras.Sequential([keras.layers.Flatten()])
    for i in range(hp.Int("num_layers", 1, 3)):
        model.add(keras.layers.Dense(hp.Int(f"units_{i}", 8, 32, step=8), activation="relu"))
    model.add(keras.layers.Dense(2, activation="softmax"))
    return model
"""
LINEAR_MODEL = (
    "import keras\ndef build(hp):\n    return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(2)])\n"
)
OVERRIDE_MODEL = """
import keras


class Custom(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def build(hp):
    return Custom([keras.layers.Flatten(), keras.layers.Dense(2, activation="softmax")])
"""
VECTOR_METRIC_MODEL = """
import keras


class PerClass(keras.metrics.Metric):
    def __init__(self, name="per_class", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((2,), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(y_pred, axis=0))

    def result(self):
        return self.total


def build(hp):
    model = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(2, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", metrics=[PerClass()])
    return model
"""
SHEARING_MODEL = """
import keras


def build(hp):
    return keras.Sequential(
        [keras.layers.RandomShear(0.1), keras.layers.Flatten(), keras.layers.Dense(2, activation="softmax")]
    )
"""
REGRESSION_MODEL = """
import keras


def build(hp):
    model = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(loss="mse", metrics=["mae"])
    return model
"""
CACHED_MODEL = """
import keras

MODEL = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(2, activation="softmax")])


def build(hp):
    return MODEL
"""
SHARED_LAYER_MODEL = """
import keras

HIDDEN = keras.layers.Dense(4, activation="relu", name="hidden")


def build(hp):
    return keras.Sequential([keras.layers.Flatten(), HIDDEN, keras.layers.Dense(2, activation="softmax")])
"""
TOKENS_MODEL = """
import keras


def build(hp):
    tokens = keras.Input((16,), dtype="int32")
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(tokens))
    return keras.Model(tokens, keras.layers.Dense(2, activation="softmax")(embedded))
"""
GOOD_SPEC = {
    "name": "good",
    "experiment": "loop.py",
    "dataset": "good.npz",
    "cv": {"n_splits": 2},
    "search": {"space": {"batch_size": 8}},
    "train": {"epochs": 1},
    "tracking": {"uri": "sqlite:///store.db"},
}


def arrays(n: int = 60, **changes) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(n, 8, 1)).astype(np.float32), "y": (np.arange(n) % 2).astype(np.int32)}
    data.update(changes)
    return data


def spec_text(**overrides) -> str:
    return yaml.safe_dump({**GOOD_SPEC, **overrides}, sort_keys=False)


FILES = {
    "loop.py": LOOP_MODEL,
    "linear.py": LINEAR_MODEL,
    "override.py": OVERRIDE_MODEL,
    "good.yaml": spec_text(),
    "twice.yaml": spec_text() + "train: {epochs: 3}\n",
    "twice_nested.yaml": spec_text(search=None).replace("search: null\n", "")
    + "search:\n  space:\n    batch_size: 8\n    batch_size: 16\n",
    "asha.yaml": spec_text(search={"scheduler": {"name": "asha", "grace_period": 3}, "space": {"batch_size": 8}}),
    "median.yaml": spec_text(search={"scheduler": {"name": "median", "grace_period": 1}, "space": {"batch_size": 8}}),
    "typo.yaml": spec_text(trian={"epochs": 1}),
    "no_experiment.yaml": spec_text(experiment="experiments/nope.py"),
    "no_data.yaml": spec_text(dataset="data/nope.npz"),
    "corrupt_images.yaml": spec_text(dataset={"images": "photos"}),
    "one_split.yaml": spec_text(cv={"n_splits": 1}),
    "latin1.yaml": "name: caf\xe9\n",
    "broken.yaml": "name: x\ncv: {n_splits: 3\n",
    "unknown_hp.yaml": spec_text(search={"space": {"batch_size": 8, "unitz_0": 8}}),
    "select.yaml": spec_text(train={"epochs": 1, "select": "best"}),
    "bounds.yaml": spec_text(search={"space": {"batch_size": 8, "learning_rate": {"loguniform": ["low", "high"]}}}),
    "mode.yaml": spec_text(train={"epochs": 1, "metric": "loss", "mode": "max"}),
    "ungrouped.yaml": spec_text(dataset="grouped.npz"),
    "early.yaml": spec_text(train={"epochs": 1, "early_stoping": {"patience": 2}}),
    "plusminus.yaml": spec_text(dataset="plusminus.npz"),
    "bad_uri.yaml": spec_text(tracking={"uri": "mlflow.db"}),
    "two_slashes.yaml": spec_text(tracking={"uri": "sqlite://mlflow.db"}),
    "no_suffix.yaml": spec_text(dataset="good"),
    "empty.yaml": spec_text(dataset="empty.npz"),
    "floaty.yaml": spec_text(dataset="floaty.npz"),
    "from1.yaml": spec_text(dataset="from1.npz"),
    "renamed.yaml": spec_text(dataset="renamed.npz"),
    "mismatch.yaml": spec_text(dataset="mismatch.npz"),
    "nan.yaml": spec_text(dataset="nan.npz"),
    "one_class.yaml": spec_text(dataset="one_class.npz"),
    "y_test.yaml": spec_text(dataset="y_test.npz"),
    "truncated.yaml": spec_text(dataset="truncated.npz"),
    "linear.yaml": spec_text(experiment="linear.py"),
    "uncomputed.yaml": spec_text(train={"epochs": 1, "metric": "auc"}),
    "direction.yaml": spec_text(train={"epochs": 1, "metric": "mcc"}),
    "vector.yaml": spec_text(experiment="vector.py", train={"epochs": 1, "metric": "per_class", "mode": "max"}),
    "vector.py": VECTOR_METRIC_MODEL,
    "reg.py": REGRESSION_MODEL,
    "positions.yaml": spec_text(dataset="positions.npz", cv={"n_splits": 2, "splitter": "kfold"}, train={"epochs": 1}),
    "no_loss.yaml": spec_text(
        dataset="regress.npz", cv={"n_splits": 2, "splitter": "kfold"}, train={"epochs": 1, "metric": "loss"}
    ),
    "class_loss.yaml": spec_text(
        dataset="regress.npz",
        cv={"n_splits": 2, "splitter": "kfold"},
        train={"epochs": 1, "metric": "loss", "loss": "sparse_categorical_crossentropy"},
    ),
    "shape.yaml": spec_text(
        dataset="regress.npz",
        cv={"n_splits": 2, "splitter": "kfold"},
        train={"epochs": 1, "metric": "loss", "loss": "mean_squared_error"},
    ),
    "stratified_float.yaml": spec_text(
        experiment="reg.py", dataset="regress.npz", train={"epochs": 1, "metric": "mae"}
    ),
    "accuracy_of_regression.yaml": spec_text(
        experiment="reg.py", dataset="regress.npz", cv={"n_splits": 2, "splitter": "kfold"}, train={"epochs": 1}
    ),
    "override.yaml": spec_text(experiment="override.py"),
    "onehot_sparse.yaml": spec_text(
        dataset="onehot.npz", train={"epochs": 1, "loss": "sparse_categorical_crossentropy"}
    ),
    "onehot_width.yaml": spec_text(dataset="onehot3.npz", train={"epochs": 1}),
    "shearing.py": SHEARING_MODEL,
    "tokens.py": TOKENS_MODEL,
    "tokens.yaml": spec_text(experiment="tokens.py", dataset="tokens.npz"),
    "cached.py": CACHED_MODEL,
    "cached.yaml": spec_text(experiment="cached.py"),
    "shared_layer.py": SHARED_LAYER_MODEL,
    "shared_layer.yaml": spec_text(experiment="shared_layer.py"),
    "forced_xla.yaml": spec_text(
        experiment="shearing.py", dataset="squares.npz", train={"epochs": 1, "jit_compile": True}
    ),
    "notdb.db": "not a database\n",
}
DATA = {
    "good.npz": arrays(),
    "tokens.npz": arrays(x=np.random.default_rng(0).integers(0, 20, (60, 16)).astype(np.int32)),
    "squares.npz": arrays(x=np.random.default_rng(0).normal(size=(60, 8, 8, 1)).astype(np.float32)),
    "empty.npz": {"x": np.zeros((0, 8, 1), np.float32), "y": np.zeros((0,), np.int32)},
    "floaty.npz": arrays(y=(np.arange(60) % 2).astype(np.float64)),
    "from1.npz": arrays(y=(np.arange(60) % 2 + 1).astype(np.int32)),
    "plusminus.npz": arrays(y=(np.arange(60) % 2 * 2 - 1).astype(np.int32)),
    "grouped.npz": arrays(groups=np.arange(60) // 5),
    "renamed.npz": {"X": arrays()["x"], "Y": arrays()["y"]},
    "mismatch.npz": arrays(y=(np.arange(50) % 2).astype(np.int32)),
    "nan.npz": arrays(x=np.full((60, 8, 1), np.nan, np.float32)),
    "one_class.npz": arrays(y=np.zeros(60, np.int32)),
    "regress.npz": arrays(y=np.linspace(-1.0, 2.0, 60).astype(np.float32)),
    "positions.npz": arrays(y=(np.arange(60 * 8).reshape(60, 8) % 2).astype(np.int32)),
    "onehot.npz": arrays(y=np.eye(2, dtype=np.float32)[np.arange(60) % 2]),
    "onehot3.npz": arrays(y=np.eye(3, dtype=np.float32)[np.arange(60) % 3]),
    "y_test.npz": arrays(x_test=np.zeros((4, 8, 1), np.float32), y_test=np.array([0, 1, 2, 1], np.int32)),
}

# (case, command line, what the message must say); {store} is an MLflow store with one sweep.
CASES = [
    # the spec
    ("a key written twice", ["validate", "twice.yaml"], ["key 'train' appears twice", "lines 9 and 13"]),
    ("a nested key written twice", ["run", "twice_nested.yaml"], ["key 'batch_size' appears twice"]),
    (
        "an ASHA grace period past the epochs",
        ["run", "asha.yaml"],
        ["search.scheduler.grace_period must be below the epochs a trial trains (train.epochs: at most 1)"],
    ),
    ("a median grace period at the epochs", ["validate", "median.yaml"], ["got grace_period=1"]),
    ("a misspelt key", ["run", "typo.yaml"], ["unknown key 'trian' (did you mean 'train'?)"]),
    (
        "an experiment found nowhere",
        ["run", "no_experiment.yaml"],
        ["experiment: file not found: 'experiments/nope.py'; looked in"],
    ),
    (
        "a data file found nowhere",
        ["validate", "no_data.yaml"],
        ["dataset: file not found: 'data/nope.npz'; looked in"],
    ),
    (
        "an image folder with a corrupt image",
        ["run", "corrupt_images.yaml"],
        ["dataset.images: cannot decode image", "photos/class_1/broken.png'", "remove or replace the file"],
    ),
    ("one split", ["run", "one_split.yaml"], ["cv.n_splits must be an integer >= 2, got 1"]),
    ("a spec that is not UTF-8", ["validate", "latin1.yaml"], ["a spec must be UTF-8 text"]),
    ("a spec that is not YAML", ["run", "broken.yaml"], ["not valid YAML at line"]),
    ("a hyperparameter the model does not have", ["run", "unknown_hp.yaml"], ["search.space.unitz_0"]),
    ("an unknown epoch selection", ["validate", "select.yaml"], ["train.select must be one of best_epoch, last"]),
    # A terminal that read "[low, high]" as a style would print "must be finite numbers , got".
    (
        "bounds that are not numbers",
        ["validate", "bounds.yaml"],
        ["search.space.learning_rate.loguniform must be finite numbers [low, high], got ['low', 'high']"],
    ),
    (
        "a mode against its metric",
        ["run", "mode.yaml"],
        ["train.mode must be min for train.metric loss (lower loss is better", "drop train.mode", "got 'max'"],
    ),
    (
        "grouped data split without its groups",
        ["run", "ungrouped.yaml"],
        [
            "cv.splitter stratified ignores the groups of",
            "use cv.splitter: group | stratified_group, or set cv.groups: ignore",
        ],
    ),
    (
        "a misspelt key of a section read only when present",
        ["validate", "early.yaml"],
        ["unknown key 'train.early_stoping' (did you mean 'early_stopping'?)"],
    ),
    (
        "a store path without a scheme in the spec",
        ["validate", "bad_uri.yaml"],
        ["tracking.uri must be sqlite:///FILE", "(did you mean sqlite:///mlflow.db?)"],
    ),
    (
        "a SQLite URI with two slashes in the spec",
        ["validate", "two_slashes.yaml"],
        ["tracking.uri must be sqlite:/// and the SQLite file's path", "(did you mean sqlite:///mlflow.db?)"],
    ),
    (
        "MLflow's file store, which the installed MLflow refuses",
        ["report", "--tracking-uri", "file:./mlruns"],
        ["--tracking-uri: the installed MLflow refuses its file store", "sqlite:///mlflow.db"],
    ),
    (
        "a data file named without its suffix, as a built-in",
        ["validate", "no_suffix.yaml"],
        ["dataset: 'good' is the name of no built-in dataset", "did you mean 'good.npz'"],
    ),
    ("a spec that does not exist", ["trial", "absent.yaml"], ["spec file not found"]),
    # flags
    (
        "a store path without a scheme",
        ["run", "good.yaml", "--tracking-uri", "mlflow.db"],
        ["--tracking-uri must be sqlite:///FILE", "(did you mean sqlite:///mlflow.db?)"],
    ),
    (
        "a store that is not SQLite",
        ["run", "good.yaml", "--tracking-uri", "sqlite:///notdb.db"],
        ["--tracking-uri:", "notdb.db' is not a SQLite database"],
    ),
    (
        "a SQLite file that is not an MLflow store",
        ["report", "--tracking-uri", "sqlite:///other.db"],
        ["other.db' is a SQLite database but not an MLflow store (its tables: t)"],
    ),
    (
        "a store where no file can be created",
        ["run", "good.yaml", "--tracking-uri", "sqlite:////proc/x.db"],
        ["no store can be created at 'sqlite:////proc/x.db'"],
    ),
    ("no trials", ["run", "good.yaml", "--num-samples", "0"], ["--num-samples must be >= 1, got 0"]),
    ("a Ray address that is no address", ["run", "good.yaml", "--address", "nowhere"], ["must be host:port"]),
    (
        "--resume without a store",
        ["run", "good.yaml", "--resume"],
        ["--resume: no MLflow store at 'sqlite:///store.db'", "no sweep named 'good' to resume"],
    ),
    (
        "--resume of a sweep the store does not have",
        ["run", "good.yaml", "--resume", "--tracking-uri", "{store}"],
        ["no sweep named 'good'"],
    ),
    ("a fold out of range", ["trial", "good.yaml", "--fold", "5"], ["--fold must be between 0 and 1"]),
    (
        "report on a store that does not exist",
        ["report", "--tracking-uri", "sqlite:///absent.db"],
        ["--tracking-uri: no MLflow store at 'sqlite:///absent.db'"],
    ),
    (
        "report on a sweep the store does not have",
        ["report", "nosuch", "--tracking-uri", "{store}"],
        ["SWEEP: no sweep named 'nosuch'"],
    ),
    (
        "a port out of range",
        ["ui", "--tracking-uri", "{store}", "--port", "70000"],
        ["--port must be between 1 and 65535, got 70000"],
    ),
    # --set
    (
        "--set a batch size that is not a number",
        ["trial", "good.yaml", "--set", "batch_size=abc"],
        ["--set: batch_size must be a positive integer (every value it takes), got 'abc'"],
    ),
    (
        "--set an hp.Int to text",
        ["trial", "good.yaml", "--set", "units_0=abc"],
        ["--set units_0: the hypermodel declares it hp.Int"],
    ),
    (
        "--set an hp.Int beyond its range",
        ["trial", "good.yaml", "--set", "num_layers=5"],
        ["--set num_layers: the hypermodel declares it hp.Int from 1 to 3, got 5"],
    ),
    ("--set an hp.Int off its steps", ["trial", "good.yaml", "--set", "units_0=12"], ["in steps of 8, got 12"]),
    (
        "--set a value that is not a scalar",
        ["trial", "good.yaml", "--set", "batch_size=[8"],
        ["--set batch_size: the value must be a YAML scalar (a number, string or boolean), got '[8'"],
    ),
    (
        "--set an unknown optimizer",
        ["trial", "good.yaml", "--set", "optimizer=adamm"],
        ["optimizer must be one of adam, adamw, sgd, rmsprop (did you mean 'adam'?)"],
    ),
    (
        "--set a negative learning rate",
        ["trial", "good.yaml", "--set", "learning_rate=-1"],
        ["learning_rate must be a number > 0 (every value it takes), got -1"],
    ),
    (
        "--set a name the trial does not have",
        ["trial", "good.yaml", "--set", "unitz=8"],
        ["--set unitz: not a hyperparameter of this trial"],
    ),
    ("--set without a value", ["trial", "good.yaml", "--set", "batch_size"], ["--set must be name=value"]),
    # data files
    ("a data file without samples", ["run", "empty.yaml"], ["has no samples"]),
    ("float labels", ["validate", "floaty.yaml"], ["y.astype(int)"]),
    ("labels counted from 1", ["run", "from1.yaml"], ["labels must start at 0", "y - 1"]),
    (
        "-1/+1 labels",
        ["validate", "plusminus.yaml"],
        ["array y has negative labels, e.g. -1; for -1/+1 labels", "y = (y > 0).astype(int)"],
    ),
    ("arrays under other names", ["validate", "renamed.yaml"], ["its arrays are X, Y", "x: X, y: Y"]),
    ("x and y of different lengths", ["run", "mismatch.yaml"], ["differ in length: 60 vs 50"]),
    ("samples with NaN", ["validate", "nan.yaml"], ["60 samples with NaN/Inf"]),
    ("one class", ["run", "one_class.yaml"], ["has a single class"]),
    ("y_test beyond the outputs", ["validate", "y_test.yaml"], ["go up to 2", "(in y_test)"]),
    ("a truncated data file", ["run", "truncated.yaml"], ["truncated.npz"]),
    # experiment modules
    ("a linear head without from_logits", ["run", "linear.yaml"], ["set train.from_logits: true"]),
    ("a train_step override", ["validate", "override.yaml"], ["Custom overrides train_step"]),
    # objectives
    (
        "an objective the model does not compute",
        ["validate", "uncomputed.yaml"],
        ["train.metric must be a score the model computes (accuracy, loss: its loss", "got 'auc'"],
    ),
    (
        "a metric of unknown direction without a mode",
        ["validate", "direction.yaml"],
        ["train.mode is required for train.metric mcc"],
    ),
    (
        "a metric with a value per class",
        ["run", "vector.yaml"],
        ["compiles the metric per_class, which gives several values per fold", "average='macro'"],
    ),
    # regression targets
    (
        "float targets and no loss named",
        ["validate", "no_loss.yaml"],
        [
            "the targets are floats (regression) and neither the model's compile nor the spec names a loss: set train.loss"
        ],
    ),
    (
        "one-hot labels with a sparse loss",
        ["validate", "onehot_sparse.yaml"],
        [
            "the labels are one-hot rows, and the loss sparse_categorical_crossentropy takes class indices",
            "y.argmax(axis=1)",
        ],
    ),
    (
        "one-hot labels of more classes than outputs",
        ["run", "onehot_width.yaml"],
        ["holds one-hot rows of 3 classes, but the model of", "has 2 outputs"],
    ),
    (
        "XLA forced on a model with an op XLA cannot compile",
        ["validate", "forced_xla.yaml"],
        [
            "train.jit_compile is true, but in the model of shearing.py layer 'random_shear' (RandomShear) "
            "runs ImageProjectiveTransformV3, an op XLA has no kernel for",
            "set it to auto",
        ],
    ),
    (
        "token ids of shape (samples, steps), given a channel axis, for a model that declares them without",
        ["validate", "tokens.yaml"],
        ["expects inputs of shape (16,) (x of shape (samples, 16) gets a channel axis", "keras.layers.Reshape((16,))"],
    ),
    (
        "a build that returns the same model at every call",
        ["validate", "cached.yaml"],
        ["returns the same model object at every call", "would not be cross-validation"],
    ),
    (
        "a build that reuses a layer made outside it",
        ["validate", "shared_layer.yaml"],
        ["returns models that share the trainable layers ['hidden'] between calls", "inside build(hp)"],
    ),
    (
        "float targets with a classification loss",
        ["validate", "class_loss.yaml"],
        ["the loss is sparse_categorical_crossentropy, a classification loss"],
    ),
    (
        "targets whose shape does not fit the output",
        ["run", "shape.yaml"],
        [
            "holds float (regression) targets of shape () per sample, but the model",
            "outputs shape (2,) per sample",
            "its loss mean_squared_error",
        ],
    ),
    (
        "stratified folds of float targets",
        ["validate", "stratified_float.yaml"],
        [
            "cv.splitter stratified keeps each class's share of the samples in every fold",
            "float (regression) targets",
            "use cv.splitter: kfold, or group",
        ],
    ),
    (
        "accuracy as the objective of a regression",
        ["validate", "accuracy_of_regression.yaml"],
        ["train.metric must be a score the model computes (loss, mae:", "got 'accuracy'"],
    ),
    (
        "labels per position for a model of one label per sample",
        ["validate", "positions.yaml"],
        ["holds integer labels of shape (8,) per sample (one per position), but the model", "outputs shape (2,)"],
    ),
    # record ids
    (
        "an unknown run id",
        ["rerun", "0123456789abcdef0123456789abcdef", "--tracking-uri", "{store}"],
        ["RUN_ID: no trial run with id '0123456789abcdef0123456789abcdef'"],
    ),
    ("an unknown short run id", ["rerun", "zzzzzz", "--tracking-uri", "{store}"], ["no trial run with id 'zzzzzz'"]),
    (
        "a sweep's run id for a trial's",
        ["rerun", "{sweep_run}", "--tracking-uri", "{store}"],
        ["is not a foldsweep trial"],
    ),
    (
        "a rerun from a store that does not exist",
        ["rerun", "abc", "--tracking-uri", "sqlite:///absent.db"],
        ["--tracking-uri: no MLflow store at 'sqlite:///absent.db'"],
    ),
]


@pytest.fixture(scope="module")
def recorded_store(tmp_path_factory) -> tuple[bytes, str]:
    """An MLflow store holding one sweep's parent run: (its bytes, the parent run id)."""
    from pipeline.contract.results import SweepStatus

    path = tmp_path_factory.mktemp("store") / "recorded.db"
    tracker = Tracker(f"sqlite:///{path}")
    run_id, _ = tracker.start_sweep(name="other", spec_text="", manifest={}, params={}, ray_path_for=str)
    tracker.end_sweep(run_id, status=SweepStatus.OK, summary={})
    return path.read_bytes(), run_id


@pytest.fixture
def workspace(tmp_path, recorded_store, monkeypatch, threads_kept) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).write_bytes(text.encode("latin-1" if name == "latin1.yaml" else "utf-8"))
    for name, data in DATA.items():
        np.savez(tmp_path / name, **data)
    good = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(good[: len(good) // 2])
    with sqlite3.connect(tmp_path / "other.db") as connection:
        connection.execute("CREATE TABLE t (x)")
    (tmp_path / "adir").mkdir()
    for label in (0, 1):  # an image folder in Keras' layout, with one file that is no image
        (tmp_path / "photos" / f"class_{label}").mkdir(parents=True)
        for i in range(4):
            PIL.Image.new("RGB", (8, 8), (60 * label, i, 0)).save(tmp_path / "photos" / f"class_{label}" / f"{i}.png")
    (tmp_path / "photos" / "class_1" / "broken.png").write_bytes(b"\x89PNG, cut short")
    (tmp_path / "recorded.db").write_bytes(recorded_store[0])
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(directory: Path) -> dict[str, bytes | None]:
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None
        for path in sorted(directory.rglob("*"))
    }


def expand(argument: str, workspace: Path, sweep_run: str) -> str:
    return argument.format(store=f"sqlite:///{workspace / 'recorded.db'}", sweep_run=sweep_run)


# The cases `run` refuses after it has started a local Ray (the model's checks, the store's):
# each starts and stops one, about 2 s, so they are end-to-end tests and `make test-fast` leaves
# them out. The battery checks the set against what each case's command does.
AFTER_RAY_STARTS = {
    "a hyperparameter the model does not have",
    "a linear head without from_logits",
    "targets whose shape does not fit the output",
    "a metric with a value per class",
    "one-hot labels of more classes than outputs",
    "--resume without a store",
    "--resume of a sweep the store does not have",
}


@pytest.mark.parametrize(
    "case, argv, expected",
    [pytest.param(*case, id=case[0], marks=[pytest.mark.e2e] if case[0] in AFTER_RAY_STARTS else []) for case in CASES],
)
def test_a_bad_input_is_one_message_and_exit_2_with_nothing_written(
    without_ray, workspace, recorded_store, monkeypatch, case, argv, expected
):
    import ray

    from pipeline import sweep

    connected = []
    connect_ray = sweep.connect_ray

    def connect_and_note(*args, **kwargs):
        started = connect_ray(*args, **kwargs)
        connected.append(True)
        return started

    monkeypatch.setattr(sweep, "connect_ray", connect_and_note)
    before = snapshot(workspace)
    result = CliRunner().invoke(app, [expand(argument, workspace, recorded_store[1]) for argument in argv])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    for phrase in expected:
        assert phrase in output, (phrase, output)
    assert output.count("error:") == 1 and "Traceback" not in output, output
    assert not ray.is_initialized()
    assert snapshot(workspace) == before
    assert bool(connected) == (case in AFTER_RAY_STARTS), "AFTER_RAY_STARTS names the cases refused after Ray started"


def test_a_store_path_that_is_a_directory_is_refused(workspace):
    before = snapshot(workspace)
    result = CliRunner().invoke(app, ["run", "good.yaml", "--tracking-uri", f"sqlite:///{workspace / 'adir'}"])
    assert result.exit_code == 2
    assert f"'sqlite:///{workspace / 'adir'}' names a directory, not a SQLite file" in " ".join(result.output.split())
    assert snapshot(workspace) == before


def test_the_table_covers_every_kind_of_input():
    commands = {argv[0] for _, argv, _ in CASES}
    assert len(CASES) >= 40 and commands == {"validate", "run", "trial", "rerun", "report", "ui"}


def test_unbalanced_grouped_folds_are_warned_about_not_refused(workspace):
    # Six groups of one class each, two per class: whole groups make each fold's classes lopsided.
    y = np.repeat([0, 0, 1, 1, 2, 2], 10).astype(np.int32)
    np.savez(workspace / "grouped.npz", **arrays(60, y=y, groups=np.repeat(np.arange(6), 10)))
    (workspace / "grouped.py").write_text(LOOP_MODEL.replace("Dense(2,", "Dense(3,"))
    (workspace / "grouped.yaml").write_text(
        spec_text(experiment="grouped.py", dataset="grouped.npz", cv={"splitter": "group", "n_splits": 3})
    )
    result = CliRunner().invoke(app, ["validate", "grouped.yaml"])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "warning: cv.splitter group: fold" in output and "cv.splitter: stratified_group" in output


def test_more_output_units_than_the_labels_have_classes_are_warned_about_not_refused(workspace):
    (workspace / "wide.py").write_text(LOOP_MODEL.replace("Dense(2,", "Dense(10,"))
    (workspace / "wide.yaml").write_text(spec_text(experiment="wide.py"))
    result = CliRunner().invoke(app, ["validate", "wide.yaml"])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "has 10 output units, and the labels of the dataset are 0..1 (2 classes)" in output, output
    assert "end the model in Dense(2, ...)" in output


ENVIRONMENT_CASES = [
    (
        "FOLDSWEEP_DATA_DIR",
        "/proc/foldsweep-cache",
        ["validate", "builtin.yaml"],
        ["built-in datasets are cached in $FOLDSWEEP_DATA_DIR (/proc/foldsweep-cache), but no file can be written"],
    ),
    ("FOLDSWEEP_DATA_DIR", "{workspace}/good.yaml", ["run", "builtin.yaml"], ["set $FOLDSWEEP_DATA_DIR to a writable"]),
    (
        "RAY_ADDRESS",
        "nowhere",
        ["run", "good.yaml"],
        ["RAY_ADDRESS must be host:port (e.g. 127.0.0.1:6379), got 'nowhere'"],
    ),
    ("RAY_ADDRESS", "127.0.0.1:9", ["run", "good.yaml"], ["RAY_ADDRESS: no Ray cluster answers at '127.0.0.1:9'"]),
]


@pytest.mark.parametrize(
    "variable, value, argv, expected", ENVIRONMENT_CASES, ids=[f"{case[0]}={case[1]}" for case in ENVIRONMENT_CASES]
)
def test_a_bad_environment_variable_is_one_message_and_exit_2(
    without_ray, workspace, monkeypatch, variable, value, argv, expected
):
    import ray

    (workspace / "builtin.yaml").write_text(spec_text(dataset={"name": "digits"}, experiment="loop.py"))
    monkeypatch.setenv(variable, value.format(workspace=workspace))
    before = snapshot(workspace)
    result = CliRunner().invoke(app, argv)
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    for phrase in expected:
        assert phrase in output, (phrase, output)
    assert "Traceback" not in output and not ray.is_initialized()
    assert snapshot(workspace) == before
