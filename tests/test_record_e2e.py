"""The full record of a sweep with a diverging config (the session's recorded sweep, conftest):
NaN trials, cv_results, plots, refit, report, the MLflow UI."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import RECORDED_SPACE
from helpers import Replace, free_port, latest_sweep
from typer.testing import CliRunner

from pipeline.base.environment import LOCK_HASH_TAG, LOCK_MATCHES_TAG, VERSION_TAG_PREFIX, installed_version
from pipeline.cli import app
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.spec import DatasetSpec
from pipeline.records.chart_view import SECTIONS
from pipeline.records.plots import PLOTS
from pipeline.records.tracking import DESCRIPTION_TAG, Tag

pytestmark = pytest.mark.e2e


def test_a_diverging_trial_is_recorded_as_nan_and_the_sweep_completes(recorded_sweep):
    assert recorded_sweep.exit_code == 0, recorded_sweep.output
    _, parent, trials = recorded_sweep.records()
    assert len(trials) == 4
    by_config = {(run.params["learning_rate"], run.params["clipping"]): run for run in trials}
    nan_trial = by_config[("50.0", "none")]
    assert nan_trial.state == "FAILED"
    assert nan_trial.tags[Tag.STATUS] == "nan"
    assert nan_trial.metrics["nan_failures"] >= 1
    assert nan_trial.tags[Tag.of("nan_fold")] in {"0", "1"}
    assert nan_trial.tags[Tag.of("nan_epoch")] == "1"
    assert int(nan_trial.tags[Tag.of("nan_step")]) >= 0
    for key in ("nan_last_finite_loss", "nan_grad_norm"):
        assert math.isfinite(float(nan_trial.tags[Tag.of(key)]))
    for config in [("0.01", "none"), ("0.01", "global_norm"), ("50.0", "global_norm")]:
        assert by_config[config].state == "FINISHED" and by_config[config].tags[Tag.STATUS] == "ok"
    # What the scheduler and searcher saw is finite for every trial, the NaN one included.
    assert all(math.isfinite(run.metrics["mean_val_accuracy"]) for run in trials)
    assert parent.metrics["n_nan"] == 1 and parent.metrics["n_failed"] == 0
    assert "nan (fold" in recorded_sweep.output


def test_the_trial_record_has_history_summary_and_system_info(recorded_sweep):
    directory = recorded_sweep.directory
    tracker, _, trials = recorded_sweep.records()
    run = next(run for run in trials if run.tags[Tag.STATUS] == "ok")
    assert {"history.csv", "model_summary.txt"} <= set(tracker.artifact_paths(run.run_id))
    history = list(csv.DictReader(open(tracker.artifact_file(run.run_id, "history.csv", directory))))
    assert [row["epoch"] for row in history] == ["1", "2"]
    assert float(history[1]["mean_val_accuracy"]) == pytest.approx(run.metrics["mean_val_accuracy"])
    for tag in ("tensorflow_version", "keras_version", "ray_version", "device"):
        assert run.tags[Tag.of(tag)]
    assert run.tags[Tag.of("tensorflow_version")] == __import__("tensorflow").__version__
    for metric in ("train_samples_per_s", "compile_s", "eval_samples_per_s", "trial_wall_s", "mean_train_loss"):
        assert metric in run.metrics


def test_each_trial_accounts_for_its_wall_clock(recorded_sweep):
    """Setup, compile, training, validation, the gaps between epochs and the rest add up
    to the trial's wall clock, the rest is small, and each epoch after the first has its gap."""
    from pipeline.records.plots import time_account_data
    from pipeline.records.report import account_rows

    tracker, _, trials = recorded_sweep.records()
    parts = ("setup_s", "compile_s", "train_s", "eval_s", "gap_s", "other_s")
    for run in trials:
        metrics, run_id = run.metrics, run.run_id
        wall = metrics["trial_wall_s"]
        epochs = sorted(step for step, _ in tracker.metric_histories([run_id], "nan_failures")[run_id])
        assert sum(metrics.get(part, 0.0) for part in parts) == pytest.approx(wall, rel=0.05)
        assert abs(metrics["other_s"]) < 0.10 * wall, {part: metrics.get(part) for part in parts}
        assert metrics["setup_s"] > 0 and metrics["train_s"] > 0 and metrics["eval_s"] > 0
        # Compiling is told apart from training once a second epoch ran in every fold (in the
        # NaN trial a fold stopped in its first: there its compiling is counted in train_s).
        if run.tags[Tag.STATUS] == "ok":
            assert metrics["compile_s"] > 0
        gaps = dict(tracker.metric_histories([run_id], "epoch_gap_s")[run_id])
        assert sorted(gaps) == epochs[1:] and all(gap > 0 for gap in gaps.values())
        assert metrics["gap_s"] == pytest.approx(sum(gaps.values()))
    rows = account_rows(trials)
    assert [row["trial"] for row in rows] == [record.label for record in trials] + ["all 4"]
    assert rows[-1]["trial_wall_s"] == pytest.approx(sum(run.metrics["trial_wall_s"] for run in trials))
    assert len(time_account_data(trials)) == 4


def test_the_sweep_accounts_for_its_wall_clock_and_prints_its_fixed_cost(recorded_sweep):
    """The parent run records where the sweep's wall clock went, its parts adding up to
    it: the start until the first trial trained, the training, the refit (this sweep refits) and
    the end; the command prints it after the leaderboard."""
    _, parent, trials = recorded_sweep.records()
    metrics = parent.metrics
    parts = ("sweep_startup_s", "sweep_training_s", "sweep_idle_s", "sweep_refit_s", "sweep_finish_s")
    assert sum(metrics[part] for part in parts) == pytest.approx(metrics["sweep_wall_s"], rel=1e-6)
    assert metrics["sweep_startup_s"] > 0 and metrics["sweep_refit_s"] > 0 and metrics["sweep_finish_s"] > 0
    # Trials train during most of the time between the first step and the last report.
    longest = max(run.metrics["trial_wall_s"] - run.metrics["setup_s"] for run in trials)
    assert metrics["sweep_training_s"] >= longest * 0.95
    assert metrics["sweep_fixed_s"] == pytest.approx(
        metrics["sweep_startup_s"] + metrics["sweep_idle_s"] + metrics["sweep_finish_s"]
    )
    assert f"fixed cost {metrics['sweep_fixed_s']:.1f} s (sweep_fixed_s)" in recorded_sweep.output
    # The share of the trials' summed wall clock that went to compiling, over the trials
    # that measured it (a trial that went NaN in its first epoch has no steady rate to tell).
    timed = [run for run in trials if math.isfinite(run.metrics.get("compile_s", math.nan))]
    compiling = sum(run.metrics["compile_s"] for run in timed)
    wall = sum(run.metrics["trial_wall_s"] for run in timed)
    assert timed and 0 < compiling < wall
    line = f"compile share {compiling / wall:.0%}: compile_s {compiling:.1f} s of the {len(timed)} trials' summed"
    assert line in recorded_sweep.output


def test_the_parent_run_holds_cv_results_plots_and_a_ranking(recorded_sweep):
    directory = recorded_sweep.directory
    tracker, parent, trials = recorded_sweep.records()
    root = set(tracker.artifact_paths(parent.run_id))
    plots = set(tracker.artifact_paths(parent.run_id, "plots"))
    assert {"cv_results.csv", "nan_summary.csv", "spec.yaml", "fold_manifest.json", "refit_model.keras"} <= root
    assert plots == {f"plots/{name}" for name in PLOTS}
    for name in PLOTS:
        png = tracker.artifact_file(parent.run_id, f"plots/{name}", directory)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = list(csv.DictReader(open(tracker.artifact_file(parent.run_id, "cv_results.csv", directory))))
    assert len(rows) == 4
    for column in (
        "param_batch_size",
        "param_clipping",
        "split0_val_accuracy",
        "split1_val_accuracy",
        "mean_val_accuracy",
        "std_val_accuracy",
        "rank_val_accuracy",
        "status",
        "train_samples_per_s",
    ):
        assert column in rows[0]
    ranked = sorted((row for row in rows if row["status"] == "ok"), key=lambda row: int(row["rank_val_accuracy"]))
    assert [int(row["rank_val_accuracy"]) for row in ranked] == [1, 2, 3]
    assert float(ranked[0]["mean_val_accuracy"]) >= float(ranked[-1]["mean_val_accuracy"])
    assert next(row for row in rows if row["status"] == "nan")["rank_val_accuracy"] == ""
    best = next(run for run in trials if run.run_id == ranked[0]["run_id"])
    assert parent.tags[Tag.BEST_RUN_ID] == best.run_id
    assert parent.metrics["best_mean_val_accuracy"] == pytest.approx(best.metrics["mean_val_accuracy"])
    nan_rows = list(csv.DictReader(open(tracker.artifact_file(parent.run_id, "nan_summary.csv", directory))))
    assert {(row["clipping"], row["trials"], row["nan"]) for row in nan_rows} == {
        ("none", "2", "1"),
        ("global_norm", "2", "0"),
    }


def test_the_sweep_describes_itself_in_mlflow(recorded_sweep):
    tracker, parent, trials = recorded_sweep.records()
    note = parent.tags[DESCRIPTION_TAG]
    leaderboard = note.split("### NaN failures")[0]
    ranked_rows = [
        line for line in leaderboard.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    scores = {run.run_id: run.metrics.get("mean_val_accuracy") for run in trials if run.tags[Tag.STATUS] == "ok"}
    best = max(scores, key=scores.get)
    best_run = next(run for run in trials if run.run_id == best)
    label = f"trial-{best_run.tags[Tag.TRIAL_ID].rsplit('_', 1)[-1]}"
    assert ranked_rows[0].split("|")[2].strip() == f"{label} ({best[:8]})", "the best trial first"
    assert len(ranked_rows) == len(scores)
    assert f"foldsweep rerun {best[:8]} --tracking-uri {recorded_sweep.uri}" in note
    assert "### NaN failures by batch size and clipping" in note and "| 8 | none | 2 | 1 |" in note
    assert "test_accuracy" in note  # the refit's score
    assert tracker.trial_record(best_run.run_id).tags[DESCRIPTION_TAG].startswith("Rank **1** of 3")
    nan_trial = next(run for run in trials if run.tags[Tag.STATUS] == "nan")
    assert tracker.trial_record(nan_trial.run_id).tags[DESCRIPTION_TAG].startswith("Not ranked: status nan")


def test_the_new_plots_draw_every_trial(recorded_sweep):
    from pipeline.inputs.spec import Objective
    from pipeline.records.plots import learning_curve_data, parallel_coordinates_data

    tracker, _, records = recorded_sweep.records()
    objective = Objective("accuracy", "max")
    curves = learning_curve_data(
        records, objective, tracker.metric_histories([r.run_id for r in records], objective.key)
    )
    assert len(curves) == 4 and sorted(curve.rank for curve in curves) == [0, 1, 2, 3]
    assert [curve.nan_at for curve in curves if curve.rank == 0] == [1]  # the NaN trial, marked where it stopped
    assert all(len(curve.epochs) == 2 for curve in curves if curve.rank)
    coordinates = parallel_coordinates_data(records, objective)
    assert {"learning_rate", "clipping"} <= set(coordinates.axes)
    assert len(coordinates.rows) == len(coordinates.scores) == 4  # the NaN trial's CV mean is finite (worst)
    assert all(0.0 <= value <= 1.0 for row in coordinates.rows for value in row)


def test_the_live_best_is_the_leaderboards_best_after_every_recorded_trial(recorded_sweep):
    """Fed the recorded trials in the order they ended, as the sweep feeds them."""
    from pipeline.inputs.spec import Objective
    from pipeline.records.progress import SweepProgress
    from pipeline.records.report import Standings, selected_score

    _, _, records = recorded_sweep.records()
    objective = Objective("accuracy", "max")
    progress = SweepProgress(objective, trials_planned=len(records), epochs_per_trial=2)
    for count, record in enumerate(records, start=1):
        progress.recorded(record)
        board = Standings.of(records[:count], objective, n_splits=2)
        best = board.ranked[0] if board.ranked else None
        assert progress.best() is best
        if best is not None:
            assert f"best {objective.key} {selected_score(best, objective.key):.4f} at epoch" in progress.summary_line()
    assert progress.best() is not None and any(record.status == "nan" for record in records)


def test_every_title_and_label_of_every_plot_lies_inside_its_figure(recorded_sweep):
    """The parallel coordinates of two axes clipped its title ("yperparameters") and the values
    of its last axis ("global_nor")."""
    import matplotlib.pyplot as plt

    from pipeline.inputs.spec import Objective
    from pipeline.records.plots import PLOTS, plot_figures

    tracker, _, records = recorded_sweep.records()
    objective = Objective("accuracy", "max")
    figures = plot_figures(records, objective, tracker.metric_histories([r.run_id for r in records], objective.key))
    assert list(figures) == list(PLOTS)
    for name, figure in figures.items():
        # What is drawn (titles, labels, the values beside each axis), in inches: within the figure.
        drawn = figure.get_tightbbox(figure.canvas.get_renderer())
        width, height = figure.get_size_inches()
        assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= width + 0.01 and drawn.y1 <= height + 0.01, (
            name,
            drawn,
            (width, height),
        )
        plt.close(figure)


def test_refit_scores_the_best_config_on_the_held_out_test_split(recorded_sweep):
    directory = recorded_sweep.directory
    tracker, parent, _ = recorded_sweep.records()
    assert parent.tags[Tag.REFIT_OF] == parent.tags[Tag.BEST_RUN_ID]
    model = keras.models.load_model(tracker.artifact_file(parent.run_id, "refit_model.keras", directory))
    data = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 400}))
    accuracy = float(np.mean(np.argmax(model.predict(data.x_test, verbose=0), axis=-1) == data.y_test))
    assert parent.metrics["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert 0 < parent.metrics["test_loss"] < 10


def logged_model(uri: str, model_uri: str):
    """The logged model as MLflow's own client reads it (what its UI shows)."""
    from mlflow import MlflowClient

    return MlflowClient(uri).get_logged_model(model_uri.removeprefix("models:/"))


def test_the_refit_is_a_logged_model_that_predicts_its_recorded_test_score(recorded_sweep, monkeypatch):
    from urllib.parse import urlparse

    import mlflow
    from mlflow import MlflowClient

    _, parent, _ = recorded_sweep.records()
    model_uri = parent.tags[Tag.REFIT_MODEL]
    model = logged_model(recorded_sweep.uri, model_uri)
    assert (model.name, str(model.status), model.source_run_id) == ("refit_model", "READY", parent.run_id)
    assert model.tags[Tag.REFIT_OF] == parent.tags[Tag.REFIT_OF]
    # Its params are the refit trial's: what it used, no value whose condition is off (a threshold
    # without clipping).
    trial_params = MlflowClient(recorded_sweep.uri).get_run(parent.tags[Tag.REFIT_OF]).data.params
    assert model.params and all(trial_params.get(name) == value for name, value in model.params.items()), (
        model.params,
        trial_params,
    )
    linked = {metric.key: (metric.value, metric.dataset_name) for metric in model.metrics}
    assert linked["test_accuracy"] == (parent.metrics["test_accuracy"], "data-test")
    assert (
        f"refit model {model_uri}" in recorded_sweep.output and "load it: MLFLOW_TRACKING_URI=" in recorded_sweep.output
    )

    monkeypatch.setenv("MLFLOW_TRACKING_URI", recorded_sweep.uri)  # how the printed line loads it
    loaded = mlflow.pyfunc.load_model(model_uri)
    with np.load(recorded_sweep.directory / "data.npz") as data:
        x_test, y_test = data["x_test"], data["y_test"]
    (signature,) = loaded.metadata.signature.inputs.inputs
    assert (signature.shape, signature.type) == ((-1, *x_test.shape[1:]), x_test.dtype)
    requirements = Path(urlparse(model.artifact_location).path, "requirements.txt").read_text().split()
    assert f"tensorflow=={installed_version('tensorflow')}" in requirements
    predicted = np.argmax(loaded.predict(x_test), axis=-1)
    assert float(np.mean(predicted == y_test)) == parent.metrics["test_accuracy"]

    registry = MlflowClient(recorded_sweep.uri)
    champion = registry.get_model_version_by_alias("diverging-cnn", "champion")
    assert (str(champion.version), champion.source) == ("1", model_uri)
    assert parent.tags[Tag.REGISTERED_MODEL] == "models:/diverging-cnn/1"


def test_mlflow_serves_the_refit_model_with_its_predictions(recorded_sweep, tmp_path):
    """``mlflow models serve`` of the printed model URI, a real server on a free local port."""
    import json
    import os
    import sys
    import urllib.request

    from helpers import serving

    tracker, parent, _ = recorded_sweep.records()
    with np.load(recorded_sweep.directory / "data.npz") as data:
        samples = data["x_test"][:4]
    keras_model = keras.models.load_model(tracker.artifact_file(parent.run_id, "refit_model.keras", tmp_path))
    expected = keras_model.predict(samples, verbose=0)
    port = free_port()
    bin_directory = str(Path(sys.executable).parent)
    command = [f"{bin_directory}/mlflow", "models", "serve", "-m", parent.tags[Tag.REFIT_MODEL]]
    command += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    environment = {
        **os.environ,
        "MLFLOW_TRACKING_URI": recorded_sweep.uri,
        "PATH": f"{bin_directory}:{os.environ['PATH']}",
    }
    url = f"http://127.0.0.1:{port}"
    with serving(command, url=url, what="mlflow models serve", env=environment, cwd=tmp_path):
        request = urllib.request.Request(
            f"{url}/invocations",
            data=json.dumps({"inputs": samples.tolist()}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answered = np.asarray(json.loads(response.read())["predictions"])
    assert answered.shape == expected.shape
    np.testing.assert_allclose(answered, expected, rtol=1e-5, atol=1e-7)
    assert not (tmp_path / "mlflow.db").exists()


def test_every_run_says_where_it_came_from_and_which_data_it_saw_and_the_sweep_its_host(recorded_sweep):
    import json
    import subprocess

    from mlflow import MlflowClient

    from pipeline.records.provenance import DIGEST_LENGTH

    tracker, parent, trials = recorded_sweep.records()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
    ).stdout.strip()
    client = MlflowClient(recorded_sweep.uri)  # the runs' inputs, as MLflow's own client reads them
    # The data's fingerprint, as the sweep's param records it, digests both of its splits.
    digest = parent.params["dataset_fingerprint"][:DIGEST_LENGTH]
    digests = {"data-train": digest, "data-test": digest}
    for record, contexts in [(parent, {"data-train": "training", "data-test": "testing"})] + [
        (trial, {"data-train": "training"}) for trial in trials
    ]:
        assert record.tags["mlflow.user"] and record.tags["mlflow.source.type"] == "LOCAL"
        assert record.tags["mlflow.source.name"] and record.tags["mlflow.source.git.commit"] == commit
        inputs = client.get_run(record.run_id).inputs.dataset_inputs
        seen = {item.dataset.name: (item.tags[0].value, item.dataset.digest) for item in inputs}
        assert seen == {name: (context, digests[name]) for name, context in contexts.items()}
    # MLflow's own system metrics on the parent run, sampled while the sweep ran.
    cpu = client.get_metric_history(parent.run_id, "system/cpu_utilization_percentage")
    assert cpu and all(0 <= point.value <= 100 for point in cpu)
    assert parent.metrics["system/system_memory_usage_megabytes"] > 0
    profile = json.loads(client.get_run(parent.run_id).inputs.dataset_inputs[0].dataset.profile)
    assert profile["classes"] == 10 and profile["features_shape"][1:] == [40, 1]
    same_data = client.search_runs(
        [tracker.experiment_id("diverging")], f"datasets.digest = '{digests['data-train']}'", max_results=100
    )
    assert {run.info.run_id for run in same_data} == {parent.run_id, *(trial.run_id for trial in trials)}


def test_the_refit_in_a_thread_beside_the_trials_is_the_refit_after_them_to_the_bit(recorded_sweep, tmp_path):
    """The sweep's refit trains in a thread of the driver, started at the sweep's last step at the
    latest (``pipeline.refit.EarlyRefit``); the same refit run here, in the driver's main thread
    after the sweep, as it ran before, scores the same numbers exactly."""
    from pipeline.checks import prepare
    from pipeline.inputs.hypermodel import load_builder
    from pipeline.inputs.spec import load_spec
    from pipeline.refit import refit
    from pipeline.rerun import load_recorded_trial

    tracker, parent, _ = recorded_sweep.records()
    prepared = prepare(load_spec(recorded_sweep.directory / "spec.yaml"), tracking_uri=recorded_sweep.uri)
    best = load_recorded_trial(tracker, parent.tags[Tag.REFIT_OF])
    after = refit(
        load_builder(prepared.experiment_path, prepared.spec.experiment_attr),
        best.config,
        prepared.dataset,
        epochs=int(parent.metrics["refit_epochs"]),
        recipe=prepared.trial_settings().recipe,
        directory=tmp_path,
    )
    assert after.test_loss == parent.metrics["test_loss"]
    assert after.test_accuracy == parent.metrics["test_accuracy"]


def test_report_prints_the_tables_and_refreshes_the_plots(recorded_sweep):
    tracker, parent, _ = recorded_sweep.records()
    before = set(tracker.artifact_paths(parent.run_id, "plots"))
    uri = recorded_sweep.uri
    for sweep in (None, "diverging", parent.run_id):
        result = CliRunner().invoke(app, ["report", *([sweep] if sweep else []), "--tracking-uri", uri])
        assert result.exit_code == 0, result.output
        assert "diverging: leaderboard" in result.output
        assert "NaN failures by batch size and clipping" in result.output
        assert "throughput by batch size" in result.output
        assert "where each trial's time went" in result.output and "other_s" in result.output
        assert "test_accuracy" in result.output
        assert "(sweep_fixed_s)" in result.output and "compile share " in result.output
        assert f"refit model {parent.tags[Tag.REFIT_MODEL]}" in result.output and "serve it: " in result.output
    assert set(tracker.artifact_paths(parent.run_id, "plots")) == before
    missing = CliRunner().invoke(app, ["report", "nosuch", "--tracking-uri", uri])
    assert missing.exit_code == 2 and "no sweep named 'nosuch'" in missing.output
    trial_id = recorded_sweep.records().trials[0].run_id
    not_sweep = CliRunner().invoke(app, ["report", trial_id, "--tracking-uri", uri])
    assert not_sweep.exit_code == 2 and "is not a foldsweep sweep" in not_sweep.output


def test_refit_can_be_turned_off_and_optuna_with_asha_survives_divergence(
    ray_cluster, tmp_path, write_spec, empty_store, monkeypatch
):
    """Also Optuna's define-by-run space end to end: a clip threshold only where clipping is on."""
    monkeypatch.chdir(tmp_path)
    space = {
        **RECORDED_SPACE,
        "learning_rate": {"choice": [0.01, 50.0]},
        "clipping": {"choice": ["none", "global_norm"]},
        "clip_threshold": {"loguniform": [0.1, 10.0]},
    }
    spec = write_spec(
        {
            "name": "optuna-nan",
            "train": {"refit": False, "epochs": 3},
            "search": {
                "algorithm": "optuna",
                "num_samples": 4,
                "seed": 2,
                "scheduler": "asha",
                "space": Replace(space),
            },
        }
    )

    result = CliRunner().invoke(app, ["run", str(spec)])

    assert result.exit_code == 0, result.output
    tracker, parent, trials = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "optuna-nan")
    assert len(trials) == 4
    assert "nan" in {run.tags[Tag.STATUS] for run in trials}
    assert {run.tags[Tag.STATUS] for run in trials} <= {"ok", "pruned", "nan"}
    assert {run.params["clipping"] for run in trials} == {"none", "global_norm"}
    for run in trials:
        assert ("clip_threshold" in run.params) == (run.params["clipping"] != "none")
    assert all(math.isfinite(run.metrics["mean_val_accuracy"]) for run in trials)
    assert "test_accuracy" not in parent.metrics
    assert "refit_model.keras" not in set(tracker.artifact_paths(parent.run_id))


WINDOW_SIZE = (1600, 1000)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=30000",
]


def rendered(chromium: str, url: str, profile: Path, *, width: int = WINDOW_SIZE[0]) -> str:
    """The page's DOM after its scripts ran, from headless Chromium (a table holds the columns
    its window's ``width`` shows)."""
    import subprocess

    window = f"--window-size={width},{WINDOW_SIZE[1]}"
    completed = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, window, f"--user-data-dir={profile}", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return completed.stdout


def assert_drawn_page(screenshot: Path) -> None:
    """A PNG of the window's size with text across it (dark pixels spread over half its width),
    not a blank or an error page."""
    from PIL import Image, ImageOps

    with Image.open(screenshot) as image:
        assert image.format == "PNG" and image.size == WINDOW_SIZE
        dark = ImageOps.invert(image.convert("L")).point(lambda value: 255 if value > 96 else 0)
        box = dark.getbbox()
    assert box is not None and box[2] - box[0] > WINDOW_SIZE[0] // 2, box


def test_the_mlflow_ui_shows_the_sweep_in_a_real_browser(recorded_sweep, tmp_path):
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from helpers import answers

    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: `make test` installs it (Debian package chromium)")
        pytest.skip("chromium is not installed; `make test` installs it")
    tracker, parent, trials = recorded_sweep.records()
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "foldsweep"),
        "ui",
        "diverging",
        "--tracking-uri",
        recorded_sweep.uri,
        "--port",
        str(port),
    ]
    ui = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        printed = ui.stdout.readline()
        address = re.search(r"at (http://127\.0\.0\.1:\d+/\S+)", printed).group(1)
        assert "viewStateShareKey=" in address
        assert answers(address), "the address is printed once the UI answers"
        # A fresh browser profile, as a new user has: the printed address opens on the sweep's trials,
        # each with the data it trained on (the last column: wide enough a window shows it).
        page = rendered(chromium, address, tmp_path / "fresh-profile", width=3600)
        visible = re.sub(r"<[^>]+>", " ", page)
        for run in trials:
            assert run.run_name in visible
        assert visible.count("data-train") == len(trials)
        assert "mean_val_accuracy" in visible and "Model training" in visible
        assert re.search(rf"\b{len(trials)}\s+matching runs", visible), "the trials, flat, without the parent"
        ok_scores = sorted(
            ((run.metrics["mean_val_accuracy"], run.run_name) for run in trials if run.tags[Tag.STATUS] == "ok"),
            reverse=True,
        )
        positions = [visible.index(name) for _, name in ok_scores]
        assert positions == sorted(positions), "best first"
        # The same view's charts: in foldsweep's sections, and no chart MLflow added on its own.
        charts = address + "&compareRunsMode=CHART"
        charted = re.sub(r"<[^>]+>", " ", rendered(chromium, charts, tmp_path / "charts-profile"))
        for section in SECTIONS:
            assert re.search(rf"{section}\s*\(\d+\)", charted), section
        assert "Model metrics" not in charted
        screenshot = tmp_path / "sweep_charts_in_the_ui.png"
        shot = subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--window-size={WINDOW_SIZE[0]},{WINDOW_SIZE[1]}",
                f"--user-data-dir={tmp_path / 'shot-profile'}",
                f"--screenshot={screenshot}",
                charts,
            ],
            capture_output=True,
            timeout=120,
        )
        assert shot.returncode == 0, shot.stderr
        assert_drawn_page(screenshot)
        # The experiment's runs table: the data each run saw, and the sweep's model on its run.
        experiment = tracker.experiment_id(parent.name)
        runs_table = rendered(
            chromium,
            f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs?workflowType=machine_learning",
            tmp_path / "table-profile",
        )
        assert "data-train" in runs_table and 'href="#/models/diverging-cnn/versions/1"' in runs_table
        nan_trial = next(run for run in trials if run.tags[Tag.STATUS] == "nan")
        trial_page = rendered(
            chromium,
            f"http://127.0.0.1:{port}/#/experiments/{tracker.experiment_id(parent.name)}/runs/{nan_trial.run_id}",
            tmp_path / "profile2",
        )
        assert nan_trial.run_name in trial_page
        for text in ("mean_val_accuracy", "nan_failures", Tag.STATUS, Tag.of("nan_epoch")):
            assert text in trial_page
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)


def test_the_sweep_records_the_environment_it_ran_in_and_report_prints_it(recorded_sweep):
    import hashlib
    from importlib import metadata

    from pipeline.base.environment import direct_dependencies

    _, parent, _ = recorded_sweep.records()
    tags = parent.tags
    lock = Path(__file__).resolve().parents[1] / "uv.lock"
    assert tags[LOCK_HASH_TAG] == "sha256:" + hashlib.sha256(lock.read_bytes()).hexdigest()
    assert tags[LOCK_MATCHES_TAG] == "true"
    names = direct_dependencies()
    assert {"tensorflow", "keras", "ray", "mlflow", "scikit-learn", "keras-tuner"} <= set(names)
    for name in names:
        assert tags[f"{VERSION_TAG_PREFIX}{name}"] == metadata.version(name)
    result = CliRunner().invoke(app, ["report", "--tracking-uri", recorded_sweep.uri])
    output = " ".join(result.output.split())
    assert f"environment: lock {tags[LOCK_HASH_TAG]} (installed versions match it: true)" in output
    assert f"tensorflow {metadata.version('tensorflow')}" in output and f"ray {metadata.version('ray')}" in output
