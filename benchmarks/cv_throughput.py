"""CV training throughput: the naive per-fold `model.fit` workflow vs the foldsweep engine,
unfused (one compiled loop per fold) and fused (all folds in one execution: `fused` in the layout
a sweep picks for `--cpus`, `stacked` or `side` forced), one training step per compiled launch or
8 unrolled (`-x8`).

Same data, same folds, same model and epochs. `--model` picks the models (each on the datasets
it is written for): `plain`, the 3-conv CNN without Dropout, BatchNormalization or regularizer
(`--dropout` adds a Dropout layer); the shipped hypermodels at their defaults, `mnist1d_cnn`
(Dropout 0.1) and `protein_cnn` (Dropout 0.2), and `protein_cnn_bn` (`batch_norm: true`); `fcn`,
keras.io's fully convolutional network (three Conv1D + BatchNormalization blocks); the image
models of `benchmarks/image_models.py` (`image_cnn`, `image_cnn_aug`, `mobilenet_v2`,
`transfer`) on the built-in `shapes` (`--datasets shapes`).
`--baseline REV` measures every engine variant a second time with foldsweep's engine as it was
at the git revision REV, right after this checkout's (rows `variant@REV`): before and after side
by side. samples/s counts the CV training
samples of all folds per second with compilation excluded: for every variant the first epoch
(tracing and compilation) is timed apart and the rate comes from the --epochs after it. Run-to-run
noise on a shared 2-core machine reaches 30%, so the variants are measured in turn, --repeats
times, and each row is the median. The ratios are medians of each round's ratio (variants of one
round ran back to back, so a slow spell of the machine cancels out) rather than ratios of medians.
`vs unfused` compares a fused variant with the unfused one of the same launch size (fused-x8 with
engine-x8); compile_s is the trial's compilation seconds;
cores is the CPU time over the wall time of the timed epochs (how many cores the variant kept busy).
spread is how far a variant's rate moved between rounds ((largest - smallest) / median).

How far from the machine's limit: each round also measures the float32 FLOP/s of a large
XLA-compiled matmul on `--cpus` threads (the `peak` row), and each variant's GFLOP/s is its
samples/s times the model's training FLOPs per sample, counted from its convolutions and dense
layers (`benchmarks.flops`, checked against TensorFlow's graph profiler in tests/test_flops.py);
`% peak` is the median over rounds of that over the same round's peak. The naive fit runs on
TensorFlow's default threads (every core), the peak on `--cpus`.

Each measurement runs in a fresh process, with TensorFlow's threads sized as a sweep worker sizes
them for that variant (`--cpus` = the trial's resources.cpu; unfused trials get one inter-op
thread, fused ones one per fold) and the naive workflow with TensorFlow's defaults. A fresh
process also keeps the compiled XLA programs of one measurement from piling up in the next.

    .venv/bin/python -m benchmarks.cv_throughput [--quick] [--model protein_cnn,fcn] [--baseline REV] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks import image_models  # noqa: E402
from benchmarks.common import cnn_builder, fcn_builder, mnist1d, naive_fold_fit, peak_rss_mb, protein_windows  # noqa: E402
from benchmarks.flops import matmul_peak_flops, training_flops_per_sample  # noqa: E402
from pipeline.contract.plan import ExecutionChoices, ForcedLayout, ThreadPlan, plan_threads  # noqa: E402
from pipeline.engine.recipe import TrainingRecipe  # noqa: E402
from pipeline.engine.resident import resident_data  # noqa: E402
from pipeline.engine.runtime import configure_threads  # noqa: E402
from pipeline.engine.trainer import build_trainer, threads_in_effect  # noqa: E402
from pipeline.inputs.datasets import data_dir, load_dataset  # noqa: E402
from pipeline.inputs.folds import make_folds  # noqa: E402
from pipeline.inputs.hypermodel import build_model, load_builder  # noqa: E402
from pipeline.inputs.spec import AutoSwitch, CVSpec, DatasetSpec, read_yaml  # noqa: E402

N_SPLITS = 3
SEQUENCES = ("mnist1d", "protein")
DATASETS = (*SEQUENCES, "shapes")
REPO = Path(__file__).resolve().parents[1]
# --model name -> the datasets it is written for.
MODELS = {
    "plain": SEQUENCES,
    "mnist1d_cnn": ("mnist1d",),
    "protein_cnn": ("protein",),
    "protein_cnn_bn": ("protein",),
    "fcn": SEQUENCES,
    **{name: ("shapes",) for name in image_models.NAMES},
}


def model_under_test(
    name: str, dataset, *, dropout: bool, hp: dict[str, Any] | None = None
) -> tuple[Callable[[Any], Any], dict[str, Any]]:
    """The model's build(hp) and the hyperparameter values it is built with (the hypermodels'
    defaults otherwise, and ``hp`` over them)."""
    if name == "plain":
        return cnn_builder(dataset.input_shape, dataset.n_classes, dropout=0.2 if dropout else 0.0), {}
    if name == "fcn":
        return fcn_builder(dataset.input_shape, dataset.n_classes), {}
    if name in image_models.NAMES:
        return load_builder(Path(image_models.__file__), name), {}
    experiment = name.removesuffix("_bn")
    return load_builder(REPO / "experiments" / f"{experiment}.py", "build"), (
        {"batch_norm": True} if name.endswith("_bn") else {}
    ) | (hp or {})


def hp_values(pairs: list[str]) -> dict[str, Any]:
    """``--hp dropout=0.0`` pairs, their values read as a spec reads them (numbers, booleans)."""
    values = {}
    for pair in pairs:
        name, separator, value = pair.partition("=")
        if not separator:
            raise SystemExit(f"--hp: expected NAME=VALUE, got {pair!r}")
        values[name] = read_yaml(value)
    return values


def measure_naive(dataset, folds, build, values, batch_size: int, epochs: int) -> dict[str, float]:
    samples = seconds = 0.0
    for k, fold in enumerate(folds):
        epoch_seconds, _ = naive_fold_fit(
            lambda: build_model(build, values, input_shape=dataset.input_shape),
            dataset.x[fold.train],
            dataset.y[fold.train],
            dataset.x[fold.val],
            dataset.y[fold.val],
            batch_size=batch_size,
            epochs=epochs,
            seed=k,
        )
        samples += len(fold.train) * (epochs - 1)
        seconds += sum(epoch_seconds[1:])
    return {"rate": samples / seconds, "compile_s": float("nan"), "cores": float("nan")}


# variant -> (train.jit_compile, train.fused, train.steps_per_launch, fused layout)
ENGINE_VARIANTS: dict[str, tuple[AutoSwitch, AutoSwitch, int | Literal["auto"], ForcedLayout]] = {
    "engine": ("auto", "off", 1, "auto"),
    "fused": ("auto", "on", 1, "auto"),
    "auto": ("auto", "auto", "auto", "auto"),
    "engine-x8": ("auto", "off", 8, "auto"),
    "fused-x8": ("auto", "on", 8, "auto"),
    "stacked": ("auto", "on", 1, "stacked"),
    "stacked-x8": ("auto", "on", 8, "stacked"),
    "side": ("auto", "on", 1, "side_by_side"),
    "side-x8": ("auto", "on", 8, "side_by_side"),
    "engine-xla": ("on", "off", 1, "auto"),
    "engine-noxla": ("off", "off", 1, "auto"),
    "fused-xla": ("on", "on", 1, "auto"),
    "fused-noxla": ("off", "on", 1, "auto"),
}
FUSED_VARIANTS = ("fused", "stacked", "side")
# The machine's float32 peak on the measured threads (``benchmarks.flops``), measured in every round.
PEAK = "peak"


def variant_choices(variant: str) -> ExecutionChoices:
    jit_compile, fused, steps_per_launch, layout = ENGINE_VARIANTS[variant]
    return ExecutionChoices(jit_compile=jit_compile, fused=fused, steps_per_launch=steps_per_launch, layout=layout)


def measure_engine(dataset, folds, build, values, batch_size: int, epochs: int, variant: str) -> dict[str, float | str]:
    trainer = build_trainer(
        build,
        {"batch_size": batch_size, "learning_rate": 1e-3, "optimizer": "adam", **values},
        TrainingRecipe(choices=variant_choices(variant)),
        data=resident_data(dataset.fingerprint, dataset.x, dataset.y),
        folds=folds,
        planned_epochs=epochs,
    )
    result = trainer.run_epoch()  # tracing and compilation: timed apart by the trainer
    wall, cpu = time.perf_counter(), _cpu_seconds()
    for _ in range(epochs - 1):
        result = trainer.run_epoch()
    cores = (_cpu_seconds() - cpu) / (time.perf_counter() - wall)
    return {
        "rate": result.throughput.train_samples_per_s,
        "compile_s": result.throughput.compile_s,
        "cores": cores,
        "fusion": trainer.plan.reason,
    }


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def load_workload(name: str, quick: bool):
    if name == "shapes":
        dataset = load_dataset(DatasetSpec(name="shapes", options=image_models.SHAPES_OPTIONS))
        return dataset.__class__(name="shapes", x=dataset.x[:1200], y=dataset.y[:1200]) if quick else dataset
    if name == "mnist1d":
        dataset = mnist1d()
        return dataset.__class__(name="mnist1d", x=dataset.x[:2400], y=dataset.y[:2400]) if quick else dataset
    return protein_windows(48 if quick else 190)


def measure_here(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process, sized as a sweep worker would size it."""
    variant, epochs = args.measure, 1 + args.epochs
    if variant == PEAK:
        configure_threads(ThreadPlan(intra_op=args.cpus, inter_op=1))
        return {
            "flops_per_s": matmul_peak_flops(),
            "threads": threads_in_effect().describe(),
            "peak_rss_mb": peak_rss_mb(),
        }
    cv = CVSpec(splitter="stratified", n_splits=N_SPLITS, seed=0, n_repeats=args.cv_repeats)
    if variant != "naive":
        configure_threads(plan_threads(variant_choices(variant), cpus=args.cpus, n_folds=cv.replicas))
    dataset = load_workload(args.datasets, args.quick)
    folds = make_folds(cv, dataset).folds
    build, values = model_under_test(args.model, dataset, dropout=args.dropout, hp=hp_values(args.hp))
    batch_size = int(args.batch_sizes)
    measured: Mapping[str, float | str]
    if variant == "naive":
        measured = measure_naive(dataset, folds, build, values, batch_size, epochs)
    else:
        measured = measure_engine(dataset, folds, build, values, batch_size, epochs, variant)
    flops = training_flops_per_sample(build_model(build, values, input_shape=dataset.input_shape))
    return {
        **measured,
        "dataset": dataset.name,
        "threads": threads_in_effect().describe(),
        "peak_rss_mb": peak_rss_mb(),
        "train_flops_per_sample": flops,
    }


def measure_apart(
    args: argparse.Namespace,
    dataset: str,
    batch_size: int,
    variant: str,
    *,
    model: str = "plain",
    code: Path | None = None,
) -> dict[str, Any]:
    """One measurement in a fresh process; with ``code``, a directory whose ``pipeline`` package
    is measured instead of this checkout's (``baseline_code``)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.cv_throughput",
        "--measure",
        variant,
        "--datasets",
        dataset,
        "--model",
        model,
        "--batch-sizes",
        str(batch_size),
        "--cpus",
        str(args.cpus),
        "--epochs",
        str(args.epochs),
        "--cv-repeats",
        str(args.cv_repeats),
    ]
    command += ["--quick"] * args.quick + ["--dropout"] * args.dropout
    command += [f"--hp={pair}" for pair in args.hp]
    # The working directory comes first on a `-m` module's path: its `pipeline` is the one measured.
    finished = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=code or REPO,
        env={**os.environ, "FOLDSWEEP_DATA_DIR": str(data_dir())},
    )
    if finished.returncode != 0:
        raise SystemExit(
            f"{variant} of {model} on {dataset} at batch {batch_size}{f' ({code})' if code else ''} "
            f"failed:\n{finished.stderr[-3000:]}"
        )
    return json.loads(finished.stdout.strip().splitlines()[-1])


def baseline_code(revision: str) -> Path:
    """A directory holding foldsweep's ``pipeline`` package at the git ``revision`` and this
    checkout's benchmarks and experiments (the models measured), so that the same measurement
    runs the engine as it was."""
    archive = subprocess.run(["git", "archive", revision, "pipeline"], cwd=REPO, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline: git archive {revision} failed: {archive.stderr.decode().strip()}")
    directory = Path(tempfile.mkdtemp(prefix=f"cv-throughput-{revision}-"))
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tree:
        tree.extractall(directory, filter="data")
    for folder in ("benchmarks", "experiments"):
        shutil.copytree(REPO / folder, directory / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return directory


def paired_ratio(runs: list[dict[str, Any]], baseline: list[dict[str, Any]] | None) -> float | None:
    """``median_ratio`` against a baseline that may not have been run (None)."""
    return None if baseline is None else median_ratio(runs, baseline)


def median_ratio(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> float:
    """The median over rounds of a variant's rate over the baseline's rate in the same round."""
    return float(np.median(round_ratios(runs, baseline)))


def round_ratios(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> list[float]:
    return [run["rate"] / base["rate"] for run, base in zip(runs, baseline)]


def spread(values: list[float]) -> float:
    """How far a measurement moved between rounds: (largest - smallest) / median."""
    return float((max(values) - min(values)) / np.median(values))


def flops_per_s(run: dict[str, Any]) -> float:
    return run["rate"] * run["train_flops_per_sample"]


def share_of_peak(runs: list[dict[str, Any]], peaks: list[dict[str, Any]]) -> float:
    """The median over rounds of a variant's FLOP/s over the peak measured in the same round."""
    return float(np.median([flops_per_s(run) / peak["flops_per_s"] for run, peak in zip(runs, peaks)]))


def _known(value: float | None) -> float | None:
    """None (JSON null) for what a variant does not have: a ratio to a variant that was not run,
    the naive workflow's separate compile time."""
    return None if value is None or math.isnan(value) else value


def _rounded(value: float | None, digits: int) -> float | None:
    known = _known(value)
    return None if known is None else round(known, digits)


def _cell(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if _known(value) is None else f"{value:{spec}}{unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data and fewer epochs")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    parser.add_argument("--batch-sizes", default="8,64,256")
    parser.add_argument(
        "--datasets", default="mnist1d,protein", help="comma list of mnist1d, protein, shapes (the image models')"
    )
    parser.add_argument(
        "--model",
        default="plain",
        help="comma list of " + ", ".join(MODELS) + "; each runs on the datasets it is written for",
    )
    parser.add_argument(
        "--epochs", type=int, help="timed epochs per measurement, after the compiling one (default 6, 1 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, help="measurements per variant, interleaved; the median is kept (default 3, --quick too)"
    )
    parser.add_argument(
        "--variants",
        default="naive,engine,fused,engine-x8,fused-x8",
        help="comma list of naive, " + ", ".join(ENGINE_VARIANTS) + " (engine = unfused, auto = "
        "what a sweep picks; -xla/-noxla force XLA on or off)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure every engine variant with foldsweep's engine at this git revision",
    )
    parser.add_argument("--dropout", action="store_true", help="add a Dropout layer to the plain CNN")
    parser.add_argument(
        "--hp",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a hypermodel's hyperparameter instead of its default (repeatable), "
        "e.g. --model protein_cnn --hp dropout=0.0",
    )
    parser.add_argument(
        "--cpus",
        type=int,
        default=os.cpu_count(),
        help="the trial's resources.cpu, which sizes TensorFlow's threads (default: every CPU)",
    )
    parser.add_argument(
        "--cv-repeats",
        type=int,
        default=1,
        help=f"cv.n_repeats: train {N_SPLITS} x this many replicas per trial (default 1)",
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one measurement, run by the parent process
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_here(args)))
        return 0

    repeats = 3 if args.repeats is None else args.repeats
    args.epochs = (1 if args.quick else 6) if args.epochs is None else args.epochs
    for flag, value in (("--repeats", repeats), ("--epochs", args.epochs)):
        if value < 1:
            raise SystemExit(f"{flag}: must be at least 1, got {value}")
    variants = args.variants.split(",")
    unknown = [variant for variant in variants if variant != "naive" and variant not in ENGINE_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}")
    datasets = args.datasets.split(",")
    unknown = [name for name in datasets if name not in DATASETS]
    if unknown:
        raise SystemExit(f"--datasets: unknown {', '.join(unknown)}; known: {', '.join(DATASETS)}")
    models = args.model.split(",")
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise SystemExit(f"--model: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    workloads = [(model, dataset) for model in models for dataset in datasets if dataset in MODELS[model]]
    if not workloads:
        raise SystemExit(f"--model {args.model} runs on none of --datasets {args.datasets}")
    # (row name, variant, code measured): each variant with this checkout's engine, then with the
    # baseline's right after it, so that a pair shares the machine's state of the moment.
    code = baseline_code(args.baseline) if args.baseline else None
    measurements: list[tuple[str, str, Path | None]] = []
    for variant in variants:
        measurements.append((variant, variant, None))
        if code is not None and variant != "naive":
            measurements.append((f"{variant}@{args.baseline}", variant, code))
    width = max(14, *(len(name) + 2 for name, _, _ in measurements))
    rows = []
    print(
        f"{'model':<16}{'dataset':<12}{'batch':>6}{'variant':>{width}}{'samples/s':>12}{'spread':>8}"
        f"{'vs first':>10}{'vs engine':>11}{'vs unfused':>12}{'GFLOP/s':>9}{'% peak':>8}{'compile_s':>11}"
        f"{'cores':>7}{'peak RSS MB':>13}  TensorFlow threads",
        flush=True,
    )
    for model, dataset in workloads:
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            measured: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in measurements}
            peaks: list[dict[str, Any]] = []
            for _ in range(repeats):
                peaks.append(measure_apart(args, dataset, batch_size, PEAK, model=model))
                for name, variant, code in measurements:
                    measured[name].append(measure_apart(args, dataset, batch_size, variant, model=model, code=code))
            peak_rates = [peak["flops_per_s"] for peak in peaks]
            peak_row = {
                "model": model,
                "hp": hp_values(args.hp),
                "dataset": "float32 matmul",
                "batch_size": batch_size,
                "variant": PEAK,
                "code": "checkout",
                "gflops_per_s": round(float(np.median(peak_rates)) / 1e9, 1),
                "gflops_runs": [round(rate / 1e9, 1) for rate in peak_rates],
                "spread": round(spread(peak_rates), 3),
                "pct_of_peak": 100.0,
                "threads": peaks[0]["threads"],
                "cpus": args.cpus,
            }
            rows.append(peak_row)
            print(
                f"{model:<16}{'(matmul)':<12}{batch_size:>6}{PEAK:>{width}}{'':>12}{spread(peak_rates):>7.0%}"
                f"{'':>10}{'':>11}{'':>12}{peak_row['gflops_per_s']:>9.1f}{100:>7.0f}%{'':>11}{'':>7}"
                f"{max(peak['peak_rss_mb'] for peak in peaks):>13.0f}  {peak_row['threads']}",
                flush=True,
            )
            for name, variant, _ in measurements:
                runs = measured[name]
                rate = float(np.median([run["rate"] for run in runs]))
                percent = 100 * share_of_peak(runs, peaks)
                gflops = float(np.median([flops_per_s(run) for run in runs])) / 1e9
                suffix = name.removeprefix(variant)
                versus_first = median_ratio(runs, measured[measurements[0][0]])
                versus_engine = paired_ratio(runs, measured.get("engine" + suffix))
                fused_kind = variant.split("-")[0]
                unfused = variant.replace(fused_kind, "engine", 1) + suffix if fused_kind in FUSED_VARIANTS else None
                versus_unfused = paired_ratio(runs, measured.get(unfused) if unfused is not None else None)
                row = {
                    "model": model,
                    "hp": hp_values(args.hp),
                    "dataset": runs[0]["dataset"],
                    "batch_size": batch_size,
                    "variant": name,
                    "code": args.baseline if suffix else "checkout",
                    "samples_per_s": round(rate, 1),
                    "runs": [round(run["rate"], 1) for run in runs],
                    "spread": round(spread([run["rate"] for run in runs]), 3),
                    "vs_first": round(versus_first, 3),
                    "vs_first_runs": [round(r, 3) for r in round_ratios(runs, measured[measurements[0][0]])],
                    "vs_engine": _rounded(versus_engine, 3),
                    "vs_unfused": _rounded(versus_unfused, 3),
                    "train_flops_per_sample": runs[0]["train_flops_per_sample"],
                    "gflops_per_s": round(gflops, 2),
                    "pct_of_peak": round(percent, 2),
                    "compile_s": _rounded(float(np.median([run["compile_s"] for run in runs])), 2),
                    "cores": _rounded(float(np.median([run["cores"] for run in runs])), 2),
                    "peak_rss_mb": round(max(run["peak_rss_mb"] for run in runs), 1),
                    "threads": runs[0]["threads"],
                    "cpus": args.cpus,
                    "fusion": runs[0].get("fusion", ""),
                }
                rows.append(row)
                print(
                    f"{model:<16}{row['dataset']:<12}{batch_size:>6}{name:>{width}}{rate:>12.0f}"
                    f"{row['spread']:>7.0%}{versus_first:>9.2f}x{_cell(versus_engine, '.2f', 'x'):>11}"
                    f"{_cell(versus_unfused, '.2f', 'x'):>12}{gflops:>9.1f}{percent:>7.1f}%"
                    f"{_cell(row['compile_s'], '.1f'):>11}"
                    f"{_cell(row['cores'], '.2f'):>7}{row['peak_rss_mb']:>13.0f}  {row['threads']}",
                    flush=True,
                )
    if "naive" in variants and len(measurements) > 2:
        print_best(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def print_best(rows: list[dict[str, Any]]) -> None:
    """Per model, dataset and batch size: the fastest variant of each code measured, against
    the naive per-fold fit of the same rounds."""
    print("\nbest variant against the naive per-fold fit", flush=True)
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["variant"] not in ("naive", PEAK):
            groups.setdefault((row["model"], row["dataset"], row["batch_size"], row["code"]), []).append(row)
    for (model, dataset, batch_size, code), group in groups.items():
        best = max(group, key=lambda row: row["vs_first"])
        print(
            f"{model:<16}{dataset:<12}{batch_size:>6}  {code:<10} {best['vs_first']:>6.2f}x  {best['variant']} "
            f"({best['fusion']})",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
