"""CV training throughput: the naive per-fold `model.fit` workflow vs the foldsweep engine,
unfused (one compiled loop per fold) and fused (all folds in one execution), one training step
per compiled launch or 8 unrolled (`-x8`).

Same process, same data, same folds, same model and epochs. samples/s counts the CV training
samples of all folds per second with compilation excluded: for every variant the first epoch
(tracing and compilation) is timed apart and the rate comes from the epochs after it. Run-to-run
noise on a shared 2-core machine reaches 30%, so the variants are measured in turn, --repeats
times, and each row is the median. `vs unfused` compares a fused variant with the unfused one of
the same launch size (fused-x8 with engine-x8); compile_s is the trial's compilation seconds.

    .venv/bin/python -m benchmarks.cv_throughput [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
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


def measure_naive(dataset, folds, build, batch_size: int, epochs: int) -> tuple[float, float]:
    samples = seconds = 0.0
    for k, fold in enumerate(folds):
        epoch_seconds, _ = naive_fold_fit(build, dataset.x[fold.train], dataset.y[fold.train],
                                          dataset.x[fold.val], dataset.y[fold.val],
                                          batch_size=batch_size, epochs=epochs, seed=k)
        samples += len(fold.train) * (epochs - 1)
        seconds += sum(epoch_seconds[1:])
    return samples / seconds, float("nan")


# variant -> (train.jit_compile, train.fused, train.steps_per_launch)
ENGINE_VARIANTS = {"engine": ("auto", "off", 1), "fused": ("auto", "on", 1), "auto": ("auto", "auto", "auto"),
                   "engine-x8": ("auto", "off", 8), "fused-x8": ("auto", "on", 8),
                   "engine-xla": ("on", "off", 1), "engine-noxla": ("off", "off", 1),
                   "fused-xla": ("on", "on", 1), "fused-noxla": ("off", "on", 1)}


def measure_engine(dataset, folds, build, batch_size: int, epochs: int, variant: str) -> tuple[float, float]:
    jit_compile, fused, steps_per_launch = ENGINE_VARIANTS[variant]
    trainer = FoldTrainer(build, {}, TrainingParams(batch_size=batch_size, learning_rate=1e-3, optimizer="adam"),
                          data=resident_data(dataset.fingerprint, dataset.x, dataset.y), folds=folds, seed=0,
                          jit_compile=jit_compile, fused=fused, steps_per_launch=steps_per_launch,
                          planned_epochs=epochs)
    for _ in range(epochs):
        result = trainer.run_epoch()
    keras.backend.clear_session()
    return result["train_samples_per_s"], result["compile_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data and fewer epochs (under two minutes)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    parser.add_argument("--batch-sizes", default="8,64,256")
    parser.add_argument("--datasets", default="mnist1d,protein",
                        help="comma list of mnist1d, protein (TensorFlow keeps every compiled XLA program until "
                             "the process ends, so long runs can be split by dataset and batch size)")
    parser.add_argument("--repeats", type=int, help="measurements per variant, interleaved; the median is kept "
                                                    "(default 3, 1 with --quick)")
    parser.add_argument("--variants", default="naive,engine,fused,engine-x8,fused-x8",
                        help="comma list of naive, " + ", ".join(ENGINE_VARIANTS) + " (engine = unfused, auto = "
                             "what a sweep picks; -xla/-noxla force XLA on or off)")
    parser.add_argument("--dropout", action="store_true",
                        help="add a Dropout layer to the CNN (random layers: XLA off on CPU)")
    args = parser.parse_args(argv)

    epochs = 2 if args.quick else 3
    repeats = args.repeats or (1 if args.quick else 3)
    chosen = args.datasets.split(",")
    workloads = []
    if "mnist1d" in chosen:
        workloads.append(mnist1d())
        if args.quick:
            workloads[0] = workloads[0].__class__(name="mnist1d", x=workloads[0].x[:2400], y=workloads[0].y[:2400])
    if "protein" in chosen:
        workloads.append(protein_windows(48 if args.quick else 190))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = args.variants.split(",")
    rows = []
    print(f"{'dataset':<12}{'batch':>6}{'variant':>14}{'samples/s':>12}{'vs first':>10}{'vs engine':>11}"
          f"{'vs unfused':>12}{'compile_s':>11}{'peak RSS MB':>13}", flush=True)
    for dataset in workloads:
        folds = make_folds(CVSpec(splitter="stratified", n_splits=N_SPLITS, seed=0), dataset).folds
        build = cnn_builder(dataset.input_shape, dataset.n_classes, dropout=0.2 if args.dropout else 0.0)
        for batch_size in batch_sizes:
            measured: dict[str, list[tuple[float, float]]] = {variant: [] for variant in variants}
            for _ in range(repeats):
                for variant in variants:
                    measure = measure_naive if variant == "naive" else partial(measure_engine, variant=variant)
                    measured[variant].append(measure(dataset, folds, build, batch_size, epochs))
            rates = {variant: float(np.median([rate for rate, _ in runs])) for variant, runs in measured.items()}
            for variant, rate in rates.items():
                first = rates[variants[0]]
                versus_engine = rate / rates["engine"] if "engine" in rates else float("nan")
                unfused = variant.replace("fused", "engine", 1) if variant.startswith("fused") else None
                versus_unfused = rate / rates[unfused] if unfused in rates else float("nan")
                compile_s = float(np.median([seconds for _, seconds in measured[variant]]))
                row = {"dataset": dataset.name, "batch_size": batch_size, "variant": variant,
                       "samples_per_s": round(rate, 1), "runs": [round(value, 1) for value, _ in measured[variant]],
                       "vs_first": round(rate / first, 3), "vs_engine": round(versus_engine, 3),
                       "vs_unfused": round(versus_unfused, 3), "compile_s": round(compile_s, 2),
                       "peak_rss_mb": round(peak_rss_mb(), 1)}
                rows.append(row)
                print(f"{dataset.name:<12}{batch_size:>6}{variant:>14}{rate:>12.0f}{rate / first:>9.2f}x"
                      f"{versus_engine:>10.2f}x{versus_unfused:>11.2f}x{compile_s:>11.1f}{row['peak_rss_mb']:>13.0f}",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
