"""The engine under Ray: data copied once per worker process, reused processes give the same
results as fresh ones, and fractional GPU slots bound concurrency (with Ray's logical GPUs)."""

from __future__ import annotations

import math

import pytest
from helpers import DELETE, Replace, latest_sweep
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag, Tracker, TrialRecord

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("empty_store")]


def trial_runs(tracking_uri: str, experiment: str) -> tuple[Tracker, list[TrialRecord]]:
    """The store's tracker and the trials of the latest sweep ``experiment``, oldest first."""
    tracker, _, trials = latest_sweep(tracking_uri, experiment)
    return tracker, trials


def loss_history(tracker: Tracker, run_id: str, folds: int = 2) -> list[float]:
    """Per-fold, per-epoch validation losses, flattened fold by fold."""
    return [
        value for k in range(folds) for _, value in tracker.metric_histories([run_id], f"split{k}_val_loss")[run_id]
    ]


@pytest.fixture
def logical_gpu_cluster(local_ray):
    """The session's Ray, restarted with one logical GPU for one test, then without again."""
    local_ray.ensure(num_cpus=2, num_gpus=1)
    yield
    local_ray.ensure()


def test_reused_worker_copies_data_once_and_matches_a_fresh_one(ray_cluster, tmp_path, write_spec, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Three trials that train alike on one CPU, one at a time: the first runs in a fresh worker
    # process, the next two in the same process, reused through reset_config. (A sweep never trains
    # one config twice: the three clip gradients at bounds no gradient reaches, or not at all.)
    spec = write_spec(
        {
            "name": "reuse",
            "resources": {"max_concurrent": 1},
            "train": {"jit_compile": True},  # XLA's programs, as a longer trial would compile
            "search": {
                "num_samples": 1,
                "space": (
                    Replace(
                        {
                            "conv_layers": 1,
                            "filters": 16,
                            "kernel_size": 3,
                            "dropout": 0.2,
                            "batch_size": 16,
                            "clipping": {"grid": ["none", "value"]},
                            "clip_threshold": {"grid": [1e8, 1e9]},
                        }
                    )
                ),
            },
        }
    )

    result = CliRunner().invoke(app, ["run", str(spec)])

    assert result.exit_code == 0, result.output
    tracker, runs = trial_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "reuse")
    assert len(runs) == 3
    assert len({run.tags[Tag.of("pid")] for run in runs}) == 1, "one worker process ran every trial"
    assert [run.tags.get(Tag.of("worker_retires"), "") for run in runs] == [""] * 3, "a worker kept, never retiring"
    assert [run.tags[Tag.of("data_transfers")] for run in runs] == ["1", "1", "1"]
    fresh = loss_history(tracker, runs[0].run_id)
    for reused in runs[1:]:
        assert loss_history(tracker, reused.run_id) == pytest.approx(fresh, rel=1e-5)
    for run in runs:
        metrics = run.metrics
        assert metrics["train_samples_per_s"] > 0 and metrics["eval_samples_per_s"] > 0
        assert metrics["compile_s"] >= 0 and metrics["split1_train_samples_per_s"] > 0
        assert run.tags[Tag.of("device")] == "/CPU:0"
        # Dropout drawn by foldsweep, under XLA as any layer.
        assert run.tags[Tag.of("random_draws")] == "counter"
        assert run.tags[Tag.of("jit_compile")] == "True"
        assert run.tags[Tag.of("fused")] == "True"  # batch 16 on CPU: folds fused by rule
        assert run.tags[Tag.of("fused_reason")] == (
            "fused: 2 folds in one execution, stacked into one XLA program per step"
        )
        assert run.tags[Tag.of("steps_per_launch")] == "1"  # far fewer steps planned than unrolling needs
        assert run.tags[Tag.of("tf_threads")] == "intra-op 1, inter-op 1"  # one CPU: folds take turns


def test_half_gpu_slots_run_at_most_two_trials_at_once(logical_gpu_cluster, tmp_path, write_spec, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = write_spec(
        {"name": "slots", "resources": {"cpu": 0.5, "gpu": 0.5, "max_concurrent": DELETE}, "search": {"num_samples": 4}}
    )

    result = CliRunner().invoke(app, ["run", str(spec)])

    assert result.exit_code == 0, result.output
    _, runs = trial_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "slots")
    assert len(runs) == 4 and all(run.state == "FINISHED" for run in runs)
    intervals = [(run.started_at, run.ended_at) for run in runs]
    most_at_once = max(sum(start <= moment < end for start, end in intervals) for moment, _ in intervals)
    assert most_at_once <= 2
    for run in runs:
        assert run.tags[Tag.of("gpu_ids")] == "0"  # the slot Ray assigned: logical GPU 0
        assert "training on CPU" in run.tags[Tag.of("device_notice")]


def test_a_fused_trial_with_two_cpus_gets_an_executor_thread_per_fold(ray_cluster, tmp_path, write_spec, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = write_spec(
        {
            "name": "threads",
            "cv": {"n_splits": 3},
            "resources": {"cpu": 2, "max_concurrent": 1},
            # A batch size XLA is weighed at on CPU.
            "search": {"num_samples": 1, "space": {"batch_size": 16}},
            "train": {"epochs": 1},
        }
    )

    result = CliRunner().invoke(app, ["run", str(spec)])

    assert result.exit_code == 0, result.output
    _, runs = trial_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "threads")
    # One epoch of a few steps wins back none of XLA's compile: the plan says so, with its estimate.
    (reason,) = [run.tags[Tag.of("fused_reason")] for run in runs]
    assert reason.startswith(
        "fused: 3 folds in one execution, side by side (2 compute threads); without XLA: its compile (~"
    ), reason
    assert runs[0].tags[Tag.of("jit_compile")] == "False" and float(runs[0].tags[Tag.of("compile_estimate_s")]) > 0
    # Two CPUs for compute, and each of the three fold loops an executor thread of its own.
    assert runs[0].tags[Tag.of("tf_threads")] == "intra-op 2, inter-op 3"


def test_a_one_cpu_trial_trains_its_folds_stacked(ray_cluster, tmp_path, write_spec, monkeypatch):
    """A trial worker of one CPU plans its folds stacked; that stacked folds train as unfused ones
    is test_stacked's (test_fused_and_unfused_per_fold_histories_match), in one-thread pools too."""
    monkeypatch.chdir(tmp_path)
    space = Replace({"conv_layers": 1, "filters": 16, "kernel_size": 3, "dropout": 0.0, "batch_size": 8})
    spec = write_spec(
        {
            "name": "stacked",
            "train": {"epochs": 2, "fused": True, "jit_compile": True},
            "search": {"num_samples": 1, "space": space},
        }
    )
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 0, result.output

    tracker, (stacked,) = trial_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "stacked")
    # One compute thread: side-by-side loops would only take turns, so the folds are stacked.
    assert stacked.tags[Tag.of("fused_reason")] == (
        "fused: 2 folds in one execution (train.fused is true), stacked into one XLA program per step"
    )
    assert stacked.tags[Tag.of("tf_threads")] == "intra-op 1, inter-op 1"
    losses = loss_history(tracker, stacked.run_id)
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)  # 2 folds x 2 epochs
