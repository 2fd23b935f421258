"""The command line: bad input is one message and exit 2, before any trial starts or MLflow is
touched. The refusals of `run` run beside the session's Ray, which `run` joins instead of starting
its own: that a refusal stops the Ray it started is test_cli_bad_inputs' battery."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import Replace, free_port
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.ui_server import ui_command, wait_until_answering

runner = CliRunner()

BROKEN_BUILD = "def build(hp):\n    raise ValueError('no such layer')\n"


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_validate_accepts_a_good_spec(write_spec):
    result = invoke("validate", str(write_spec()))
    assert result.exit_code == 0, result.output
    assert "ok" in result.output and "2 folds" in result.output
    assert "val sizes 160, 160" in result.output


def test_validate_says_the_model_has_a_stacked_form(write_spec):
    result = invoke("validate", str(write_spec()))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert re.search(r"stacked form: yes \(\d+ weights trained per fold\), for the trials the plan stacks", said)


BACKBONES = """
import keras

def resnet50(hp):
    return keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=3)

def efficientnet_b0(hp):
    return keras.applications.EfficientNetB0(input_shape=(32, 32, 3), weights=None, classes=3)

def frozen_mobilenet(hp):  # keras.io's transfer learning: a frozen base and a new head
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None)
    base.trainable = False
    inputs = keras.Input(shape=(32, 32, 3))
    x = keras.layers.GlobalAveragePooling2D()(base(inputs, training=False))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))
"""


@pytest.mark.training  # builds and runs keras.applications backbones: seconds each
@pytest.mark.parametrize(
    ("builder", "stacked"),
    [
        ("resnet50", r"yes \(\d+ weights trained per fold\)"),
        ("efficientnet_b0", r"yes \(\d+ weights trained per fold, 3 frozen held once for every fold\)"),
        ("frozen_mobilenet", r"yes \(2 weights trained per fold, \d+ frozen held once for every fold\)"),
    ],
)
def test_validate_accepts_keras_applications_and_names_their_stacked_form(
    tmp_path, write_spec, write_experiment, builder, stacked
):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", x=rng.uniform(size=(60, 32, 32, 3)).astype(np.float32), y=np.arange(60) % 3)
    experiment = write_experiment(BACKBONES, name="backbones.py")
    spec = write_spec(
        {
            "experiment": f"{experiment}:{builder}",
            "dataset": str(tmp_path / "images.npz"),
            "search": {"space": Replace({"batch_size": 8})},
        }
    )
    result = invoke("validate", str(spec))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert re.search(rf"stacked form: {stacked}(, for the trials the plan stacks|; its folds are never)", said), said


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"cv": {"n_splits": 1}}, "cv.n_splits must be an integer >= 2, got 1"),
        ({"train": {"epoch": 3}}, "unknown key 'train.epoch' (did you mean 'epochs'?)"),
        ({"cv": {"n_splits": 41}}, "cv.n_splits must be <= the smallest class size"),
        ({"dataset": "mnist2d"}, "unknown built-in dataset 'mnist2d'"),
        ({"dataset": {"name": "mnist1d", "num_samples": 5}}, "dataset.num_samples must be an integer >= 100, got 5"),
        ({"dataset": "missing/data.npz"}, "dataset: file not found: 'missing/data.npz'; looked in"),
        ({"search": {"space": {"fliters": 8}}}, "search.space.fliters is not a hyperparameter"),
        ({"experiment": "nowhere/model.py:build"}, "experiment: file not found: 'nowhere/model.py'"),
        ({"tracking": {"uri": "sqlite:////no/such/dir/mlflow.db"}}, "the directory of the SQLite file must exist"),
        ({"tracking": {"uri": "ftp://example/x"}}, "tracking.uri must be sqlite:///FILE"),
        (
            {"tracking": {"uri": "http://127.0.0.1:9"}},
            "tracking.uri: cannot reach an MLflow server at 'http://127.0.0.1:9'",
        ),
        (
            {"search": {"space": {"batch_size": {"choice": [8, 512]}}}},
            "search.space.batch_size must be <= the smallest training fold (160 samples), got 512",
        ),
        (
            {"search": {"space": {"batch_size": -8}}},
            "search.space.batch_size must be a positive integer (every value it takes), got -8",
        ),
        ({"train": {"epochs": 0}}, "train.epochs must be an integer >= 1, got 0"),
        ({"search": {"space": {"dropout": {"uniform": [0.5, 0.2]}}}}, "search.space.dropout.uniform needs low < high"),
        (
            {"search": {"space": {"kernel_size": {"choice": []}}}},
            "search.space.kernel_size.choice must be a non-empty list",
        ),
        ({"resources": {"cpu": 64}}, "resources.cpu must be <= the CPUs of this machine"),
        ({"resources": {"address": "127.0.0.1:9"}}, "no Ray cluster answers at '127.0.0.1:9'"),
        ({"resources": {"address": "nowhere"}}, "must be host:port (e.g. 127.0.0.1:6379), got 'nowhere'"),
        ({"resources": {"max_failures": -1}}, "resources.max_failures must be an integer >= 0, got -1"),
        (
            {"resources": {"gpu": 1.5}},
            "resources.gpu must be a share of one GPU (at most 1) or a whole number of GPUs, got 1.5",
        ),
        (
            {"resources": {"gpu": 2}},
            "resources.gpu must be at most 1: foldsweep trains all the folds of a trial on one GPU",
        ),
        ({"cv": {"n_repeats": 0}}, "cv.n_repeats must be an integer >= 1, got 0"),
        (
            {"cv": {"n_repeats": 10_000_000}},
            "cv.n_repeats: 10000000 repeats x 2 folds = 20,000,000 replicas of the default model",
        ),
        ({"train": {"select": "best"}}, "train.select must be one of best_epoch, last"),
    ],
)
def test_bad_input_exits_2_with_one_message_and_writes_nothing(ray_cluster, tmp_path, write_spec, overrides, message):
    spec = write_spec(overrides)
    for command in ("validate", "run"):
        result = invoke(command, str(spec))
        assert result.exit_code == 2, result.output
        assert message in result.output.replace("\n", " ")
        assert "Traceback" not in result.output
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "ray_results").exists()


def test_missing_spec_and_yaml_errors_exit_2(tmp_path):
    missing = invoke("run", str(tmp_path / "absent.yaml"))
    assert missing.exit_code == 2 and "spec file not found" in missing.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\ncv: {n_splits: 3\n")
    result = invoke("run", str(broken))
    assert result.exit_code == 2 and "not valid YAML at line" in result.output


def test_a_ray_address_that_does_not_answer_is_refused_from_the_command_line(write_spec, tmp_path):
    result = invoke("run", str(write_spec()), "--address", "127.0.0.1:9")
    assert result.exit_code == 2
    assert "no Ray cluster answers at '127.0.0.1:9'" in result.output
    assert not (tmp_path / "mlflow.db").exists()


def test_broken_experiment_is_refused_by_run(ray_cluster, tmp_path, write_spec, write_experiment):
    experiment = write_experiment(BROKEN_BUILD)
    result = invoke("run", str(write_spec({"experiment": f"{experiment}:build"})))
    assert result.exit_code == 2
    assert (
        f"raised ValueError when built with default hyperparameters at {experiment}:2 "
        "(`raise ValueError('no such layer')`): no such layer"
    ) in " ".join(result.output.split())
    assert not (tmp_path / "mlflow.db").exists()


def test_model_output_must_cover_the_labels(write_spec, write_experiment):
    experiment = write_experiment(
        "import keras\n"
        "def build(hp):\n"
        "    i = keras.Input((40, 1))\n"
        "    return keras.Model(i, keras.layers.Dense(3, activation='softmax')(keras.layers.Flatten()(i)))\n"
    )
    result = invoke("validate", str(write_spec({"experiment": f"{experiment}:build", "search": {"space": None}})))
    assert result.exit_code == 2
    assert "labels of 'mnist1d' go up to 9, but the model" in result.output.replace("\n", " ")


def test_num_samples_override_must_be_positive(write_spec):
    result = invoke("run", str(write_spec()), "--num-samples", "0")
    assert result.exit_code == 2
    assert "--num-samples must be >= 1, got 0" in result.output


def test_the_installed_command_exits_2_on_a_bad_spec(write_spec):
    spec = write_spec({"cv": {"splitter": "kfolds"}})
    command = Path(sys.executable).parent / "foldsweep"
    completed = subprocess.run([str(command), "validate", str(spec)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert (
        "cv.splitter must be one of kfold, stratified, group, stratified_group (did you mean 'kfold'?), got 'kfolds'"
        in completed.stderr.replace("\n", " ")
    )


def test_help_lists_every_command():
    """Command names read from the help's table, not substrings: "run" is in "rerun", "ui" in "build"."""
    import typer

    result = invoke("--help")
    assert result.exit_code == 0
    listed = set(re.findall(r"^│ ([a-z][\w-]*)\s{2,}", result.output, re.M))
    registered = set(typer.main.get_command(app).commands)
    assert listed == registered == {"validate", "datasets", "run", "report", "trial", "rerun", "ui"}, result.output


def test_ui_command_is_pasteable_in_any_directory():
    from pathlib import Path

    absolute = f"sqlite:///{Path('mlflow.db').resolve()}"
    assert ui_command("sqlite:///mlflow.db").endswith(f"ui --tracking-uri {absolute}")
    assert ui_command("http://127.0.0.1:5000").endswith("ui --tracking-uri http://127.0.0.1:5000")


def test_ui_refuses_a_port_another_server_listens_on(tmp_path):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = invoke("ui", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--port", str(port))
    assert result.exit_code == 2
    assert f"--port: a server already listens on 127.0.0.1:{port}" in " ".join(result.output.split())
    assert not (tmp_path / "mlflow.db").exists()


@pytest.fixture
def started():
    """Processes of the test's own (stand-ins for the MLflow server), killed afterwards."""
    processes = []

    def start(*arguments: str) -> subprocess.Popen:
        processes.append(subprocess.Popen([sys.executable, *arguments], stdin=subprocess.PIPE))
        return processes[-1]

    yield start
    for process in processes:
        process.kill()
        process.wait(timeout=30)


def test_the_ui_waits_for_its_server_to_answer(started):
    port = free_port()
    server = started("-m", "http.server", "--bind", "127.0.0.1", str(port))
    assert wait_until_answering(server, f"http://127.0.0.1:{port}/#/experiments/1") is None
    assert server.poll() is None


def test_the_ui_gives_the_exit_code_of_a_server_that_ends_before_answering(started):
    ended = started("-c", "raise SystemExit(3)")
    assert wait_until_answering(ended, f"http://127.0.0.1:{free_port()}/") == 3


def test_the_ui_stops_waiting_for_a_server_that_never_answers(started):
    silent = started("-c", "import sys; sys.stdin.read()")  # runs until its standard input closes
    with pytest.raises(TimeoutError, match="did not answer at http://127.0.0.1:.* within 0.5 s"):
        wait_until_answering(silent, f"http://127.0.0.1:{free_port()}/", deadline_s=0.5)
    assert silent.poll() is None
