"""CV training throughput: the naive per-fold `model.fit` workflow vs the foldsweep engine.

Same process, same data, same folds, same model and epochs. samples/s counts the CV training
samples of all folds per second with compilation excluded: for both variants the first epoch
(tracing and compilation) is timed apart and the rate comes from the epochs after it.

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

from benchmarks.common import cnn_builder, mnist1d, naive_fold_fit, peak_rss_mb, protein_windows  # noqa: E402
from pipeline.folds import make_folds  # noqa: E402
from pipeline.resident import resident_data  # noqa: E402
from pipeline.spec import CVSpec  # noqa: E402
from pipeline.training import FoldTrainer, TrainingParams  # noqa: E402

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


def measure_engine(dataset, folds, build, batch_size: int, epochs: int, jit_compile: str = "auto") -> float:
    trainer = FoldTrainer(build, {}, TrainingParams(batch_size=batch_size, learning_rate=1e-3, optimizer="adam"),
                          data=resident_data(dataset.fingerprint, dataset.x, dataset.y), folds=folds, seed=0,
                          jit_compile=jit_compile)
    for _ in range(epochs):
        result = trainer.run_epoch()
    keras.backend.clear_session()
    return result["train_samples_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data and fewer epochs (under two minutes)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    parser.add_argument("--batch-sizes", default="8,64,256")
    parser.add_argument("--variants", default="naive,engine",
                        help="comma list of naive, engine, engine-xla, engine-noxla (the last two force XLA)")
    args = parser.parse_args(argv)

    epochs = 2 if args.quick else 3
    workloads = [mnist1d(), protein_windows(48 if args.quick else 190)]
    if args.quick:
        workloads[0] = workloads[0].__class__(name="mnist1d", x=workloads[0].x[:2400], y=workloads[0].y[:2400])
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = args.variants.split(",")
    rows = []
    print(f"{'dataset':<12}{'batch':>6}{'variant':>14}{'samples/s':>12}{'ratio':>8}{'peak RSS MB':>13}", flush=True)
    for dataset in workloads:
        folds = make_folds(CVSpec(splitter="stratified", n_splits=N_SPLITS, seed=0), dataset).folds
        build = cnn_builder(dataset.input_shape, dataset.n_classes)
        for batch_size in batch_sizes:
            baseline = None
            for variant in variants:
                if variant == "naive":
                    rate = measure_naive(dataset, folds, build, batch_size, epochs)
                else:
                    jit = {"engine": "auto", "engine-xla": "on", "engine-noxla": "off"}[variant]
                    rate = measure_engine(dataset, folds, build, batch_size, epochs, jit)
                baseline = baseline or rate
                row = {"dataset": dataset.name, "batch_size": batch_size, "variant": variant,
                       "samples_per_s": round(rate, 1), "peak_rss_mb": round(peak_rss_mb(), 1)}
                rows.append(row)
                print(f"{dataset.name:<12}{batch_size:>6}{variant:>14}{rate:>12.0f}{rate / baseline:>7.2f}x"
                      f"{row['peak_rss_mb']:>13.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
