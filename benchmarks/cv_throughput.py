"""CV training throughput: the naive per-fold `model.fit` workflow vs the foldsweep engine,
unfused (one compiled loop per fold) and fused (all folds in one compiled step).

Same process, same data, same folds, same model and epochs. samples/s counts the CV training
samples of all folds per second with compilation excluded: for every variant the first epoch
(tracing and compilation) is timed apart and the rate comes from the epochs after it. Run-to-run
noise on a shared 2-core machine reaches 30%, so the variants are measured in turn, --repeats
times, and each row is the median.

    .venv/bin/python -m benchmarks.cv_throughput [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import cnn_builder, mnist1d, naive_fold_fit, peak_rss_mb, protein_windows  # noqa: E402
from pipeline.folds import make_folds  # noqa: E402
from pipeline.resident import resident_data  # noqa: E402
from pipeline.spec import CVSpec  # noqa: E402
from pipeline.trainer import FoldTrainer  # noqa: E402
from pipeline.training import TrainingParams  # noqa: E402

N_SPLITS = 3


def measure_naive(dataset, folds, build, batch_size: int, epochs: int) -> float:
    samples = seconds = 0.0
    for k, fold in enumerate(folds):
        epoch_seconds, _ = naive_fold_fit(build, dataset.x[fold.train], dataset.y[fold.train],
                                          dataset.x[fold.val], dataset.y[fold.val],
                                          batch_size=batch_size, epochs=epochs, seed=k)
        samples += len(fold.train) * (epochs - 1)
        seconds += sum(epoch_seconds[1:])
    return samples / seconds


# variant -> (train.jit_compile, train.fused)
ENGINE_VARIANTS = {"engine": ("auto", "off"), "fused": ("auto", "on"), "auto": ("auto", "auto"),
                   "engine-xla": ("on", "off"), "engine-noxla": ("off", "off"),
                   "fused-xla": ("on", "on"), "fused-noxla": ("off", "on")}


def measure_engine(dataset, folds, build, batch_size: int, epochs: int, variant: str) -> float:
    jit_compile, fused = ENGINE_VARIANTS[variant]
    trainer = FoldTrainer(build, {}, TrainingParams(batch_size=batch_size, learning_rate=1e-3, optimizer="adam"),
                          data=resident_data(dataset.fingerprint, dataset.x, dataset.y), folds=folds, seed=0,
                          jit_compile=jit_compile, fused=fused)
    for _ in range(epochs):
        result = trainer.run_epoch()
    keras.backend.clear_session()
    return result["train_samples_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data and fewer epochs (under two minutes)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    parser.add_argument("--batch-sizes", default="8,64,256")
    parser.add_argument("--repeats", type=int, help="measurements per variant, interleaved; the median is kept "
                                                    "(default 3, 1 with --quick)")
    parser.add_argument("--variants", default="naive,engine,fused",
                        help="comma list of naive, " + ", ".join(ENGINE_VARIANTS) + " (engine = unfused, auto = "
                             "what a sweep picks; -xla/-noxla force XLA on or off)")
    parser.add_argument("--dropout", action="store_true",
                        help="add a Dropout layer to the CNN (random layers: XLA off on CPU)")
    args = parser.parse_args(argv)

    epochs = 2 if args.quick else 3
    repeats = args.repeats or (1 if args.quick else 3)
    workloads = [mnist1d(), protein_windows(48 if args.quick else 190)]
    if args.quick:
        workloads[0] = workloads[0].__class__(name="mnist1d", x=workloads[0].x[:2400], y=workloads[0].y[:2400])
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = args.variants.split(",")
    rows = []
    print(f"{'dataset':<12}{'batch':>6}{'variant':>14}{'samples/s':>12}{'vs first':>10}{'vs engine':>11}"
          f"{'peak RSS MB':>13}", flush=True)
    for dataset in workloads:
        folds = make_folds(CVSpec(splitter="stratified", n_splits=N_SPLITS, seed=0), dataset).folds
        build = cnn_builder(dataset.input_shape, dataset.n_classes, dropout=0.2 if args.dropout else 0.0)
        for batch_size in batch_sizes:
            measured: dict[str, list[float]] = {variant: [] for variant in variants}
            for _ in range(repeats):
                for variant in variants:
                    if variant == "naive":
                        measured[variant].append(measure_naive(dataset, folds, build, batch_size, epochs))
                    else:
                        measured[variant].append(measure_engine(dataset, folds, build, batch_size, epochs, variant))
            rates = {variant: float(np.median(values)) for variant, values in measured.items()}
            for variant, rate in rates.items():
                first = rates[variants[0]]
                versus_engine = rate / rates["engine"] if "engine" in rates else float("nan")
                row = {"dataset": dataset.name, "batch_size": batch_size, "variant": variant,
                       "samples_per_s": round(rate, 1), "runs": [round(value, 1) for value in measured[variant]],
                       "vs_first": round(rate / first, 3),
                       "vs_engine": round(versus_engine, 3), "peak_rss_mb": round(peak_rss_mb(), 1)}
                rows.append(row)
                print(f"{dataset.name:<12}{batch_size:>6}{variant:>14}{rate:>12.0f}{rate / first:>9.2f}x"
                      f"{versus_engine:>10.2f}x{row['peak_rss_mb']:>13.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
