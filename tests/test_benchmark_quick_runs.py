"""A quick run of each benchmark that measures (its smallest settings, for what its rows hold, not
for its numbers): each runs as its command does, its measurements in the processes it starts.
`benchmarks.gpu_check` and `benchmarks.suite_cpu` have tests of their own; the readers of recorded
trials are tested in test_benchmark_readers.py."""

from __future__ import annotations

import json
from pathlib import Path

import keras_tuner
import numpy as np
import pytest

from benchmarks import (
    compile_cache,
    compile_cost,
    cv_throughput,
    image_models,
    launch_form,
    replicas,
    soak,
    suite_pools,
    sweep_wallclock,
    trial_vs_fit,
)


def read_rows(path: Path) -> object:
    return json.loads(path.read_text())


def test_launch_form_times_both_forms_of_a_launch(tmp_path):
    out = tmp_path / "rows.json"
    assert launch_form.main(["--quick", "--cpus", "1", "--json", str(out)]) == 0
    rows = read_rows(out)
    assert [(row["dataset"], row["batch_size"], row["form"]) for row in rows] == [
        ("mnist1d", 64, "unrolled"),
        ("mnist1d", 64, "looped"),
    ]
    assert all(row["us_per_step"] > 0 and row["compile_s"] > 0 for row in rows)
    assert rows[0]["per_step_vs_unrolled"] == 1.0
    assert rows[1]["per_step_vs_unrolled"] == pytest.approx(rows[1]["us_per_step"] / rows[0]["us_per_step"])


def test_cv_throughput_measures_a_variant_against_the_machines_peak(tmp_path):
    out = tmp_path / "rows.json"
    arguments = ["--quick", "--datasets", "mnist1d", "--batch-sizes", "64", "--variants", "fused", "--repeats", "1"]
    assert cv_throughput.main([*arguments, "--cpus", "1", "--json", str(out)]) == 0
    peak, fused = read_rows(out)
    assert (peak["variant"], fused["variant"], fused["batch_size"]) == (cv_throughput.PEAK, "fused", 64)
    assert peak["gflops_per_s"] > 0 and fused["samples_per_s"] > 0 and fused["compile_s"] > 0


def test_replicas_compares_more_replicas_with_the_first_count(tmp_path):
    out = tmp_path / "rows.json"
    arguments = ["--batch-sizes", "64", "--layouts", "fused", "--replicas", "3,6", "--repeats", "1", "--epochs", "1"]
    assert replicas.main([*arguments, "--cpus", "1", "--json", str(out)]) == 0
    rows = read_rows(out)
    assert [row["replicas"] for row in rows] == [3, 6]
    assert rows[0]["vs_first"] == 1.0 and rows[1]["vs_first"] > 0
    assert all(row["samples_per_s"] > 0 and row["plan"] for row in rows)


def test_compile_cost_runs_a_trial_and_reads_its_compile_and_epoch_seconds(tmp_path):
    out = tmp_path / "rows.json"
    assert compile_cost.main(["--blocks", "1", "--variants", "noxla", "--json", str(out)]) == 0
    (row,) = read_rows(out)
    assert (row["blocks"], row["variant"]) == (1, "noxla")
    assert row["compile_s"] > 0 and row["epoch_s"] > 0 and row["plan"]


def test_compile_cache_runs_off_cold_and_warm_and_the_warm_run_loads_what_the_cold_one_compiled(tmp_path):
    out = tmp_path / "result.json"
    assert compile_cache.main(["--one-trial", "--epochs", "2", "--json", str(out)]) == 0
    result = read_rows(out)
    assert [result[run]["trials"] for run in ("off", "cold", "warm")] == [1, 1, 1]
    assert result["off"]["hits"] == 0 and result["cold"]["hits"] == 0 and result["cold"]["misses"] > 0
    assert result["warm"]["hits"] == result["cold"]["misses"] and result["warm"]["misses"] == 0
    assert result["off"]["fold_losses"] == result["cold"]["fold_losses"] == result["warm"]["fold_losses"]


def test_compile_cache_refuses_a_single_epoch_whose_compile_time_no_trial_measures(capsys):
    with pytest.raises(SystemExit) as refused:
        compile_cache.main(["--one-trial", "--epochs", "1"])
    assert refused.value.code == 2
    assert "--epochs: at least 2, for the trials to measure their compile_s; got 1" in capsys.readouterr().err


def test_sweep_wallclock_times_a_sweep_against_the_naive_loop(tmp_path):
    out = tmp_path / "result.json"
    assert sweep_wallclock.main(["--quick", "--json", str(out)]) == 0
    result = read_rows(out)
    assert (result["configs"], result["folds"], result["epochs"]) == (2, 3, 1)
    assert result["naive_s"] > 0 and result["foldsweep_s"] > 0
    assert result["ratio"] == pytest.approx(result["naive_s"] / result["foldsweep_s"], abs=0.1)


def test_trial_vs_fit_times_a_trial_and_the_naive_loop_on_the_same_images(tmp_path):
    with np.load(trial_vs_fit.write_images(tmp_path / "shapes.npz")) as shapes:
        images = tmp_path / "images.npz"
        np.savez(images, x=shapes["x"][:300], y=shapes["y"][:300])
    out = tmp_path / "rows.json"
    arguments = ["--model", "image_cnn", "--epochs", "2", "--batch-size", "64", "--data", str(images)]
    assert trial_vs_fit.main([*arguments, "--json", str(out)]) == 0
    (row,) = read_rows(out)
    assert row["model"] == "image_cnn" and row["foldsweep_s"] > 0 and row["naive_s"] > 0 and row["compile_s"] > 0
    # faster_by is of the unrounded walls, each printed to 0.1 s
    assert row["faster_by"] == pytest.approx(row["naive_s"] / row["foldsweep_s"], rel=0.05) and row["plan"]


def test_suite_pools_runs_two_pytest_processes_with_each_pool_size(capsys):
    suite_pools.main(["--quick"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pools", "machine", "CPU-s", "wall", "s"]
    assert [line.split()[0] for line in lines[1:]] == ["default", "shared"]
    assert all(float(value) > 0 for line in lines[1:] for value in line.split()[1:])


def test_soak_runs_its_trials_through_a_sweep_and_finds_each_recorded_once(ray_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # soak works in a directory of its own
    soak.main(["--trials", "2", "--every", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("MLflow: 2 trial runs, 2 FINISHED, 2 distinct trials;")
    row = lines[-2].split()
    assert row[0] == "2" and int(row[1]) >= 1


@pytest.mark.parametrize("name", image_models.NAMES)
def test_each_image_model_builds_a_ten_class_classifier_of_the_shapes(name):
    model = getattr(image_models, name)(keras_tuner.HyperParameters())
    assert model.input_shape == (None, 32, 32, 3) and model.output_shape == (None, 10)
    assert model.count_params() > 0
