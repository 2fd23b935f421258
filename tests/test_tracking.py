"""MLflow through ``Tracker`` (pipeline.records.tracking), on a real SQLite store: a sweep's
parent run and its trials written and read back typed, a resume finding them again, a trial
found by any id a user gives, and the tag names users' scripts read."""

from __future__ import annotations

import contextlib
import math
import sqlite3
import time
from pathlib import Path

import pytest
from helpers import REPO, seed_store

from pipeline.base.errors import TrackingError
from pipeline.contract.results import (
    EpochResult,
    EpochSelection,
    FoldScores,
    FoldThroughput,
    SweepStatus,
    Throughput,
    TrialStatus,
)
from pipeline.inputs.spec import Objective
from pipeline.records.tracking import (
    DESCRIPTION_TAG,
    HISTORY_ARTIFACT,
    TRIAL_CONFIG_ARTIFACT,
    Tag,
    Tracker,
    TrialRecord,
    _history_csv,
)

SPEC_TEXT = "name: tiny\n"
MANIFEST = {"n_splits": 2, "folds": [[0, 1], [2, 3]]}


def test_the_tag_names_are_the_documented_ones():
    """The one test of the literal names (users' scripts and MLflow searches read them;
    docs/recorded.md); every other test reads them through ``Tag``."""
    assert {name: value for name, value in vars(Tag).items() if name.isupper()} == {
        "PREFIX": "foldsweep.",
        "ROLE": "foldsweep.role",
        "STATUS": "foldsweep.status",
        "SWEEP": "foldsweep.sweep",
        "CODE": "foldsweep.code",
        "TRIAL_ID": "foldsweep.trial_id",
        "ERROR": "foldsweep.error",
        "RETRIES": "foldsweep.retries",
        "RERUN_OF": "foldsweep.rerun_of",
        "RAY_PATH": "foldsweep.ray_experiment_path",
        "RESUMES": "foldsweep.resumes",
        "BEST_RUN_ID": "foldsweep.best_run_id",
        "REFIT": "foldsweep.refit",
        "REFIT_OF": "foldsweep.refit_of",
        "REFIT_MODEL": "foldsweep.refit_model",
        "REGISTERED_MODEL": "foldsweep.registered_model",
        "NUMERICS_OP": "foldsweep.numerics_op",
        "NUMERICS_NODE": "foldsweep.numerics_node",
        "NUMERICS_LAYER": "foldsweep.numerics_layer",
        "NUMERICS_VARIABLE": "foldsweep.numerics_variable",
        "NUMERICS_FOLD": "foldsweep.numerics_fold",
        "NUMERICS_EPOCH": "foldsweep.numerics_epoch",
        "NUMERICS_STEP": "foldsweep.numerics_step",
        "RERUN_DIFFERS": "foldsweep.rerun_differs",
        "PVALUE_VS_BEST": "foldsweep.pvalue_vs_best",
        "PARENT": "mlflow.parentRunId",
    }
    assert Tag.of("fused_reason") == "foldsweep.fused_reason" and Tag.of("pid") == "foldsweep.pid"


@pytest.fixture
def tracker(tmp_path) -> Tracker:
    return Tracker(f"sqlite:///{seed_store(tmp_path / 'mlflow.db')}")


def start(tracker: Tracker, name: str = "tiny") -> str:
    run_id, ray_path = tracker.start_sweep(
        name=name,
        spec_text=SPEC_TEXT,
        manifest=MANIFEST,
        params={"train.metric": "loss", "train.mode": "min", "cv.n_splits": 2},
        ray_path_for=lambda run_id: f"/ray/{name}-{run_id[:8]}",
    )
    assert ray_path == f"/ray/{name}-{run_id[:8]}"
    return run_id


def trial(tracker: Tracker, parent: str, trial_id: str, config=None, **options):
    return tracker.trial_recorder(
        parent_run_id=parent,
        run_name=f"trial-{trial_id[-5:]}",
        role="trial",
        config=config or {"learning_rate": 0.01, "batch_size": 8},
        tags={},
        trial_id=trial_id,
        **options,
    )


def epoch(number: int, losses: tuple[float, float]) -> dict:
    """An epoch's report of a trial of two folds."""
    folds = tuple(FoldScores(train_loss=loss + 0.1, val_loss=loss, val_accuracy=0.5) for loss in losses)
    return EpochResult(
        epoch=number,
        fold_ids=(0, 1),
        folds=folds,
        epochs_planned=3,
        throughput=Throughput(100.0, 200.0, 1.0, (FoldThroughput(50.0, 1.0),) * 2),
    ).report()


def test_a_sweep_is_found_by_its_name_its_run_id_or_as_the_latest(tracker):
    first = start(tracker, "first")
    second = start(tracker, "second")
    found = tracker.find_sweep("first")
    assert (found.run_id, found.name) == (first, "first")
    assert found.objective == Objective(metric="loss", mode="min") and found.n_splits == 2
    assert found.tags[Tag.ROLE] == "sweep" and found.tags[Tag.STATUS] == SweepStatus.RUNNING.value
    assert found.state == "RUNNING"
    assert found.tags[Tag.RAY_PATH] == f"/ray/first-{first[:8]}"
    assert tracker.find_sweep(second).name == "second" and tracker.find_sweep().run_id == second
    with pytest.raises(TrackingError, match="SWEEP: no sweep named 'third' in sqlite:///"):
        tracker.find_sweep("third")
    with pytest.raises(TrackingError, match=f"SWEEP: no run with id '{'0' * 32}'"):
        tracker.find_sweep("0" * 32)
    assert tracker.find_sweep(second[:8]).run_id == second  # the short id run prints
    # a sweep's own run given for a trial's: said what it is
    with pytest.raises(TrackingError, match=f"no trial run with id '{second[:8]}' .*: it is the run of sweep"):
        tracker.trial_run_id(second[:8])


def test_a_trial_records_its_config_epochs_and_end_and_reads_back_typed(tracker):
    parent = start(tracker)
    selection = EpochSelection(Objective(metric="loss", mode="min"))
    recorder = trial(tracker, parent, "11830_00003", selection=selection)
    for number, losses in ((1, (0.9, 0.7)), (2, (0.5, 0.3)), (3, (0.6, 0.4))):
        recorder.log_epoch(epoch(number, losses))
    recorder.finish(TrialStatus.OK)

    [record] = tracker.trial_records(parent)
    assert isinstance(record, TrialRecord) and record == tracker.trial_record(record.run_id)
    assert (record.trial_id, record.label, record.state, record.status) == (
        "11830_00003",
        "trial-00003",
        "FINISHED",
        TrialStatus.OK,
    )
    assert record.params == {"batch_size": "8", "learning_rate": "0.01"}
    assert record.tags[Tag.STATUS] == "ok" and record.tags[Tag.TRIAL_ID] == "11830_00003"  # by full name
    assert record.metrics["mean_val_loss"] == pytest.approx(0.5)  # the last epoch's
    # Scored at the best epoch of the mean curve: epoch 2 (mean 0.4).
    assert record.metrics["best_epoch"] == 2 and record.metrics["selected_mean_val_loss"] == pytest.approx(0.4)
    [history] = tracker.metric_histories([record.run_id], "mean_val_loss").values()
    assert sorted(history) == [(1, pytest.approx(0.8)), (2, pytest.approx(0.4)), (3, pytest.approx(0.5))]
    rows = tracker.epoch_rows(record.run_id)
    assert sorted(rows) == [1, 2, 3] and rows[2]["split1_val_loss"] == pytest.approx(0.3)
    assert "selected_mean_val_loss" not in rows[2]
    recorded = tracker.recorded_trial_run(record.run_id)
    assert recorded.config == {"learning_rate": 0.01, "batch_size": 8} and recorded.parent_run_id == parent
    assert recorded.spec_text == SPEC_TEXT and recorded.manifest == MANIFEST and recorded.plan is None
    assert recorded.sweep_params["cv.n_splits"] == "2"


def test_a_trial_whose_end_was_cut_short_has_not_ended(tracker):
    """A driver killed (kill -9) while it wrote a trial's end, after its status and before its run's
    end: the trial reads as not ended, as a resume counts it and trains it on."""
    parent = start(tracker)
    recorder = trial(tracker, parent, "11830_00001")
    recorder.log_epoch(epoch(1, (0.9, 0.7)))
    tracker._client.set_tag(recorder.run_id, Tag.STATUS, TrialStatus.OK.value)

    [record] = tracker.trial_records(parent)
    assert (record.state, record.status, record.ended_at) == ("RUNNING", TrialStatus.RUNNING, None)
    recorder.finish(TrialStatus.OK)
    [record] = tracker.trial_records(parent)
    assert (record.state, record.status) == ("FINISHED", TrialStatus.OK)


def test_a_resumed_trial_reopens_its_run_and_records_each_epoch_once(tracker):
    parent = start(tracker)
    recorder = trial(tracker, parent, "11830_00000")
    recorder.log_epoch(epoch(1, (0.9, 0.7)))
    recorder.log_epoch(epoch(2, (0.5, 0.3)))
    recorder.finish(TrialStatus.KILLED)
    reopened = trial(tracker, parent, "11830_00000")
    assert reopened.run_id == recorder.run_id and reopened.recorded_epochs == frozenset({1, 2})
    assert tracker.trial_record(recorder.run_id).status is TrialStatus.RUNNING
    # Restored from the checkpoint of epoch 1: epoch 2 trains again and stays recorded once.
    reopened.log_epoch(epoch(2, (0.55, 0.35)))
    reopened.log_epoch(epoch(3, (0.4, 0.2)))
    reopened.finish(TrialStatus.OK)
    [history] = tracker.metric_histories([recorder.run_id], "mean_val_loss").values()
    assert sorted(history) == [(1, pytest.approx(0.8)), (2, pytest.approx(0.4)), (3, pytest.approx(0.3))]
    assert len(tracker.trial_records(parent)) == 1


def test_a_sweep_resumes_only_when_unfinished_and_counts_its_resumes(tracker):
    parent = start(tracker)
    trial(tracker, parent, "11830_00000")  # left running by a killed driver
    tracker.close_open_trial_runs(parent, status=TrialStatus.KILLED)
    assert [record.status for record in tracker.trial_records(parent)] == [TrialStatus.KILLED]
    tracker.end_sweep(parent, status=SweepStatus.INTERRUPTED, summary={"best_mean_val_loss": math.nan})
    resumable = tracker.resumable_sweep("tiny")
    assert resumable.run_id == parent and "best_mean_val_loss" not in resumable.metrics  # NaN is not logged
    assert tracker.reopen_sweep(resumable, f"/moved/tiny-{parent[:8]}") == (parent, f"/moved/tiny-{parent[:8]}")
    assert tracker.find_sweep("tiny").tags[Tag.RESUMES] == "1"
    assert tracker.find_sweep("tiny").tags[Tag.RAY_PATH] == f"/moved/tiny-{parent[:8]}"  # where the next resume looks
    assert tracker.find_sweep("tiny").tags[Tag.STATUS] == SweepStatus.RUNNING.value
    tracker.end_sweep(parent, status=SweepStatus.OK, summary={"best_mean_val_loss": 0.4, Tag.BEST_RUN_ID: "abc"})
    finished = tracker.find_sweep("tiny")
    assert finished.metrics == {"best_mean_val_loss": 0.4} and finished.tags[Tag.BEST_RUN_ID] == "abc"
    with pytest.raises(TrackingError, match="--resume: the latest sweep 'tiny' .* finished; nothing to resume"):
        tracker.resumable_sweep("tiny")


class CountedWrites:
    """The store's client, its writes counted by method (a request each on a tracking server)."""

    WRITES = ("log_batch", "log_metric", "log_param", "set_tag", "log_inputs")

    def __init__(self, client):
        self.client = client
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        if name in self.WRITES:
            self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(self.client, name)


def test_each_group_of_values_written_together_is_one_batch(tracker):
    """Each group of values recorded at once (an epoch, a trial's end, a retry, a run's tags, a
    sweep's start and end) is one write, as a tracking server counts requests."""
    counted = tracker._client = CountedWrites(tracker._client)
    parent = start(tracker)
    recorder = trial(tracker, parent, "11830_00000", selection=EpochSelection(Objective(metric="loss", mode="min")))
    recorder.log_epoch(epoch(1, (0.9, 0.7)))
    recorder.count_retry(1)
    recorder.set_tags({Tag.RERUN_DIFFERS: "x", Tag.of("device_notice"): "y"})
    recorder.finish(TrialStatus.OK, error="", tags={Tag.of("stopped"): "no"})
    tracker.tag_runs(
        {recorder.run_id: {Tag.PVALUE_VS_BEST: "0.5", DESCRIPTION_TAG: "d"}, parent: {DESCRIPTION_TAG: "p"}}
    )
    tracker.end_sweep(parent, status=SweepStatus.OK, summary={"best_mean_val_loss": 0.4, Tag.BEST_RUN_ID: "abc"})
    # start, trial params, epoch, retry, tags, finish, two runs' tags, end.
    assert counted.calls == {"log_batch": 9}
    record = tracker.trial_record(recorder.run_id)
    assert record.tags[Tag.RERUN_DIFFERS] == "x" and record.tags[Tag.PVALUE_VS_BEST] == "0.5"
    assert record.metrics["retries"] == 1 and record.metrics["best_epoch"] == 1
    sweep = tracker.find_sweep(parent)
    assert sweep.metrics["best_mean_val_loss"] == 0.4 and sweep.tags[Tag.BEST_RUN_ID] == "abc"
    assert sweep.tags[DESCRIPTION_TAG] == "p" and sweep.tags[Tag.STATUS] == "ok"


def test_a_trial_is_found_by_its_run_id_the_start_of_it_or_its_ray_trial_id(tracker):
    parent = start(tracker)
    runs = [trial(tracker, parent, f"11830_0000{k}").run_id for k in range(2)]
    assert tracker.trial_run_id(runs[0]) == runs[0]
    assert tracker.trial_run_id(runs[1][:12]) == runs[1]
    assert tracker.trial_run_id("11830_00001") == runs[1]
    with pytest.raises(TrackingError, match="RUN_ID: no trial run with id 'nothing'"):
        tracker.trial_run_id("nothing")
    with pytest.raises(TrackingError, match="RUN_ID: run .* is not a foldsweep trial"):
        tracker.recorded_trial_run(parent)


def test_a_trials_error_status_tags_and_comparisons_are_recorded(tracker):
    parent = start(tracker)
    recorder = trial(tracker, parent, "11830_00000")
    recorder.count_retry(2)
    recorder.set_tags({Tag.of("device_notice"): "x" * 6000})
    recorder.finish(TrialStatus.ERROR, error="Traceback ...\nValueError: bad config")
    tracker.tag_runs({recorder.run_id: {Tag.PVALUE_VS_BEST: "0.01235", DESCRIPTION_TAG: "**best**"}})
    record = tracker.trial_record(recorder.run_id)
    assert (record.status, record.state) == (TrialStatus.ERROR, "FAILED")
    assert record.error == "Traceback ...\nValueError: bad config"
    assert record.tags[Tag.RETRIES] == "2" and record.metrics["retries"] == 2.0
    assert record.tags[Tag.of("device_notice")] == "x" * 5000  # MLflow's tag limit
    assert record.tags[Tag.PVALUE_VS_BEST] == "0.01235"
    assert record.tags[DESCRIPTION_TAG] == "**best**" and record.tags[Tag.PARENT] == parent


def test_history_csv_is_one_row_per_epoch_with_every_key():
    text = _history_csv({2: {"b": 0.5}, 1: {"a": 1.0, "b": 2.0}})
    assert text.splitlines() == ["epoch,a,b", "1,1.0,2.0", "2,,0.5"]


def test_a_finished_trial_keeps_its_history_and_config_as_artifacts(tracker, tmp_path):
    parent = start(tracker)
    recorder = trial(tracker, parent, "11830_00000")
    recorder.log_epoch(epoch(1, (0.9, 0.7)))
    recorder.finish(TrialStatus.OK)
    artifacts = {path.name for path in (tmp_path / "mlartifacts").rglob("*") if path.is_file()}
    assert {HISTORY_ARTIFACT, TRIAL_CONFIG_ARTIFACT, "spec.yaml", "fold_manifest.json"} <= artifacts


def test_a_names_sweeps_read_back_newest_first_with_when_their_trials_ran(tracker):
    older, newer = start(tracker), start(tracker)
    start(tracker, "other")
    assert [sweep.run_id for sweep in tracker.sweep_records("tiny")] == [newer, older]
    assert tracker.sweep_records("none") == []
    recorder = trial(tracker, newer, "11830_00000")
    recorder.finish(TrialStatus.OK)
    [record] = tracker.trial_records(newer)
    assert record.started_at is not None and record.ended_at is not None
    assert 0 <= record.ended_at - record.started_at < 60


def test_a_trials_reruns_read_back_newest_first_and_its_artifacts_by_path(tracker, tmp_path):
    parent = start(tracker)
    original = trial(tracker, parent, "11830_00000")
    original.log_epoch(epoch(1, (0.9, 0.7)))
    original.finish(TrialStatus.OK)
    reruns = [
        tracker.trial_recorder(
            parent_run_id=parent,
            run_name="rerun",
            role="rerun",
            config={"learning_rate": 0.01},
            tags={Tag.RERUN_OF: original.run_id},
        )
        for _ in range(2)
    ]
    assert [rerun.run_id for rerun in tracker.reruns(original.run_id)] == [rerun.run_id for rerun in reversed(reruns)]
    assert tracker.reruns(reruns[0].run_id) == []
    assert {HISTORY_ARTIFACT, TRIAL_CONFIG_ARTIFACT} <= set(tracker.artifact_paths(original.run_id))
    assert tracker.artifact_paths(original.run_id, "none") == []
    history = tracker.artifact_file(original.run_id, HISTORY_ARTIFACT, tmp_path)
    assert history.parent == tmp_path and history.read_text().startswith("epoch,")


def store_contents(database: Path) -> tuple[list, dict[str, list]]:
    """A store's schema and rows. Each statement of the schema as its set of lines: MLflow's
    migrations write a table's constraints in an order that differs from one store to the next."""
    with contextlib.closing(sqlite3.connect(database)) as connection:
        schema = sorted(
            (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
            for kind, name, sql in connection.execute("SELECT type, name, sql FROM sqlite_master")
        )
        rows = {
            name: sorted(connection.execute(f'SELECT * FROM "{name}"')) for kind, name, _ in schema if kind == "table"
        }
    return schema, rows


def test_a_new_store_is_a_copy_of_the_empty_one_mlflow_made_and_holds_what_mlflow_makes(tmp_path, monkeypatch):
    """A store MLflow's migrations made and one copied from the empty store (made by MLflow in
    foldsweep's cache on first use) differ only in their experiments' times; new stores after
    the first run no migration, and the copy's default experiment is made as it opens."""
    import mlflow.store.db.utils as db_utils
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    migrations: list[object] = []
    initialize = db_utils._initialize_tables
    monkeypatch.setattr(db_utils, "_initialize_tables", lambda engine: migrations.append(engine) or initialize(engine))
    migrated, copied, later = (tmp_path / name for name in ("migrated.db", "copied.db", "later.db"))
    MlflowClient(tracking_uri=f"sqlite:///{migrated}").search_experiments(max_results=1)
    assert len(migrations) == 1
    before = time.time() * 1000
    for database in (migrated, copied):
        Tracker(f"sqlite:///{database}").experiment_id("sweep")
    assert len(migrations) == 2  # the empty store, made in the cache
    Tracker(f"sqlite:///{later}").experiment_id("sweep")
    assert len(migrations) == 2

    (empty,) = (tmp_path / "cache" / "foldsweep" / "empty-stores").iterdir()
    assert store_contents(empty)[1]["experiments"] == []
    schema, rows = store_contents(migrated)
    copied_schema, copied_rows = store_contents(copied)
    assert copied_schema == schema
    assert {name: table for name, table in copied_rows.items() if name != "experiments"} == {
        name: table for name, table in rows.items() if name != "experiments"
    }

    def untimed(experiments: list[tuple]) -> list[tuple]:  # id, name, artifact location, stage, workspace
        return [experiment[:4] + experiment[6:] for experiment in experiments]

    assert untimed(copied_rows["experiments"]) == untimed(rows["experiments"])
    assert [experiment[0] for experiment in copied_rows["experiments"]] == [0, 1]
    default = copied_rows["experiments"][0]
    assert default[4] >= before  # made as the copy opened, not when the empty store was


@pytest.mark.e2e  # a process of its own: what make install runs
def test_make_install_makes_the_empty_store_so_the_first_new_store_runs_no_migration(tmp_path, monkeypatch):
    """`make install` runs ``python -m pipeline.records.tracking`` once the environment is synced:
    the empty store is in foldsweep's cache before any sweep, and the first new store copies it."""
    import subprocess
    import sys

    import mlflow.store.db.utils as db_utils

    recipe = (REPO / "Makefile").read_text().split("$(STAMP): ")[1].split("\n\n")[0]
    assert "$(BIN)/python -m pipeline.records.tracking" in recipe
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    subprocess.run([sys.executable, "-m", "pipeline.records.tracking"], check=True, cwd=tmp_path, timeout=120)
    (empty,) = (cache / "foldsweep" / "empty-stores").iterdir()
    assert store_contents(empty)[1]["experiments"] == []
    migrations: list[object] = []
    initialize = db_utils._initialize_tables
    monkeypatch.setattr(db_utils, "_initialize_tables", lambda engine: migrations.append(engine) or initialize(engine))
    Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}").experiment_id("first")
    assert migrations == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache", "mlflow.db"]


def test_an_existing_store_is_never_replaced_by_the_empty_one(tmp_path, monkeypatch):
    database = seed_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    Tracker(f"sqlite:///{database}").experiment_id("kept")
    before = database.read_bytes()
    Tracker(f"sqlite:///{database}")
    assert database.read_bytes() == before
    assert not (tmp_path / "cache").exists()  # no empty store was even made


def test_a_moved_sweeps_ray_state_is_found_beside_its_store(tmp_path):
    """A project moved (or an archive unpacked elsewhere) after its sweep was interrupted keeps Ray
    Tune's state beside its store, under the name the sweep recorded elsewhere."""
    from types import SimpleNamespace

    from pipeline.base.errors import InputError
    from pipeline.sweep import RAY_RESULTS_DIR, _resumed_ray_path

    moved = tmp_path / "now" / RAY_RESULTS_DIR / "tiny-0123abcd"
    moved.mkdir(parents=True)
    resumable = SimpleNamespace(tags={Tag.RAY_PATH: str(tmp_path / "then" / RAY_RESULTS_DIR / "tiny-0123abcd")})
    uri = f"sqlite:///{tmp_path / 'now' / 'mlflow.db'}"
    with pytest.raises(InputError, match="--resume: Ray Tune has no saved state to resume at"):
        _resumed_ray_path(resumable, uri)
    (moved / "tuner.pkl").write_bytes(b"")  # what Ray Tune's can_restore looks for
    assert _resumed_ray_path(resumable, uri) == str(moved)


def test_a_store_moved_away_from_its_artifacts_says_so_and_writes_nothing_there(tmp_path, tracker):
    """MLflow records a run's artifact folder absolute: a store moved without it cannot read the
    trials' records, which a rerun and report say, and report writes nothing at the old place."""
    import shutil

    from pipeline.records.publish import report_sweep

    parent = start(tracker)
    recorder = trial(tracker, parent, "11830_00000")
    assert tracker.missing_artifacts(parent) is None
    shutil.move(tmp_path / "mlartifacts", tmp_path / "elsewhere")
    assert "which does not exist" in (tracker.missing_artifacts(parent) or "")
    with pytest.raises(TrackingError, match="RUN_ID: cannot read trial_config.json .* recorded at .* does not exist"):
        tracker.recorded_trial_run(recorder.run_id)
    with pytest.raises(TrackingError, match="SWEEP: the artifacts of run .* does not exist"):
        report_sweep(tracker.uri, "tiny")
    assert not (tmp_path / "mlartifacts").exists()
