"""A trial's results as types, and the one place that flattens them.

A trial produces, per epoch, an ``EpochResult`` (each fold's scores, throughput, where a fold went
NaN) and, once per process it runs in, a ``TrialInfo`` (its ``TrialPlan``, where it ran, the
model). ``EpochResult.report`` gives the flat dict Ray Tune needs, in scikit-learn's vocabulary
(``split{k}_val_loss``, ``mean_val_accuracy``...); ``EpochResult.from_report`` reads it back on
the driver, and ``mlflow_metrics`` / ``mlflow_tags`` say what MLflow records of it. Every key
a trial reports is either recorded or declared here as bookkeeping (``BOOKKEEPING_KEYS``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, Literal

import numpy as np

from pipeline.contract.account import OTHER_S, TimeAccount
from pipeline.contract.plan import TrialPlan
from pipeline.inputs.scoring import OWN_SCORES, Direction, Scorer
from pipeline.inputs.spec import Objective

# Keys of a trial's report (ray.tune.result holds the ones Ray adds itself).
EPOCH = "epoch"
EPOCHS_PLANNED = "epochs_planned"
DONE = "done"
FOLD_IDS = "fold_ids"
NAN_FAILURES = "nan_failures"
N_PARAMS = "n_params"
MODEL_SUMMARY = "model_summary"
TRIAL_PLAN = "trial_plan"
PLAN_ARTIFACT = "trial_plan.json"
TRAIN_RATE = "train_samples_per_s"
EVAL_RATE = "eval_samples_per_s"
COMPILE_S = "compile_s"
# Of the XLA programs a trial ran, how many came from the compile cache and how many it compiled.
COMPILE_CACHE_HITS = "compile_cache_hits"
COMPILE_CACHE_MISSES = "compile_cache_misses"
# Which way each other validation metric improves ({name: "max" | "min" | ""}): a report's
# bookkeeping, from which the driver counts a NaN fold as that metric's worst score.
SCORE_DIRECTIONS = "score_directions"
NAN_FOLD, NAN_EPOCH, NAN_STEP = "nan_fold", "nan_epoch", "nan_step"
NAN_FIELDS = (NAN_FOLD, NAN_EPOCH, NAN_STEP, "nan_last_finite_loss", "nan_grad_norm")
# The library versions a trial reports once per process (with where and how it ran: TrialInfo),
# recorded as tags.
VERSION_FIELDS = ("tensorflow_version", "keras_version", "ray_version", "python_version")
# The optimizer and learning rate in effect (the hypermodel's own, or foldsweep's): recorded as
# params where the trial's config does not already hold them.
PARAMS_IN_EFFECT = "params_in_effect"
# A worker process's life (pipeline.engine.lifespan): which trial of its process this is (a tag), its
# memory mappings and resident memory after each epoch (metrics), and why it retires after this
# trial ("" when it does not; a tag foldsweep.worker_retires when it does).
WORKER_TRIALS = "worker_trials"
WORKER_MAPS = "worker_maps"
WORKER_RSS = "worker_rss_mb"
WORKER_RETIRES = "worker_retires"
# What says where the trial ran in every result (Ray Tune adds pid, node_ip and hostname): tags too.
WORKER_PID = "pid"
RAY_PLACEMENT_FIELDS = (WORKER_PID, "node_ip", "hostname", WORKER_TRIALS)
# The epoch a trial's own early stopping ended it at (train.early_stopping): recorded once.
STOPPED_EPOCH = "stopped_epoch"
# What a searcher learns from each epoch with train.select best_epoch: the best of the trial's
# mean CV curve so far, which at its end is the score the leaderboard ranks it by.
RUNNING_BEST_PREFIX = "running_best_"


def trial_label(trial_id: str) -> str:
    """``trial-00003``: a trial's number in its sweep, from Ray Tune's trial id (``11830_00003``);
    what the trial lines, the progress view and the leaderboard call it."""
    return f"trial-{trial_id.rsplit('_', 1)[-1]}"


# Keys that steer Ray Tune or that it adds for itself; not findings, so never recorded.
BOOKKEEPING_KEYS = frozenset(
    {
        *(f"{RUNNING_BEST_PREFIX}mean_val_{metric}" for metric in OWN_SCORES),
        SCORE_DIRECTIONS,
        DONE,
        EPOCH,
        EPOCHS_PLANNED,
        FOLD_IDS,
        "trial_id",
        "training_iteration",
        "time_this_iter_s",
        "time_total_s",
        "timestamp",
        "date",
        "time_since_restore",
        "iterations_since_restore",
        "experiment_tag",
        "config",
        "checkpoint_dir_name",
        "should_checkpoint",
        "timesteps_total",
        "episodes_total",
        "timesteps_since_restore",
        "warmup_time",
    }
)
# Recorded once a trial ends (not per epoch): from its start in its process to its last report.
TRIAL_WALL_S = "trial_wall_s"
RETRIES = "retries"
# A trial is scored at one epoch of its mean CV curve (train.select), recorded once it ends: the
# epoch as ``best_epoch``, and every CV score of that epoch again under ``selected_``.
BEST_EPOCH = "best_epoch"
SELECTED_PREFIX = "selected_"
# Where a trial's wall clock went (``TimeAccount``), each a whole-trial total recorded once it
# ends: start-up until its first training launch (the worker's TensorFlow and data for a process's
# first trial, the fold models for every trial), compiling (``compile_s``, the throughput's own),
# training launches and validation without their compiling, and the pauses between one epoch's
# validation and the next epoch's training (reporting, checkpoints, bookkeeping); ``other_s`` is
# the rest. ``epoch_gap_s`` is each epoch's pause before it trained, recorded per epoch.
SETUP_S = "setup_s"
TRAIN_S = "train_s"
EVAL_S = "eval_s"
GAP_S = "gap_s"
EPOCH_GAP_S = "epoch_gap_s"
TRIAL_PARTS = (SETUP_S, COMPILE_S, TRAIN_S, EVAL_S, GAP_S)
# Where a sweep's wall clock went, recorded on its parent run when it ends (``sweep_account``): from
# the command's start (``sweep_wall_s``) until the first trial's first training step, while at least
# one trial trains, while none does between trials, the refit (what it adds after the last trial),
# and the end (recording, the tables); ``sweep_fixed_s`` is the cost outside training and the
# refit: start, idle and end.
SWEEP_WALL_S = "sweep_wall_s"
SWEEP_STARTUP_S = "sweep_startup_s"
SWEEP_IDLE_S = "sweep_idle_s"
SWEEP_FINISH_S = "sweep_finish_s"
SWEEP_PARTS = (SWEEP_STARTUP_S, "sweep_training_s", SWEEP_IDLE_S, "sweep_refit_s", SWEEP_FINISH_S)
SWEEP_FIXED_S = "sweep_fixed_s"
# What a trial's report says of its account (``compile_s`` is reported as its throughput).
ACCOUNT_KEYS = (TRIAL_WALL_S, SETUP_S, TRAIN_S, EVAL_S, GAP_S, OTHER_S)


def sweep_fixed_s(account: TimeAccount) -> float:
    """The sweep's time outside its trials' training and the refit."""
    seconds = account.as_dict()
    return seconds[SWEEP_STARTUP_S] + seconds[SWEEP_IDLE_S] + seconds[SWEEP_FINISH_S]


def recorded_sweep_account(values: Mapping[str, Any]) -> TimeAccount | None:
    """The sweep account a parent run recorded; None for a sweep from before it was kept."""
    return TimeAccount.read(values, wall=SWEEP_WALL_S, parts=SWEEP_PARTS)


def trial_account(values: Mapping[str, Any]) -> TimeAccount | None:
    """A trial's time account from its report or its record's metrics; None for a trial recorded
    before accounts were kept (which has ``trial_wall_s`` and ``compile_s``, but no ``setup_s``)."""
    return TimeAccount.read(values, wall=TRIAL_WALL_S, parts=TRIAL_PARTS) if SETUP_S in values else None


# Metrics recorded once per trial, or a count rather than a finding per epoch: not in history.csv.
NOT_IN_HISTORY = frozenset(
    {N_PARAMS, RETRIES, NAN_FAILURES, WORKER_MAPS, WORKER_RSS, BEST_EPOCH, STOPPED_EPOCH, *ACCOUNT_KEYS}
)


def split_key(fold: int, name: str) -> str:
    return f"split{fold}_{name}"


def is_cv_score(key: str) -> bool:
    """A key ``cv_summary`` makes: ``split{k}_``, ``mean_`` or ``std_`` of a fold score (the
    training loss or a ``val_`` score)."""
    head, _, name = key.partition("_")
    if not (head in ("mean", "std") or (head.startswith("split") and head[5:].isdigit())):
        return False
    return name == "train_loss" or (name.startswith("val_") and len(name) > 4)


def is_bookkeeping(key: str) -> bool:
    """A key that steers Ray Tune or that it adds for itself (the running best of any objective)."""
    return key in BOOKKEEPING_KEYS or key.startswith(RUNNING_BEST_PREFIX)


def worst_scores(directions: Mapping[str, Direction | Literal[""]]) -> dict[str, float]:
    """What a NaN fold counts as for each fold score: ``NAN_FOLD_SCORES`` and, for every other
    metric, its worst by direction (NaN when its direction is unknown)."""
    return {
        **{f"val_{name}": Scorer(name, direction or None).worst for name, direction in directions.items()},
        **NAN_FOLD_SCORES,
    }


def in_history(key: str) -> bool:
    """A metric recorded per epoch (what ``history.csv`` holds)."""
    return key not in NOT_IN_HISTORY and not key.startswith(SELECTED_PREFIX)


@dataclass(frozen=True)
class EpochSelection:
    """Which epoch a trial is scored at: ``best_epoch``, the best of its mean CV curve (one epoch
    for all replicas, never one per fold; the earliest of equal ones), or its ``last``."""

    objective: Objective
    rule: str = "best_epoch"

    def epoch(self, curve: Mapping[int, float]) -> int | None:
        """The chosen epoch of a trial's {epoch: mean CV score}; None without a finite score."""
        finite = {epoch: score for epoch, score in curve.items() if math.isfinite(score)}
        if not finite:
            return None
        if self.rule == "last":
            return max(finite)
        return min(finite, key=lambda epoch: (self.objective.sort_key(finite[epoch]), epoch))

    def selected_metrics(self, rows: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """``best_epoch`` and each CV score of that epoch as ``selected_<key>``, from a trial's
        per-epoch metrics {epoch: {key: value}}; empty when no epoch has a score."""
        curve = {epoch: row[self.objective.key] for epoch, row in rows.items() if self.objective.key in row}
        epoch = self.epoch(curve)
        if epoch is None:
            return {}
        return {
            BEST_EPOCH: float(epoch),
            **{f"{SELECTED_PREFIX}{key}": value for key, value in rows[epoch].items() if is_cv_score(key)},
        }


class TrialStatus(StrEnum):
    """A trial's outcome (tag ``foldsweep.status``) and the MLflow run state it ends in."""

    RUNNING = "running"
    OK = "ok"
    PRUNED = "pruned"
    NAN = "nan"
    ERROR = "error"
    KILLED = "killed"

    @classmethod
    def recorded(cls, tag: str | None) -> TrialStatus | None:
        """The status a run's ``foldsweep.status`` tag holds; None without one (a run that never
        ended, or one of a kind foldsweep does not know)."""
        return next((status for status in cls if status.value == tag), None)

    @property
    def run_state(self) -> str:
        return {
            "running": "RUNNING",
            "ok": "FINISHED",
            "pruned": "FINISHED",
            "nan": "FAILED",
            "error": "FAILED",
            "killed": "KILLED",
        }[self.value]


class SweepStatus(StrEnum):
    """A sweep's outcome (tag ``foldsweep.status`` of the parent run) and its run state."""

    RUNNING = "running"
    OK = "ok"
    INTERRUPTED = "interrupted"
    ERROR = "error"

    @property
    def run_state(self) -> str:
        return {"running": "RUNNING", "ok": "FINISHED", "interrupted": "KILLED", "error": "FAILED"}[self.value]


EVAL_STEP = -1  # a NanEvent step: found by validation, not by a training step


@dataclass(frozen=True)
class NanEvent:
    """Where a fold first went non-finite: epoch (1-based), step within that epoch (0-based;
    EVAL_STEP when validation found it), the last finite training loss and the gradient global
    norm of that last good step."""

    epoch: int
    step: int
    last_finite_loss: float
    grad_norm: float


@dataclass(frozen=True)
class FoldScores:
    """One fold's epoch: its training loss, validation loss and accuracy, and every other metric
    it computes ({name: value}, recorded as ``val_<name>``), each over the whole validation fold."""

    train_loss: float
    val_loss: float
    val_accuracy: float | None  # None for regression, which has no accuracy
    metrics: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def frozen(cls, metrics: Sequence[str] = (), *, classifier: bool = True) -> FoldScores:
        """A fold that went NaN earlier: it trains no more, its scores are NaN."""
        return cls(math.nan, math.nan, math.nan if classifier else None, {name: math.nan for name in metrics})

    def as_dict(self) -> dict[str, float]:
        own = {name: getattr(self, name) for name in FOLD_SCORE_NAMES}
        return {
            **{name: value for name, value in own.items() if value is not None},
            **{f"val_{name}": value for name, value in self.metrics.items()},
        }

    def score(self, name: str) -> float:
        """``val_<name>``."""
        return self.as_dict()[f"val_{name}"]


# The scores every fold has (its fields: the training loss and foldsweep's own validation scores).
FOLD_SCORE_NAMES: tuple[str, ...] = tuple(score.name for score in fields(FoldScores) if score.name != "metrics")


# A fold that went NaN counts as each one's worst score in its trial's CV mean and std, finite, so
# that no NaN reaches a searcher or scheduler (split{k} values stay NaN in the record).
def _own_worst(name: str) -> float:
    metric = name.partition("_")[2]  # train_loss and val_loss: the loss
    return Scorer(metric, OWN_SCORES[metric]).worst


NAN_FOLD_SCORES: Mapping[str, float] = {name: _own_worst(name) for name in FOLD_SCORE_NAMES}


@dataclass(frozen=True)
class FoldThroughput:
    train_samples_per_s: float
    compile_s: float


@dataclass(frozen=True)
class Throughput:
    """Samples/s with compilation excluded, and compilation seconds: per fold and for the trial."""

    train_samples_per_s: float
    eval_samples_per_s: float
    compile_s: float
    folds: tuple[FoldThroughput, ...]
    # None when the trial compiled nothing with XLA or ran without the compile cache.
    cache_hits: int | None = None
    cache_misses: int | None = None


@dataclass(frozen=True)
class NanReport:
    """How many folds went NaN, and where the first of them (by epoch, then fold) did."""

    failures: int = 0
    fold: int | None = None
    event: NanEvent | None = None

    @classmethod
    def of(cls, failures: Sequence[tuple[int, NanEvent]]) -> NanReport:
        if not failures:
            return cls()
        fold, first = min(failures, key=lambda pair: (pair[1].epoch, pair[0]))
        return cls(len(failures), fold, first)

    def as_dict(self) -> dict[str, Any]:
        if self.event is None:
            return {NAN_FAILURES: self.failures}
        return {
            NAN_FAILURES: self.failures,
            "nan_fold": self.fold,
            "nan_epoch": self.event.epoch,
            "nan_step": self.event.step,
            "nan_last_finite_loss": self.event.last_finite_loss,
            "nan_grad_norm": self.event.grad_norm,
        }


@dataclass(frozen=True)
class TrialInfo:
    """Once per trial (and per process it runs in): its plan, where it ran, its model."""

    plan: TrialPlan
    compile_source: str = "default"
    loss: str = ""
    params_in_effect: Mapping[str, Any] = field(default_factory=dict)
    device_notice: str = ""
    gpu_ids: str = ""
    node_id: str = ""
    hostname: str = ""
    data_transfers: int = 0
    versions: Mapping[str, str] = field(default_factory=dict)
    n_params: int = 0
    model_summary: str = ""

    def report(self) -> dict[str, Any]:
        """The flat fields of a trial's first report in a process (``from_report`` reads them back)."""
        return {
            **self._described(),
            PARAMS_IN_EFFECT: dict(self.params_in_effect),
            N_PARAMS: self.n_params,
            MODEL_SUMMARY: self.model_summary,
            TRIAL_PLAN: json.dumps(self.plan.as_dict(), sort_keys=True),
        }

    def _described(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "device": plan.device,
            "device_notice": self.device_notice,
            "gpu_ids": self.gpu_ids,
            "node_id": self.node_id,
            "hostname": self.hostname,
            "data_transfers": self.data_transfers,
            "tf_threads": plan.threads.describe(),
            "jit_compile": plan.jit_compile,
            "fused": plan.fused,
            "fused_reason": plan.reason,
            "steps_per_launch": plan.steps_per_launch,
            "random_draws": plan.random_draws,
            "last_batch_padded": plan.last_batch_padded,
            "graph_optimizer": plan.graph_optimizer,
            "compile_source": self.compile_source,
            "loss": self.loss,
            **self.versions,
            # Plans recorded before the estimate have none to tag.
            **({"compile_estimate_s": plan.compile_estimate_s} if plan.compile_estimate_s is not None else {}),
        }

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> TrialInfo | None:
        """The info a report carries (None in the reports after a process's first)."""
        if not report.get(TRIAL_PLAN):
            return None
        return cls(
            plan=TrialPlan.from_dict(json.loads(report[TRIAL_PLAN])),
            compile_source=str(report.get("compile_source", "default")),
            loss=str(report.get("loss", "")),
            params_in_effect=dict(report.get(PARAMS_IN_EFFECT, {})),
            device_notice=str(report.get("device_notice", "")),
            gpu_ids=str(report.get("gpu_ids", "")),
            node_id=str(report.get("node_id", "")),
            hostname=str(report.get("hostname", "")),
            data_transfers=int(report.get("data_transfers", 0)),
            versions={key: str(report[key]) for key in VERSION_FIELDS if key in report},
            n_params=int(report.get(N_PARAMS, 0)),
            model_summary=str(report.get(MODEL_SUMMARY, "")),
        )

    def mlflow_tags(self) -> dict[str, str]:
        """Recorded as tags ``foldsweep.<field>``: where and how the trial ran."""
        return {key: str(value) for key, value in self._described().items()}

    def mlflow_params(self) -> dict[str, str]:
        """The optimizer and learning rate in effect: params where the config holds none."""
        return {key: str(value) for key, value in self.params_in_effect.items()}

    def mlflow_metrics(self) -> dict[str, float]:
        return {N_PARAMS: float(self.n_params)}

    def mlflow_texts(self) -> dict[str, str]:
        """Artifacts: the model summary and the plan (what a rerun executes again)."""
        texts = {"model_summary.txt": self.model_summary} if self.model_summary else {}
        return {**texts, PLAN_ARTIFACT: json.dumps(self.plan.as_dict(), sort_keys=True)}


@dataclass(frozen=True)
class EpochResult:
    """One epoch of every fold of a trial."""

    epoch: int
    fold_ids: tuple[int, ...]
    folds: tuple[FoldScores, ...]
    throughput: Throughput
    nan: NanReport = NanReport()
    epochs_planned: int = 0
    done: bool = False
    stopped_epoch: int | None = None  # the trial's own early stopping ended it here
    directions: Mapping[str, Direction | Literal[""]] = field(default_factory=dict)  # SCORE_DIRECTIONS
    # The trial's time account at this epoch's report, and the pause before this epoch trained
    # (None for a process's first epoch, which start-up precedes).
    account: TimeAccount | None = None
    epoch_gap_s: float | None = None

    def with_progress(self, *, epochs_planned: int) -> EpochResult:
        """Planned epochs known, and done when reached or when every fold went NaN."""
        done = self.epoch >= epochs_planned or self.nan.failures == len(self.folds)
        return replace(self, epochs_planned=epochs_planned, done=done)

    def stopped_early(self) -> EpochResult:
        """The last epoch of a trial its own early stopping ends: done, and not pruned."""
        return replace(self, done=True, stopped_epoch=self.epoch)

    def live_scores(self, name: str) -> list[float]:
        """``val_<name>`` of the folds still training (a NaN fold's frozen scores left out)."""
        return [fold.score(name) for fold in self.folds if math.isfinite(fold.val_loss)]

    def cv_summary(self) -> dict[str, float]:
        return cv_summary([fold.as_dict() for fold in self.folds], self.fold_ids, worst=worst_scores(self.directions))

    def status(self) -> TrialStatus:
        """ok, nan, or pruned (stopped before its planned epochs)."""
        if self.nan.failures > 0:
            return TrialStatus.NAN
        if self.stopped_epoch is not None:  # it completed its own rule: not pruned by a scheduler
            return TrialStatus.OK
        return TrialStatus.PRUNED if self.epoch < self.epochs_planned else TrialStatus.OK

    def report(self, info: TrialInfo | None = None) -> dict[str, Any]:
        """The flat dict a Ray Tune trainable returns (``info`` once per process)."""
        stopped = {STOPPED_EPOCH: self.stopped_epoch} if self.stopped_epoch is not None else {}
        return {
            EPOCH: self.epoch,
            EPOCHS_PLANNED: self.epochs_planned,
            DONE: self.done,
            FOLD_IDS: list(self.fold_ids),
            **self.cv_summary(),
            **self.throughput_values(),
            SCORE_DIRECTIONS: json.dumps(dict(self.directions), sort_keys=True),
            **self.nan.as_dict(),
            **stopped,
            **self.account_values(),
            **(info.report() if info else {}),
        }

    def account_values(self) -> dict[str, float]:
        """The time account as reported (its ``compile_s`` is the throughput's) and the epoch's gap."""
        values: dict[str, float] = {}
        if self.account is not None:
            account = self.account.as_dict()
            values = {TRIAL_WALL_S: self.account.wall_s, **{key: account[key] for key in ACCOUNT_KEYS[1:]}}
        if self.epoch_gap_s is not None:
            values[EPOCH_GAP_S] = self.epoch_gap_s
        return values

    def throughput_values(self) -> dict[str, float]:
        throughput = self.throughput
        values = {
            TRAIN_RATE: throughput.train_samples_per_s,
            EVAL_RATE: throughput.eval_samples_per_s,
            COMPILE_S: throughput.compile_s,
        }
        for k, fold in zip(self.fold_ids, throughput.folds):
            values[split_key(k, TRAIN_RATE)] = fold.train_samples_per_s
            values[split_key(k, COMPILE_S)] = fold.compile_s
        if throughput.cache_hits is not None and throughput.cache_misses is not None:  # both or neither
            values[COMPILE_CACHE_HITS] = throughput.cache_hits
            values[COMPILE_CACHE_MISSES] = throughput.cache_misses
        return values

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> EpochResult:
        fold_ids = tuple(int(k) for k in report[FOLD_IDS])
        directions = json.loads(report.get(SCORE_DIRECTIONS) or "{}")

        def own_scores(k: int) -> dict[str, Any]:  # FoldScores' own fields (a regression's val_accuracy is None)
            return {name: _optional_float(report.get(split_key(k, name))) for name in FOLD_SCORE_NAMES}

        folds = tuple(
            FoldScores(
                **own_scores(k), metrics={name: float(report[split_key(k, f"val_{name}")]) for name in directions}
            )
            for k in fold_ids
        )
        throughput = Throughput(
            train_samples_per_s=report[TRAIN_RATE],
            eval_samples_per_s=report[EVAL_RATE],
            compile_s=report[COMPILE_S],
            folds=tuple(
                FoldThroughput(report[split_key(k, TRAIN_RATE)], report[split_key(k, COMPILE_S)]) for k in fold_ids
            ),
            cache_hits=_optional_int(report.get(COMPILE_CACHE_HITS)),
            cache_misses=_optional_int(report.get(COMPILE_CACHE_MISSES)),
        )
        event = None
        if report.get("nan_epoch") is not None:
            event = NanEvent(
                epoch=int(report["nan_epoch"]),
                step=int(report["nan_step"]),
                last_finite_loss=float(report["nan_last_finite_loss"]),
                grad_norm=float(report["nan_grad_norm"]),
            )
        nan = NanReport(int(report.get(NAN_FAILURES, 0)), report.get("nan_fold"), event)
        stopped = report.get(STOPPED_EPOCH)
        gap = report.get(EPOCH_GAP_S)
        return cls(
            epoch=int(report[EPOCH]),
            fold_ids=fold_ids,
            folds=folds,
            throughput=throughput,
            nan=nan,
            epochs_planned=int(report.get(EPOCHS_PLANNED, 0)),
            done=bool(report.get(DONE, False)),
            stopped_epoch=None if stopped is None else int(stopped),
            directions=directions,
            account=trial_account(report),
            epoch_gap_s=None if gap is None else float(gap),
        )

    def mlflow_metrics(self) -> dict[str, float]:
        """Metrics at step = epoch: a fold's NaN is recorded as NaN (it is the finding); a
        throughput not yet measurable (compilation time before a second epoch) is left out. The
        time account is recorded once, when the trial ends (``TrialRecorder.finish``)."""
        metrics = {**self.cv_summary(), NAN_FAILURES: float(self.nan.failures)}
        if self.stopped_epoch is not None:
            metrics[STOPPED_EPOCH] = float(self.stopped_epoch)
        if self.epoch_gap_s is not None:
            metrics[EPOCH_GAP_S] = self.epoch_gap_s
        metrics.update({key: float(value) for key, value in self.throughput_values().items() if math.isfinite(value)})
        return metrics

    def mlflow_tags(self) -> dict[str, str]:
        """Fields recorded as tags ``foldsweep.<field>``: where a fold went NaN."""
        return {key: str(value) for key, value in self.nan.as_dict().items() if key in NAN_FIELDS}


def ended_status(last_report: Mapping[str, Any]) -> TrialStatus:
    """How a trial that Ray Tune completed ended, from its last report: ok, pruned or nan."""
    return EpochResult.from_report(last_report).status() if FOLD_IDS in last_report else TrialStatus.OK


def placement_tags(report: Mapping[str, Any]) -> dict[str, str]:
    """Where the trial ran, in every report (Ray Tune's pid and node, the worker's trial count),
    and why its worker retires after it: tags ``foldsweep.<field>``."""
    retires = (
        {WORKER_RETIRES: report[WORKER_RETIRES]}
        if isinstance(report.get(WORKER_RETIRES), str) and report[WORKER_RETIRES]
        else {}
    )
    return {**{key: str(report[key]) for key in RAY_PLACEMENT_FIELDS if key in report}, **retires}


def placement_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """The worker's mappings and resident memory after the epoch."""
    return {key: float(report[key]) for key in (WORKER_MAPS, WORKER_RSS) if key in report}


def cv_summary(
    per_fold: Sequence[Mapping[str, float]],
    fold_ids: Sequence[int] | None = None,
    *,
    worst: Mapping[str, float] = NAN_FOLD_SCORES,
) -> dict[str, float]:
    """Per-fold results -> split{k}_<key>, mean_<key>, std_<key> (population std, as sklearn).

    A non-finite fold value stays as it is in split{k}_<key> and counts as the worst score
    (``worst``: ``worst_scores``) in the mean and std, which therefore stay finite.
    """
    summary: dict[str, float] = {}
    for key in per_fold[0]:
        values = np.array([fold[key] for fold in per_fold], dtype=np.float64)
        for k, value in zip(fold_ids if fold_ids is not None else range(len(values)), values):
            summary[split_key(k, key)] = float(value)
        scored = np.where(np.isfinite(values), values, worst.get(key, np.nan))
        summary[f"mean_{key}"] = float(scored.mean())
        summary[f"std_{key}"] = float(scored.std())
    return summary


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)
