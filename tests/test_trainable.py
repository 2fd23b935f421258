"""A trial restored after its driver was killed between Ray Tune's checkpoint rotation and its
experiment-state save (pipeline.engine.trainable.surviving_checkpoint), or after its last epoch but
before Ray Tune saved it as ended: pure file logic on real Ray checkpoints and checkpoint files."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from ray import tune

from pipeline.engine.lifespan import WorkerState
from pipeline.engine.trainable import CHECKPOINT_FILE, LAST_REPORT_FILE, FoldTrainable, surviving_checkpoint


def checkpoint_dir(trial_dir: Path, index: int, epoch: int) -> Path:
    directory = trial_dir / f"checkpoint_{index:06d}"
    directory.mkdir(parents=True)
    np.savez(directory / CHECKPOINT_FILE, epoch=np.array(epoch))
    return directory


def saved(path: Path, iteration: int) -> SimpleNamespace:
    """What Ray Tune hands ``restore``: the checkpoint its state names, with that result's metrics."""
    return SimpleNamespace(
        checkpoint=tune.Checkpoint.from_directory(str(path)),
        metrics={"training_iteration": iteration, "time_total_s": 3.0},
    )


def test_the_named_checkpoint_is_used_while_it_exists(tmp_path):
    named = saved(checkpoint_dir(tmp_path, 10, epoch=10), 10)
    checkpoint_dir(tmp_path, 11, epoch=11)
    assert surviving_checkpoint(named) is named


def test_a_checkpoint_deleted_by_rotation_gives_way_to_the_one_that_replaced_it(tmp_path):
    deleted = tmp_path / "checkpoint_000010"  # rotated away before the state was saved
    checkpoint_dir(tmp_path, 11, epoch=11)
    named = saved(deleted, 10)

    restored = surviving_checkpoint(named)

    assert Path(restored.checkpoint.path).name == "checkpoint_000011"
    assert restored.metrics == {"training_iteration": 11, "time_total_s": 3.0}
    assert Path(named.checkpoint.path).name == "checkpoint_000010"  # what Ray holds is left as it was
    assert deleted.is_dir() and not any(deleted.iterdir())  # for Ray Tune to delete at its next rotation


def test_without_any_checkpoint_left_ray_tune_reports_the_missing_one(tmp_path):
    named = saved(tmp_path / "checkpoint_000010", 10)
    assert surviving_checkpoint(named) is named


def test_the_trainable_restores_through_it(tmp_path, monkeypatch):
    received = []
    monkeypatch.setattr(tune.Trainable, "restore", lambda self, checkpoint_path: received.append(checkpoint_path))
    checkpoint_dir(tmp_path, 7, epoch=7)

    FoldTrainable.restore(object.__new__(FoldTrainable), saved(tmp_path / "checkpoint_000006", 6))

    assert Path(received[0].checkpoint.path).name == "checkpoint_000007"


def test_a_stand_in_left_by_an_earlier_restore_is_passed_over_too(tmp_path):
    stand_in = tmp_path / "checkpoint_000004"
    stand_in.mkdir()  # empty, as surviving_checkpoint leaves a deleted one
    checkpoint_dir(tmp_path, 5, epoch=5)
    assert Path(surviving_checkpoint(saved(stand_in, 4)).checkpoint.path).name == "checkpoint_000005"


class EpochsOf:
    """A trial's runner as far as the trainable sees it: one report per step, its state as arrays."""

    def __init__(self, planned: int, first: int = 1):
        self.planned, self.epoch = planned, first - 1

    def step(self):
        self.epoch += 1
        return {
            "epoch": self.epoch,
            "epochs_planned": self.planned,
            "done": self.epoch >= self.planned,
            "mean_val_loss": np.float32(1.0 / self.epoch),
        }

    def state(self):
        return {"epoch": np.array(self.epoch)}

    def load_state(self, arrays):
        self.epoch = int(arrays["epoch"])


def trainable_with(runner: EpochsOf) -> FoldTrainable:
    trainable = object.__new__(FoldTrainable)
    trainable._lifespan = SimpleNamespace(observe=lambda: WorkerState(0, 0.0), trials=1, retire_reason=lambda state: "")
    trainable._runner, trainable._last_report, trainable._ended_report = runner, None, None
    return trainable


@pytest.mark.parametrize("planned, resumed_epochs", [(2, [2]), (3, [3])], ids=["last epoch", "one epoch before"])
def test_a_trial_restored_from_a_checkpoint_trains_on_to_its_planned_epochs_and_no_further(
    tmp_path, planned, resumed_epochs
):
    """Saved after epoch 2: a trial of 2 epochs ends with epoch 2's report again (Ray Tune asks a
    restored trial for one more step), a trial of 3 trains epoch 3."""
    before = trainable_with(EpochsOf(planned))
    before.step()
    before.step()
    before.save_checkpoint(str(tmp_path))

    after = trainable_with(EpochsOf(planned, first=100))  # an epoch from here would be numbered 100+
    after.load_checkpoint(str(tmp_path))
    report = after.step()

    assert [report["epoch"]] == resumed_epochs and report["done"]
    assert report["mean_val_loss"] == pytest.approx(1.0 / resumed_epochs[0])
    assert after._runner.epoch == 2 + (planned - 2)  # loaded epoch 2; stepped only when epochs were left


def test_a_checkpoint_written_before_reports_were_kept_trains_on(tmp_path):
    before = trainable_with(EpochsOf(2))
    before.step()
    before.step()
    before.save_checkpoint(str(tmp_path))
    (tmp_path / LAST_REPORT_FILE).unlink()

    after = trainable_with(EpochsOf(2))
    after.load_checkpoint(str(tmp_path))
    assert after.step()["epoch"] == 3  # what foldsweep did before: it cannot tell the trial had ended
