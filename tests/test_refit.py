"""The refit's decisions: when it starts beside the sweep's last trials (``EarlyRefit``, on
stand-in trials and refits; the refit itself is the real one in the recorded sweep,
``test_record_e2e``), and the plots' matplotlib loaded there too (``PlottingLoadedEarly``)."""

from __future__ import annotations

import pickle
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.records.callbacks import PlottingLoadedEarly
from pipeline.refit import EarlyRefit, RefitResult, RefitStopped, RefitTarget


def target(trial_id: str) -> RefitTarget:
    return RefitTarget(trial_id, f"run-{trial_id}", f"trial-{trial_id}", {"lr": trial_id}, epochs=3)


class Refits:
    """Stand-in refits: each trains until released (or stopped) and saves its model."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.prepared: list[RefitTarget] = []
        self.started: list[tuple[str, int]] = []
        self.fail = False

    def prepare(self, wanted: RefitTarget) -> SimpleNamespace:
        self.prepared.append(wanted)

        def train(directory: Path, *, stop: threading.Event) -> RefitResult:
            while not self.release.wait(0.01):
                if stop.is_set():
                    raise RefitStopped
            if self.fail:
                raise MemoryError("out of memory beside the trials")
            path = directory / "refit_model.keras"
            path.write_text(wanted.trial_id)
            return RefitResult(test_loss=0.5, test_accuracy=0.9, epochs=wanted.epochs, model_path=path)

        return SimpleNamespace(train=train)


def trials(*statuses: str) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(trial_id=f"t{i}", config={"lr": f"t{i}"}, status=status) for i, status in enumerate(statuses)
    ]


@pytest.fixture
def refits() -> Refits:
    return Refits()


def early_refit(refits: Refits, best: list[str], *, slots: int = 2, n_trials: int = 4) -> EarlyRefit:
    """An EarlyRefit whose best trial so far is ``best[-1]`` (a list the test changes)."""
    return EarlyRefit(
        slots=slots,
        n_trials=n_trials,
        best=lambda configs: target(best[-1]) if best else None,
        prepare=refits.prepare,
        on_start=lambda wanted, running: refits.started.append((wanted.trial_id, running)),
    )


def end_trial(early: EarlyRefit, now: list[SimpleNamespace]) -> None:
    early.on_trial_complete(0, now, now[0])
    early.on_step_end(0, now)


def test_it_starts_once_no_trial_is_left_to_start_and_a_slot_is_free(refits):
    early = early_refit(refits, ["t0"])
    end_trial(early, trials("TERMINATED", "RUNNING", "PENDING"))  # one trial not created yet
    end_trial(early, trials("TERMINATED", "RUNNING", "RUNNING", "PENDING"))
    assert refits.started == []
    end_trial(early, trials("TERMINATED", "TERMINATED", "RUNNING", "RUNNING"))  # both slots busy
    early.on_step_end(0, trials("TERMINATED", "TERMINATED", "RUNNING", "RUNNING"))
    assert refits.started == []
    end_trial(early, trials("TERMINATED", "TERMINATED", "TERMINATED", "RUNNING"))
    assert refits.started == [("t0", 1)]  # beside the one trial still running
    refits.release.set()
    result, delete = early.result_for(target("t0"))
    assert result is not None and result.model_path.read_text() == "t0"
    delete()
    assert not result.model_path.exists()


def test_a_trial_that_takes_the_lead_stops_the_refit_and_has_its_own(refits):
    best = ["t0"]
    early = early_refit(refits, best)
    end_trial(early, trials("TERMINATED", "TERMINATED", "TERMINATED", "RUNNING"))
    assert refits.started == [("t0", 1)]
    best.append("t2")
    end_trial(early, trials("TERMINATED", "TERMINATED", "TERMINATED", "TERMINATED"))
    # The refit of t0 stops after its epoch; t2's starts once it has.
    while len(refits.started) < 2:
        early.on_step_end(0, trials("TERMINATED", "TERMINATED", "TERMINATED", "TERMINATED"))
    assert refits.started == [("t0", 1), ("t2", 0)]
    refits.release.set()
    result, delete = early.result_for(target("t2"))
    assert result is not None and result.model_path.read_text() == "t2"
    delete()


def test_a_resumed_sweep_starts_the_refit_beside_the_trials_it_reruns(refits):
    """Its other trials ended before it was interrupted: no trial ends in this run before the
    last one, and the refit need not wait for it."""
    early = early_refit(refits, ["t0"])
    early.on_step_end(0, trials("TERMINATED", "TERMINATED", "TERMINATED", "RUNNING"))
    assert refits.started == [("t0", 1)]
    refits.release.set()
    result, delete = early.result_for(target("t0"))
    assert result is not None and result.model_path.read_text() == "t0"
    delete()


def test_the_best_at_the_end_is_refit_after_the_trials_unless_its_refit_ran_and_ended_well(refits):
    early = early_refit(refits, ["t0"], slots=1, n_trials=1)
    end_trial(early, trials("TERMINATED"))
    assert refits.started == [("t0", 0)]  # the last trial ended: the refit starts at once
    assert early.result_for(target("t1"))[0] is None  # another best: this refit is stopped

    failing = Refits()
    failing.fail = True
    failing.release.set()
    early = early_refit(failing, ["t0"], slots=1, n_trials=1)
    end_trial(early, trials("TERMINATED"))
    assert early.result_for(target("t0"))[0] is None  # failed beside the trials: refit again after them


def test_no_refit_starts_without_a_best_and_a_stopped_sweep_stops_its_refit(refits):
    best: list[str] = []
    early = early_refit(refits, best)
    end_trial(early, trials("ERROR", "TERMINATED", "TERMINATED", "RUNNING"))
    assert refits.started == []
    best.append("t1")
    end_trial(early, trials("ERROR", "TERMINATED", "TERMINATED", "RUNNING"))
    assert refits.started == [("t1", 1)]
    directory = early._refitting.directory
    early.close()  # Ctrl-C: it stops after its epoch, and nothing it saved stays
    assert not directory.exists()
    assert early.result_for(target("t1"))[0] is None


def test_ray_tunes_copy_of_it_in_the_experiment_state_does_nothing(refits):
    import pickle

    early = early_refit(refits, ["t0"])
    copy = pickle.loads(pickle.dumps(early))
    end_trial(copy, trials("TERMINATED", "TERMINATED", "TERMINATED", "TERMINATED"))
    assert refits.started == []


def test_the_plots_matplotlib_loads_in_the_driver_once_no_trial_is_left_to_start_and_a_slot_is_free():
    loading = PlottingLoadedEarly(slots=2, n_trials=4)
    for now in (
        trials("TERMINATED", "RUNNING", "PENDING"),  # one trial not created yet
        trials("TERMINATED", "RUNNING", "RUNNING", "PENDING"),
        trials("TERMINATED", "TERMINATED", "RUNNING", "RUNNING"),  # both slots busy
    ):
        loading.on_step_end(0, now)
        assert loading._loading is None
    loading.on_step_end(0, trials("TERMINATED", "TERMINATED", "TERMINATED", "RUNNING"))
    started = loading._loading
    assert started is not None and started.name == "matplotlib-import"
    started.join()
    import matplotlib

    assert "matplotlib.pyplot" in sys.modules
    assert matplotlib.get_backend().lower() == "agg"  # what the plots draw with: files, no display
    loading.on_step_end(0, trials("TERMINATED", "TERMINATED", "TERMINATED", "TERMINATED"))
    assert loading._loading is started  # once per sweep


def test_plotting_loaded_early_pickled_with_the_experiment_state_does_nothing():
    """Ray Tune pickles callbacks with its experiment state; a resumed sweep makes its own."""
    restored = pickle.loads(pickle.dumps(PlottingLoadedEarly(slots=2, n_trials=1)))
    restored.on_step_end(0, trials("TERMINATED"))
    assert getattr(restored, "_loading", None) is None


@pytest.mark.training
def test_a_refit_model_that_cannot_be_saved_logged_or_registered_leaves_the_refit_and_says_why(tmp_path, write_spec):
    """The refit's scores stand (its summary keeps them) and the parent run's tags say what failed."""
    from dataclasses import replace

    import keras
    import numpy as np
    from helpers import seed_store

    from pipeline.inputs.spec import load_spec
    from pipeline.records.model_package import write_model_package
    from pipeline.records.provenance import Provenance
    from pipeline.records.tracking import Tag, Tracker
    from pipeline.sweep import _log_refit_model

    tracker = Tracker(f"sqlite:///{seed_store(tmp_path / 'mlflow.db')}")
    parent, _ = tracker.start_sweep(name="s", spec_text="", manifest={}, params={}, ray_path_for=str)
    target = RefitTarget("t_00000", "run", "trial-00000", {"learning_rate": 0.01}, 2)
    spec = load_spec(write_spec({}))
    provenance = Provenance({}, ())

    def logged(result: RefitResult, tracking=spec.tracking):
        prepared = SimpleNamespace(spec=replace(spec, tracking=tracking), space=SimpleNamespace(conditions={}))
        return _log_refit_model(prepared, tracker, parent, target, result, provenance)

    scores = {"test_loss": 0.5, "test_accuracy": 0.8, "epochs": 2, "model_path": tmp_path / "refit_model.keras"}
    unsaved = RefitResult(**scores, package_error="OSError: disk full")
    assert logged(unsaved) == (
        {Tag.REFIT_MODEL: "error: OSError: disk full"},
        "saving the refit as an MLflow model: OSError: disk full",
    )
    tags, problem = logged(RefitResult(**scores, package_path=tmp_path / "no-such-package"))
    assert tags[Tag.REFIT_MODEL].startswith("error: ") and problem.startswith("logging the refit's model: ")

    model = keras.Sequential([keras.Input((4, 1)), keras.layers.Flatten(), keras.layers.Dense(2)])
    experiment = tmp_path / "experiment.py"
    experiment.write_text("def build(hp):\n    pass\n")
    package = write_model_package(
        model, tmp_path / "package", x_train=np.zeros((3, 4, 1), "float32"), experiment_path=experiment
    )
    refused = replace(spec.tracking, register_model="lab:cnn")  # a name MLflow refuses (the spec refuses it first)
    tags, problem = logged(RefitResult(**scores, package_path=package), tracking=refused)
    assert tags[Tag.REFIT_MODEL].startswith("models:/") and tags[Tag.REGISTERED_MODEL].startswith("error: ")
    assert problem.startswith("registering the refit's model as lab:cnn: ")
