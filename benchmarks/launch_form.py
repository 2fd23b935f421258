"""Unrolled against looped launches: 8 training steps in one XLA-compiled launch, written as 8
copies of the step (foldsweep's form: the step traced once and called 8 times, which XLA inlines)
or as a `tf.while_loop` over the 8 steps (one copy, compiled once), side by side in one run.

The step is the engine's: the plain CNN of `benchmarks.common` with Adam, its batch gathered from
device-resident data by an index vector. Each form is measured in a fresh process (its compile
seconds are the first launch's time, tracing included), in interleaved rounds; rows are medians.

    .venv/bin/python -m benchmarks.launch_form [--rounds 3] [--quick] [--json PATH]

``--quick``: MNIST-1D at batch 64 only, one round (a check that it runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

STEPS = 8
FORMS = ("unrolled", "looped")
REPO = Path(__file__).resolve().parents[1]


def measure_here(form: str, dataset_name: str, batch_size: int, cpus: int) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from benchmarks.common import cnn_builder, mnist1d, protein_windows

    tf.config.threading.set_intra_op_parallelism_threads(cpus)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    dataset = mnist1d() if dataset_name == "mnist1d" else protein_windows(48)
    features, labels = tf.constant(dataset.x, tf.float32), tf.constant(dataset.y, tf.int32)
    model = cnn_builder(dataset.input_shape, dataset.n_classes)(None)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)

    def step(indices):
        x, y = tf.gather(features, indices), tf.gather(labels, indices)
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))
        return value

    traced_step = tf.function(step, autograph=False)

    @tf.function(jit_compile=True, autograph=False)
    def unrolled(batches):
        return tf.add_n([traced_step(batches[j]) for j in range(STEPS)])

    @tf.function(jit_compile=True, autograph=False)
    def looped(batches):
        _, total = tf.while_loop(
            lambda j, total: j < STEPS,
            lambda j, total: (j + 1, total + step(tf.gather(batches, j))),
            (tf.constant(0), tf.constant(0.0)),
        )
        return total

    launch = unrolled if form == "unrolled" else looped
    order = np.random.default_rng(0).permutation(len(dataset.y))
    n_launches = len(order) // (STEPS * batch_size)
    batches = tf.constant(order[: n_launches * STEPS * batch_size].reshape(n_launches, STEPS, batch_size), tf.int32)
    started = time.perf_counter()
    launch(batches[0]).numpy()
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(1, n_launches):
        launch(batches[i]).numpy()
    steps = (n_launches - 1) * STEPS
    return {"us_per_step": (time.perf_counter() - started) / steps * 1e6, "compile_s": compile_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="MNIST-1D at batch 64, one round")
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # form dataset batch, in a child process
    args = parser.parse_args(argv)
    if args.measure:
        form, dataset, batch_size = args.measure
        print(json.dumps(measure_here(form, dataset, int(batch_size), args.cpus)))
        return 0
    rows = []
    print(
        f"{'dataset':<10}{'batch':>6}{'form':>10}{'us/step':>10}{'compile_s':>11}{'looped vs unrolled':>20}", flush=True
    )
    datasets, batch_sizes, rounds = (
        (("mnist1d",), (64,), 1) if args.quick else (("mnist1d", "protein"), (8, 64), args.rounds)
    )
    for dataset in datasets:
        for batch_size in batch_sizes:
            runs: dict[str, list[dict[str, Any]]] = {form: [] for form in FORMS}
            for _ in range(rounds):
                for form in FORMS:
                    command = [
                        sys.executable,
                        "-m",
                        "benchmarks.launch_form",
                        "--cpus",
                        str(args.cpus),
                        "--measure",
                        form,
                        dataset,
                        str(batch_size),
                    ]
                    finished = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
                    runs[form].append(json.loads(finished.stdout.strip().splitlines()[-1]))
            medians = {
                form: {key: float(np.median([run[key] for run in runs[form]])) for key in ("us_per_step", "compile_s")}
                for form in FORMS
            }
            for form in FORMS:
                slower = medians[form]["us_per_step"] / medians["unrolled"]["us_per_step"]
                row = {
                    "dataset": dataset,
                    "batch_size": batch_size,
                    "form": form,
                    **medians[form],
                    "per_step_vs_unrolled": slower,
                    "cpus": args.cpus,
                }
                rows.append(row)
                print(
                    f"{dataset:<10}{batch_size:>6}{form:>10}{row['us_per_step']:>10.0f}{row['compile_s']:>11.1f}"
                    f"{slower:>19.2f}x",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
