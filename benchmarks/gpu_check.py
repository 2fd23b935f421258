"""What a first session with a GPU measures, in one command: a table, and the rows as JSON.

Nothing of foldsweep's GPU path has run on a GPU before this (the machine it was written on had
none), so each measurement checks a rule that was reasoned, not measured:

- memory: each process's GPU memory (nvidia-smi), the driver's included, in a sweep with 1, 2
  and 4 trials per GPU (gpu: 1, 0.5, 0.25): the driver should hold none, and n slots of 1/n
  should fit with their CUDA contexts (GPU_CONTEXT_RESERVE_MB);
- throughput: training samples/s per layout (sequential, side by side, stacked) and batch size (8
  to 512) with 1, 8 and 32 steps per launch: the plan's GPU rules (stack at every batch size,
  GPU_UNROLL_MAX_BATCH, GPU_UNROLL_MIN_PLANNED_STEPS) against what the device does;
- host waits: host-to-device and device-to-host copies and stream/context syncs per training
  step, from TensorFlow's profiler, for the per-launch stop test (the CPU's) and the per-epoch
  one (the GPU's): the GPU plan should wait once per epoch, and copy no labels or index batches
  per launch;
- stacked acceptance: the stacked forward check's largest relative difference with TF32 on and
  off, and whether it passes float32's tolerance and TF32's: with TF32 on, stacking must not
  quietly fall back;
- compile cache: hits and misses of a second identical trial in a fresh process (keyed by GPU
  model, driver, CUDA, cuDNN and determinism);
- rerun identity: whether a trial run twice in fresh processes gives the same losses bit for bit,
  with and without TF_DETERMINISTIC_OPS (cuDNN's autotuning and atomics vary otherwise).

Each measurement runs in a process of its own (TensorFlow fixes a process's devices once, and
the driver's memory must be the driver's own). On a machine without a GPU it says so and exits 0.

    .venv/bin/python -m benchmarks.gpu_check [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pipeline.contract.plan import Layout, StopTest

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "mnist1d_cnn.py"
LAYOUTS: tuple[Layout, ...] = ("sequential", "side_by_side", "stacked")
BATCH_SIZES = (8, 32, 128, 512)
STEPS_PER_LAUNCH = (1, 8, 32)
TRIALS_PER_GPU = (1, 2, 4)
MODEL = {"conv_layers": 2, "filters": 32, "kernel_size": 5, "dropout": 0.0, "learning_rate": 1e-3, "optimizer": "adam"}
COLUMNS = ("measurement", "setting", "value", "unit")
NO_GPU = "no GPU on this machine ({reason}): nothing to measure; run it where foldsweep's trials get a GPU"


def row(measurement: str, setting: str, value: Any, unit: str = "") -> dict[str, Any]:
    return {"measurement": measurement, "setting": setting, "value": value, "unit": unit}


# --- measurements, each in a process of its own ------------------------------------------------------------


def _trainer(
    layout: Layout,
    batch_size: int,
    steps_per_launch: int | Literal["auto"] = "auto",
    *,
    quick: bool = False,
    stop_test: StopTest | None = None,
) -> tuple[Any, Any]:
    """(a trainer of the MNIST-1D CNN over 3 folds as this process's plan decides, its resident
    data); with ``stop_test``, the plan replayed with that stop test (no difference in numbers)."""
    from dataclasses import replace

    import keras

    from pipeline.contract.plan import ExecutionChoices
    from pipeline.engine.recipe import TrainingRecipe
    from pipeline.engine.resident import resident_data
    from pipeline.engine.trainer import build_trainer
    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.folds import make_folds
    from pipeline.inputs.hypermodel import load_builder
    from pipeline.inputs.spec import CVSpec, DatasetSpec

    dataset = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 1000 if quick else 4000}))
    folds = make_folds(CVSpec(splitter="stratified", n_splits=3, seed=0), dataset).folds
    choices = ExecutionChoices(
        fused="off" if layout == "sequential" else "on",
        steps_per_launch=steps_per_launch,
        layout="auto" if layout == "sequential" else layout,
    )
    data = resident_data("gpu-check", dataset.x, dataset.y)

    def build(replay: Any = None) -> Any:
        keras.backend.clear_session(free_memory=False)
        return build_trainer(
            load_builder(EXPERIMENT, "build"),
            {**MODEL, "batch_size": batch_size},
            TrainingRecipe(choices=choices),
            data=data,
            folds=folds,
            replay=replay,
        )

    trainer = build()
    if stop_test is not None and trainer.plan.stop_test != stop_test:
        trainer = build(replace(trainer.plan, stop_test=stop_test))
    return trainer, data


def measure_throughput(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for layout in LAYOUTS:
        for batch_size in BATCH_SIZES[:2] if quick else BATCH_SIZES:
            for steps in STEPS_PER_LAUNCH[:2] if quick else STEPS_PER_LAUNCH:
                setting = f"{layout}, batch {batch_size}, {steps} per launch"
                try:
                    trainer, _ = _trainer(layout, batch_size, steps, quick=quick)
                    if trainer.plan.layout != layout:
                        rows.append(row("throughput", setting, f"not {layout}: {trainer.plan.reason}"))
                        continue
                    for _ in range(2 if quick else 4):
                        throughput = trainer.run_epoch().throughput
                    rows.append(row("throughput", setting, round(throughput.train_samples_per_s), "samples/s"))
                    rows.append(row("compile", setting, round(throughput.compile_s, 1), "s"))
                except Exception as exc:  # noqa: BLE001 - one setting's failure is a result, not the end
                    rows.append(row("throughput", setting, f"failed: {type(exc).__name__}: {exc}"[:200]))
    return rows


def measure_host_waits(quick: bool) -> list[dict[str, Any]]:
    """Copies and syncs per training step of one profiled epoch (TensorFlow's profiler, its trace
    viewer's events), with the CPU's per-launch stop test and the GPU's per-epoch one."""
    import tensorflow as tf
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    patterns = {
        "host-to-device copies": r"memcpy.?htod|htod",
        "device-to-host copies": r"memcpy.?dtoh|dtoh",
        "stream or context syncs": r"synchroniz",
    }
    rows = []
    for stop_test in ("per_launch", "per_epoch"):
        trainer, _ = _trainer("sequential", 32, 1, quick=quick, stop_test=stop_test)
        trainer.run_epoch()  # compiled before profiling
        engine = trainer.engines[0]
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            engine.train_epoch(1)
            tf.profiler.experimental.stop()
            planes = [str(path) for path in Path(logdir).rglob("*.xplane.pb")]
            # "trace_viewer@" is the trace viewer's JSON (Chrome trace events); "trace_viewer" a protobuf.
            data, _ = _pywrap_profiler_plugin.xspace_to_tools_data(planes, "trace_viewer@", {})
        events = json.loads(data).get("traceEvents", []) if data else []
        full, remainder = engine.epoch_batches(1)
        steps = len(full) + (1 if len(remainder) else 0)
        for what, pattern in patterns.items():
            found = sum(1 for event in events if re.search(pattern, str(event.get("name", "")), re.IGNORECASE))
            rows.append(
                row(
                    "host waits",
                    f"{stop_test} stop test, sequential, batch 32: {what}",
                    round(found / steps, 2),
                    "per step",
                )
            )
    return rows


def measure_acceptance(quick: bool) -> list[dict[str, Any]]:
    import numpy as np
    import tensorflow as tf

    from pipeline.engine import stacked

    rows = []
    for tf32 in (True, False):
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
        trainer, data = _trainer("sequential", 16, 1, quick=quick)
        models, rows_per_fold = trainer.models, 16
        indices = np.concatenate([engine.epoch_order(0)[:rows_per_fold] for engine in trainer.engines])
        samples = tf.gather(data.x, indices)
        values = {
            id(variable): tf.constant(weights)
            for variable, weights in zip(models[0].trainable_variables, stacked.stacked_weights(models))
        }
        own = np.concatenate(
            [
                np.asarray(model(batch, training=True))
                for model, batch in zip(models, np.split(np.asarray(samples), len(models)))
            ]
        )
        for convolutions in ("patches", "grouped"):
            outputs, _ = stacked.StackedForm(models[0], values, len(models), convolutions=convolutions)(
                samples, tf.ones([len(models), rows_per_fold])
            )
            difference = float(np.max(np.abs(np.asarray(outputs) - own) / (np.abs(own) + 1e-6)))
            setting = f"TF32 {'on' if tf32 else 'off'}, {convolutions}"
            rows.append(row("stacked acceptance", f"{setting}: largest relative difference", f"{difference:.2e}"))
            for tolerance in (False, True):
                accepted = stacked.forward_matches(models, samples, convolutions=convolutions, tf32=tolerance)
                rows.append(
                    row(
                        "stacked acceptance",
                        f"{setting}: {'TF32' if tolerance else 'float32'} tolerance",
                        "accepted" if accepted else "refused",
                    )
                )
    return rows


def measure_compile_cache(quick: bool) -> list[dict[str, Any]]:
    trainer, _ = _trainer("stacked", 16, 1, quick=quick)
    throughput = trainer.run_epoch().throughput
    return [
        row(
            "compile cache",
            f"a trial in a fresh process, {trainer.plan.layout}: hits / misses",
            f"{throughput.cache_hits} / {throughput.cache_misses}",
        )
    ]


MEASUREMENTS: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
    "throughput": measure_throughput,
    "host_waits": measure_host_waits,
    "acceptance": measure_acceptance,
    "compile_cache": measure_compile_cache,
}


def measure_apart(part: str, quick: bool, environment: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One measurement in a fresh process, which sees one GPU and sets it up as a trial of a whole GPU does."""
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--part", part, *(["--quick"] if quick else [])]
    ran = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(environment or {})},
    )
    lines = [line for line in ran.stdout.splitlines() if line.startswith("{")]
    if ran.returncode != 0 or not lines:
        return [row(part, "failed", (ran.stderr.strip().splitlines() or ["no output"])[-1][:200])]
    return json.loads(lines[-1])["rows"]


def run_part(part: str, quick: bool) -> None:
    from pipeline.contract.plan import ThreadPlan
    from pipeline.engine.runner import configure_tensorflow

    configure_tensorflow(gpus=1, threads=ThreadPlan(intra_op=0, inter_op=0))
    print(json.dumps({"rows": MEASUREMENTS[part](quick)}))


# --- what runs a sweep or a trial ------------------------------------------------------------------------------


def _spec(workdir: Path, *, gpu: float, trials: int, epochs: int) -> Path:
    import yaml

    document = {
        "name": "gpu-check",
        "experiment": f"{EXPERIMENT}:build",
        "dataset": "mnist1d",
        "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
        "search": {
            "num_samples": trials,
            "seed": 0,
            "space": {**{k: v for k, v in MODEL.items() if k != "optimizer"}, "batch_size": 32},
        },
        "train": {"epochs": epochs, "metric": "accuracy", "mode": "max", "seed": 0, "refit": False},
        "resources": {"cpu": 1, "gpu": gpu, "max_concurrent": trials},
        "tracking": {"uri": f"sqlite:///{workdir / 'mlflow.db'}"},
    }
    path = workdir / "gpu_check.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _gpu_memory_by_pid() -> dict[int, int]:
    listed = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    used = {}
    for line in listed.splitlines():
        pid, _, memory = line.partition(",")
        if pid.strip().isdigit() and memory.strip().isdigit():
            used[int(pid)] = int(memory)
    return used


def measure_memory(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for trials in TRIALS_PER_GPU:
        with tempfile.TemporaryDirectory() as directory:
            workdir = Path(directory)
            command = [
                str(Path(sys.executable).parent / "foldsweep"),
                "run",
                str(_spec(workdir, gpu=1 / trials, trials=trials, epochs=2 if quick else 5)),
            ]
            driver = subprocess.Popen(
                command,
                cwd=workdir,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "FOLDSWEEP_DATA_DIR": str(REPO / "data")},
            )
            peaks: dict[int, int] = {}
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    for pid, used in _gpu_memory_by_pid().items():
                        peaks[pid] = max(peaks.get(pid, 0), used)
                    time.sleep(0.5)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            _, errors = driver.communicate()
            done.set()
            sampler.join()
            setting = f"{trials} trial{'s' if trials > 1 else ''} per GPU (gpu: {1 / trials:g})"
            if driver.returncode != 0:
                rows.append(row("memory", setting, f"sweep failed: {(errors.strip().splitlines() or [''])[-1][:160]}"))
                continue
            rows.append(row("memory", f"{setting}: driver", peaks.get(driver.pid, 0), "MiB"))
            workers = sorted(used for pid, used in peaks.items() if pid != driver.pid)
            rows.append(row("memory", f"{setting}: processes on the GPU", len(workers)))
            rows.append(row("memory", f"{setting}: largest process", max(workers, default=0), "MiB"))
            rows.append(row("memory", f"{setting}: all processes", sum(workers), "MiB"))
    return rows


def _trial_losses(workdir: Path, environment: dict[str, str]) -> tuple[list[str], str]:
    spec = _spec(workdir, gpu=1, trials=1, epochs=2)
    command = [str(Path(sys.executable).parent / "foldsweep"), "trial", str(spec), "--fold", "0"]
    ran = subprocess.run(
        command,
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**os.environ, "FOLDSWEEP_DATA_DIR": str(REPO / "data"), **environment},
    )
    return re.findall(r"(?:train_loss|val_loss|val_accuracy) (\S+)", ran.stdout), ran.stderr


def measure_rerun_identity(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for deterministic in (False, True):
        environment = {"TF_DETERMINISTIC_OPS": "1"} if deterministic else {}
        with tempfile.TemporaryDirectory() as directory:
            first, errors = _trial_losses(Path(directory), environment)
            second, _ = _trial_losses(Path(directory), environment)
        setting = f"a trial twice, TF_DETERMINISTIC_OPS {'1' if deterministic else 'unset'}"
        value = (
            "failed: " + (errors.strip().splitlines() or [""])[-1][:160]
            if not first
            else "bit-identical"
            if first == second
            else "differs"
        )
        rows.append(row("rerun identity", setting, value))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cells = [[str(item[column]) for column in COLUMNS] for item in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(COLUMNS)]
    print("  ".join(column.ljust(width) for column, width in zip(COLUMNS, widths)))
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer settings and epochs (a smoke check)")
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the rows go (gpu_check.json)")
    parser.add_argument("--part", choices=sorted(MEASUREMENTS), help=argparse.SUPPRESS)  # run by main, apart
    args = parser.parse_args(argv)
    if args.part:
        run_part(args.part, args.quick)
        return 0

    from pipeline.base.accelerator import UnknownGpu, gpu_identity

    try:
        identity = gpu_identity()
    except UnknownGpu as exc:
        print(
            f"a GPU is present but cannot be identified ({exc}): memory per process cannot be measured without "
            "nvidia-smi; fix the driver's tools first"
        )
        return 1
    if identity is None:
        print(NO_GPU.format(reason="nvidia-smi lists none, or none is visible to this process"))
        return 0
    print(f"GPU: {identity.describe()}", flush=True)
    rows = [*measure_memory(args.quick)]
    for part in ("throughput", "host_waits", "acceptance"):
        rows.extend(measure_apart(part, args.quick))
    with tempfile.TemporaryDirectory() as cache:
        for attempt in ("empty", "filled"):
            for result in measure_apart("compile_cache", args.quick, {"FOLDSWEEP_COMPILE_CACHE_DIR": cache}):
                rows.append({**result, "setting": f"{result['setting']} (cache {attempt})"})
    rows.extend(measure_rerun_identity(args.quick))
    print_table(rows)
    args.json.write_text(json.dumps({"gpu": identity.describe(), "quick": args.quick, "rows": rows}, indent=1))
    print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
