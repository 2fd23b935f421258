"""foldsweep trains what the researcher wrote: each honoured feature of a compiled Keras model,
trained through `foldsweep trial`, lands where Keras' own `model.fit` lands on the same folds, and
`fit` with the feature dropped lands far away (so that each case can fail).

Tolerance: `fit` is given exactly what foldsweep trains on: each fold model built under the
fold's seed, and each epoch the fold's batches in foldsweep's order (``epoch_order``), without
Keras' own shuffle, in one `fit` call over the epochs (``fit_on_foldsweeps_batches``). What is
left between the two is float rounding (XLA in Keras' step, not in foldsweep's here; another
summation order), which can flip a prediction that sits on the decision boundary: ``TOLERANCE`` =
0.01 is 6 of the 600 validation samples. Every dropped feature moves the CV mean by at least
``FAR`` = 0.15: a foldsweep that ignored the feature would land far outside the tolerance and fail.

BatchNormalization and Dropout are also compared with the folds stacked into one XLA program
(the layout foldsweep picks at small batches with one compute thread). BatchNormalization is
compared as the other features are. Dropout draws foldsweep's own numbers, not Keras' (same
distribution, another stream), so it is compared by what it does to training: the CV mean of the
training loss over every epoch, which Dropout raises. Keras' own fit, with the dropout stream
alone changed, spread by 0.005 (standard deviation of 6 streams; 0.336 to 0.351), while
dropping the Dropout moves it by 0.11: ``DROPOUT_TOLERANCE`` = 0.02 and ``DROPOUT_FAR`` = 0.05.

Two folds per case: each fold model is one more of Keras' traced `fit`s, which are most of this
module's time, and two already separate every feature from its dropped form.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import yaml
from helpers import binary_data
from typer.testing import CliRunner

from pipeline.cli import app

pytestmark = pytest.mark.training  # every test trains the same model with keras fit and with foldsweep

TOLERANCE = 0.01
# Regression scores are continuous: only float rounding separates foldsweep's step from fit's,
# and `trial` prints 4 decimals (hence the absolute 1e-4).
REGRESSION_TOLERANCE = 1e-3
PRINTED = 1e-4
REGRESSION_FAR = 0.3
FAR = 0.15
# The mean training loss of a trial whose only difference from fit's is float rounding.
LOSS_TOLERANCE = 1e-4
DROPOUT_TOLERANCE = 0.02
DROPOUT_FAR = 0.05
EPOCHS = 5
BATCH = 32

EXPERIMENT = '''
from pathlib import Path

import keras
from keras import layers

def body(units, activation, regularizer=None, penalty=False, batch_norm=False, dropout=0.0):
    stack = [layers.Conv1D(8, 3, activation=None if batch_norm else "relu", kernel_regularizer=regularizer)]
    if batch_norm:  # momentum 0.9: by epoch 5 the moving averages have caught up with the batches'
        stack += [layers.BatchNormalization(momentum=0.9), layers.Activation("relu")]
    stack.append(layers.Flatten())
    if dropout:
        stack.append(layers.Dropout(dropout))
    stack.append(layers.Dense(8, activation="relu", kernel_regularizer=regularizer))
    if penalty:
        stack.append(Penalty())
    stack.append(layers.Dense(units, activation=activation, kernel_regularizer=regularizer))
    return keras.Sequential(stack)  # no Input: built on the data's shape, as Keras' fit would


class Penalty(layers.Layer):
    """An extra loss term through the layer API (add_loss), as keras.io's guide writes one."""

    def call(self, x):
        self.add_loss(50.0 * keras.ops.mean(keras.ops.abs(x)))
        return x


def compiled(model, optimizer, loss, metrics=("accuracy",)):
    model.compile(optimizer=optimizer, loss=loss, metrics=list(metrics))
    return model


def schedule(hp):
    rate = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=10, decay_rate=0.001)
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(rate), "binary_crossentropy")


class Collapsing(keras.optimizers.schedules.LearningRateSchedule):
    """The ``schedule`` case's decay as a researcher's own class, written as keras.io's examples
    write theirs: with get_config, not registered with Keras."""

    def __init__(self, rate, steps, factor):
        self.rate, self.steps, self.factor = rate, steps, factor

    def __call__(self, step):
        return self.rate * keras.ops.power(self.factor, keras.ops.cast(step, "float32") / self.steps)

    def get_config(self):
        return {"rate": self.rate, "steps": self.steps, "factor": self.factor}


def own_schedule(hp):
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(Collapsing(0.01, 10, 0.001)), "binary_crossentropy")


def logits(hp):
    return compiled(body(2, None), keras.optimizers.Adam(0.01),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def logits_dropped(hp):
    return compiled(body(2, None), keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy())


def sigmoid(hp):
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(0.01), "binary_crossentropy")


def sigmoid_dropped(hp):  # one unit scored as classes (arg max) instead of by binary accuracy
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(0.01), "binary_crossentropy",
                    metrics=["sparse_categorical_accuracy"])


def logit_accuracy(hp):  # a linear unit read as logits, scored by the "accuracy" it compiles
    model = body(1, None)
    model.add(layers.Rescaling(0.1))  # logits near 0, where thresholds of 0 and of 0.5 part
    return compiled(model, keras.optimizers.Adam(0.001), keras.losses.BinaryCrossentropy(from_logits=True))


def regularizer(hp):
    return compiled(body(1, "sigmoid", keras.regularizers.l2(1.0)), keras.optimizers.Adam(0.01), "binary_crossentropy")


def add_loss(hp):
    return compiled(body(1, "sigmoid", penalty=True), keras.optimizers.Adam(0.01), "binary_crossentropy")


def loss_scaled(hp):  # fit scales the loss by the factor and the optimizer divides the gradients by it
    return compiled(body(1, "sigmoid"), keras.optimizers.SGD(0.5, loss_scale_factor=128.0), "binary_crossentropy")


def loss_scaled_dropped(hp):  # the gradients divided by the factor alone: SGD at 1/128 of the rate
    return compiled(body(1, "sigmoid"), keras.optimizers.SGD(0.5 / 128), "binary_crossentropy")


def decay_excluded(hp, exclude=True):  # AdamW told to leave the hidden layer and the head's kernel undecayed
    model = keras.Sequential([layers.Conv1D(8, 3, activation="relu"), layers.Flatten(),
                              layers.Dense(8, activation="relu", name="hidden"), layers.Dense(1, activation="sigmoid")])
    model.build((None, 16, 1))
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=2.0)
    if exclude:  # a name is searched for in the variable's full name, its layer's: hidden/kernel:0
        optimizer.exclude_from_weight_decay(var_list=[model.layers[-1].kernel], var_names=["hidden/"])
    return compiled(model, optimizer, "binary_crossentropy")


def decay_excluded_dropped(hp):
    return decay_excluded(hp, exclude=False)


def schedule_free(hp, built=True):  # built in build, as fit then trains it by its algorithm
    model = compiled(body(1, "sigmoid"), keras.optimizers.ScheduleFreeAdamW(0.01), "binary_crossentropy")
    if built:
        model.build((None, 16, 1))
        model.optimizer.build(model.trainable_variables)
    return model


def schedule_free_dropped(hp):  # built by fit inside its step: its momentum starts at the weights at every step
    return schedule_free(hp, built=False)


def accumulated(hp):  # an update every 4 steps with the mean of their gradients
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(0.01, gradient_accumulation_steps=4),
                    "binary_crossentropy")


def accumulated_clipped(hp):  # and that mean clipped, not each step's gradient
    return compiled(body(1, "sigmoid"), keras.optimizers.SGD(0.5, gradient_accumulation_steps=4, clipvalue=0.0005),
                    "binary_crossentropy")


def batch_norm(hp):
    return compiled(body(1, "sigmoid", batch_norm=True), keras.optimizers.Adam(0.01), "binary_crossentropy")


def dropout(hp):
    return compiled(body(1, "sigmoid", dropout=0.5), keras.optimizers.Adam(0.01), "binary_crossentropy")


def augmented(hp, augment=True):  # keras.io's augmentation in the model: each signal a 4x4 image, flipped
    # upside down (its bump moves from row 1 to row 2) and contrasted; then BatchNormalization
    images = [layers.RandomFlip("vertical"), layers.RandomContrast(0.5)] if augment else []
    stack = [layers.Reshape((4, 4, 1)), *images, layers.Reshape((16, 1)), *body(1, "sigmoid", batch_norm=True).layers]
    return compiled(keras.Sequential(stack), keras.optimizers.Adam(0.01), "binary_crossentropy")


def augmented_dropped(hp):
    return augmented(hp, augment=False)


class MCC(keras.metrics.Metric):
    """Matthews' correlation from the fold's confusion counts: a researcher's own stateful metric."""

    def __init__(self, name="mcc", **kwargs):
        super().__init__(name=name, **kwargs)
        self.counts = self.add_variable((4,), initializer="zeros", name="counts")

    def update_state(self, y_true, y_pred, sample_weight=None):
        truth = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "float32")
        said = keras.ops.cast(keras.ops.reshape(y_pred, (-1,)) > 0.5, "float32")
        self.counts.assign_add(keras.ops.stack([keras.ops.sum(truth * said), keras.ops.sum((1 - truth) * (1 - said)),
                                                keras.ops.sum((1 - truth) * said), keras.ops.sum(truth * (1 - said))]))

    def result(self):
        tp, tn, fp, fn = (self.counts[i] for i in range(4))
        return (tp * tn - fp * fn) / keras.ops.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn) + 1e-9)


def metrics(hp):
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(0.01), "binary_crossentropy",
                    metrics=("accuracy", keras.metrics.AUC(name="auc"), keras.metrics.TruePositives(name="tp"), MCC()))


def one_hot(hp):  # one-hot rows (keras.utils.to_categorical's), categorical_crossentropy, AUC and F1 over the rows
    return compiled(body(2, "softmax"), keras.optimizers.Adam(0.01), "categorical_crossentropy",
                    metrics=("accuracy", keras.metrics.AUC(name="auc"), keras.metrics.F1Score("macro", name="f1")))


def regression(hp):  # a float target per sample, regressed with MSE, scored by MAE, RMSE and R2 too
    return compiled(body(1, None), keras.optimizers.Adam(0.01), "mse",
                    metrics=("mae", keras.metrics.RootMeanSquaredError(), keras.metrics.R2Score()))


class BatchMeanPenalty(layers.Layer):
    """A penalty on each batch's mean activation (add_loss): not a sum over samples, so it is what
    evaluate computes on each batch of the trial's size."""

    def call(self, x):
        self.add_loss(5.0 * keras.ops.mean(keras.ops.square(keras.ops.mean(x, axis=0))))
        return x


class EveryCall(layers.Layer):
    """State a layer changes at every call, inference too: a BatchNormalization called in training
    mode (batch statistics, moving averages moved) and a count of calls that shifts the outputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.BatchNormalization()

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        return self.norm(x, training=True) + 0.5 * keras.ops.sin(self.calls)


def every_call(hp):
    model = keras.Sequential([layers.Conv1D(8, 3), EveryCall(), layers.Activation("relu"), layers.Flatten(),
                              layers.Dense(1, activation="sigmoid")])
    return compiled(model, keras.optimizers.Adam(0.01), "binary_crossentropy")


def loss_terms(hp):  # the weights' L2, an activity regularizer, a batch penalty; a metric named accuracy
    model = keras.Sequential([layers.Conv1D(8, 3, activation="relu", kernel_regularizer=keras.regularizers.l2(0.05)),
                              layers.Flatten(),
                              layers.Dense(8, activation="relu", activity_regularizer=keras.regularizers.l1(0.01)),
                              BatchMeanPenalty(),
                              layers.Dense(1, activation="sigmoid")])
    return compiled(model, keras.optimizers.Adam(0.01), "binary_crossentropy",
                    metrics=(keras.metrics.BinaryAccuracy(name="accuracy", threshold=0.8),))


def huber(hp):  # the same regression under Huber's loss, scored by log-cosh and MAE
    return compiled(body(1, None), keras.optimizers.Adam(0.01), keras.losses.Huber(delta=0.5),
                    metrics=(keras.metrics.LogCoshError(name="logcosh"), "mae"))


def log_cosh(hp):  # and under log-cosh's
    return compiled(body(1, None), keras.optimizers.Adam(0.01), "log_cosh", metrics=("mae",))


def per_position(hp):  # a label per position of the window, padded positions -1 and ignored by the loss
    model = keras.Sequential([layers.Conv1D(8, 3, padding="same", activation="relu"),
                              layers.Conv1D(2, 1, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=-1), metrics=["accuracy"])
    return model


def backbone():
    inputs = keras.Input(shape=(16, 1))
    x = layers.BatchNormalization(name="backbone_bn")(layers.Conv1D(8, 3, name="backbone_conv")(inputs))
    return keras.Model(inputs, layers.Activation("relu")(x), name="backbone")


def transfer(hp, trainable=False):  # keras.io's transfer learning guide: a frozen base, called in inference
    base = backbone()
    base.load_weights(str(Path(__file__).parent / "backbone.weights.h5"))
    base.trainable = trainable
    inputs = keras.Input(shape=(16, 1))
    x = layers.Flatten()(base(inputs, training=False))
    return compiled(keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x)), keras.optimizers.Adam(0.01),
                    "binary_crossentropy")


def transfer_dropped(hp):  # the base trains, its BatchNormalization on the batches' statistics
    return transfer(hp, trainable=True)


# Without their feature these are the plain sigmoid model: one name, so that its fit is made once.
schedule_dropped = regularizer_dropped = add_loss_dropped = batch_norm_dropped = dropout_dropped = sigmoid
accumulated_dropped = own_schedule_dropped = sigmoid
'''

FEATURES = ("schedule", "own_schedule", "logits", "sigmoid", "regularizer", "add_loss", "loss_scaled", "schedule_free")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parity")
    x, y = binary_data()
    np.savez(directory / "binary.npz", x=x, y=y)
    # Far from zero mean: the model learns where BatchNormalization centres its inputs, and its
    # validation uses the moving averages, which are right only if their momentum is.
    np.savez(directory / "shifted.npz", x=x + 20.0, y=y)
    # A continuous target: the bump's height, with noise; an int cast would keep mostly 0 and -1.
    target = (x[:, 4:8, 0].mean(axis=1) + 0.1 * np.random.default_rng(1).normal(size=len(x))).astype(np.float32)
    np.savez(directory / "regress.npz", x=x, y=target)
    np.savez(directory / "onehot.npz", x=x, y=np.eye(2, dtype=np.float32)[y])
    # A label per position (the signal's sign there), windows of 8 to 16 positions padded with -1.
    labels = (x[:, :, 0] > 0).astype(np.int32)
    lengths = np.random.default_rng(2).integers(8, 17, len(x))
    labels[np.arange(16)[None, :] >= lengths[:, None]] = -1
    np.savez(directory / "positions.npz", x=x, y=labels)
    (directory / "parity.py").write_text(EXPERIMENT)
    _write_backbone_weights(directory / "backbone.weights.h5")
    return directory


def _write_backbone_weights(path: Path) -> None:
    """The frozen base's weights file: a random convolution and moving statistics far from any
    batch's (mean 1, variance 9), so that a BatchNormalization run on the batches' statistics
    instead of these trains another head."""
    import keras

    from pipeline.inputs.hypermodel import load_builder

    keras.utils.set_random_seed(5)
    base = load_builder(path.parent / "parity.py", "backbone")()
    bn = base.get_layer("backbone_bn")
    bn.moving_mean.assign(np.ones(8, np.float32))
    bn.moving_variance.assign(np.full(8, 9.0, np.float32))
    base.save_weights(str(path))
    keras.backend.clear_session()


def spec_for(
    directory: Path,
    builder: str,
    *,
    dataset: str = "binary.npz",
    jit_compile: bool | str = False,
    splitter: str = "stratified",
    **train: Any,
) -> Path:
    path = directory / f"{builder}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": f"parity-{builder}",
                "experiment": f"parity.py:{builder}",
                "dataset": dataset,
                "cv": {"splitter": splitter, "n_splits": 2, "seed": 0},
                "search": {"space": {"batch_size": BATCH}},
                # Compilation is not what is compared here; without XLA the cases run in seconds.
                # More epochs than are trained: `trial --epochs` says how many, in its header too.
                "train": {"epochs": EPOCHS + 4, "seed": 0, "jit_compile": jit_compile, **train},
                "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
            }
        )
    )
    return path


def foldsweep_cv_mean(spec: Path) -> float:
    """The last epoch's mean_val_accuracy that `foldsweep trial` prints (in this process, where
    the test's own `fit` started TensorFlow: ``threads_kept``)."""
    result = CliRunner().invoke(app, ["trial", str(spec), "--epochs", str(EPOCHS)])
    assert result.exit_code == 0, result.output
    assert re.search(rf"\bepochs={EPOCHS}\b", result.output.splitlines()[0]), result.output
    epochs = re.findall(r"^epoch (\d+):.*mean_val_accuracy (\S+)$", result.output, re.MULTILINE)
    assert [int(epoch) for epoch, _ in epochs] == list(range(1, EPOCHS + 1)), result.output
    return float(epochs[-1][1])


class Fitted(NamedTuple):
    """What a CV training reached: the last epoch's mean validation accuracy, and the mean training
    loss over every fold and epoch."""

    val_accuracy: float
    train_loss: float


# Keras' fits by the name of the function that builds the model (aliases share one) and the data.
KERAS_FITS: dict[tuple[str, str], Fitted] = {}


def keras_fit_cv_mean(spec: Path, builder: str) -> float:
    """Keras' own fit of ``builder`` on the sweep's folds, each fold model built as foldsweep
    builds it (same seed, same default hyperparameters) and fed foldsweep's batches."""
    return keras_fit(spec, builder).val_accuracy


def keras_fit(spec: Path, builder: str) -> Fitted:
    from pipeline.inputs.hypermodel import load_builder

    build = load_builder(spec.parent / "parity.py", builder)
    key = (build.__name__, yaml.safe_load(spec.read_text())["dataset"])
    if key not in KERAS_FITS:
        KERAS_FITS[key] = _keras_fit(spec, build.__name__)
    return KERAS_FITS[key]


def fit_on_foldsweeps_batches(model, data, fold, seed: int, *, cast=None, **fit_arguments) -> dict[str, list[float]]:
    """Keras' fit of ``model`` on the fold's training samples (their targets through ``cast`` if
    given) for ``EPOCHS`` epochs in one call, each epoch's batches in foldsweep's order (a
    PyDataset told the epoch as it begins); its history, a list per logged name, an entry per
    epoch."""
    import keras

    from pipeline.base.tensorflow_private import use_graph_optimizer
    from pipeline.engine.fold_engine import epoch_order

    # Keras' fit as a researcher's own process runs it: TensorFlow's graph optimizer as it is by
    # default, whichever foldsweep's trial before it in this process had.
    use_graph_optimizer(light=False)
    orders = [epoch_order(fold.train, seed=seed, epoch=epoch) for epoch in range(EPOCHS)]

    class Batches(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = 0

        def __len__(self) -> int:
            return -(-len(fold.train) // BATCH)

        def __getitem__(self, index: int):
            order = orders[self.epoch][index * BATCH : (index + 1) * BATCH]
            return data.x[order], data.y[order] if cast is None else cast(data.y[order])

    batches = Batches()

    class EpochOrder(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs=None) -> None:
            batches.epoch = epoch

    return model.fit(
        batches, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[EpochOrder()], **fit_arguments
    ).history


def _keras_fit(spec: Path, builder: str) -> Fitted:
    scores, losses = [], []
    for _, model, (x_val, y_val), history in keras_fold_fits(spec, builder):
        losses += history["loss"]
        validated = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)
        scores.append(validated.get("accuracy", validated.get("sparse_categorical_accuracy")))
    return Fitted(float(np.mean(scores)), float(np.mean(losses)))


@pytest.mark.parametrize("feature", FEATURES)
def test_an_honoured_feature_trains_as_keras_fit_does(workspace, feature, threads_kept):
    spec = spec_for(workspace, feature)
    ours = foldsweep_cv_mean(spec)
    keras_with = keras_fit_cv_mean(spec, feature)
    keras_without = keras_fit_cv_mean(spec, f"{feature}_dropped")
    assert abs(ours - keras_with) <= TOLERANCE, (feature, ours, keras_with, keras_without)
    assert abs(keras_without - keras_with) >= FAR, (feature, ours, keras_with, keras_without)


def foldsweep_in_layout(spec: Path, builder: str, layout: str = "stacked") -> tuple[Fitted, Any]:
    """The spec's trial trained in ``layout`` (forced: stacked by default, which on two compute
    threads the plan would train side by side), through the engine a trial runs; and its trainer."""
    from dataclasses import replace

    from pipeline.checks import prepare
    from pipeline.engine.recipe import TrainingRecipe
    from pipeline.engine.resident import resident_data
    from pipeline.engine.trainer import build_trainer
    from pipeline.inputs.hypermodel import load_builder
    from pipeline.inputs.spec import load_spec

    prepared = prepare(load_spec(spec))
    recipe = TrainingRecipe.from_spec(prepared.spec)
    recipe = replace(recipe, choices=replace(recipe.choices, layout=layout))
    data = prepared.dataset
    trainer = build_trainer(
        load_builder(spec.parent / "parity.py", builder),
        {"batch_size": BATCH},
        recipe,
        data=resident_data(data.fingerprint, data.x, data.y),
        folds=prepared.folds.folds,
        planned_epochs=EPOCHS,
    )
    reports = [trainer.run_epoch().report() for _ in range(EPOCHS)]
    folds = range(len(prepared.folds.folds))
    return Fitted(
        float(np.mean([reports[-1][f"split{k}_val_accuracy"] for k in folds])),
        float(np.mean([report[f"split{k}_train_loss"] for report in reports for k in folds])),
    ), trainer


def assert_stacked_forward_is_each_folds_own(trainer, spec: Path) -> None:
    """The trained fold models: their stacked forward pass (outputs, moving statistics, random
    generator states, loss terms) equals each one's own, on each fold's first training batch."""
    from pipeline.checks import prepare
    from pipeline.engine.stacked import forward_mismatch
    from pipeline.inputs.spec import load_spec

    prepared = prepare(load_spec(spec))
    batches = [prepared.dataset.x[fold.train[:BATCH]] for fold in prepared.folds.folds]
    assert forward_mismatch(trainer.models, np.concatenate(batches)) is None


def test_batch_normalization_stacked_trains_as_keras_fit_does(workspace):
    spec = spec_for(workspace, "batch_norm", dataset="shifted.npz", jit_compile="auto")
    ours, trainer = foldsweep_in_layout(spec, "batch_norm")
    keras_with = keras_fit(spec, "batch_norm").val_accuracy
    keras_without = keras_fit(spec, "batch_norm_dropped").val_accuracy
    assert trainer.plan.layout == "stacked" and trainer.plan.jit_compile, trainer.plan
    assert abs(ours.val_accuracy - keras_with) <= TOLERANCE, (ours, keras_with, keras_without)
    assert abs(keras_without - keras_with) >= FAR, (ours, keras_with, keras_without)
    assert_stacked_forward_is_each_folds_own(trainer, spec)


def test_an_optimizer_that_accumulates_gradients_trains_stacked_as_keras_fit_does(workspace):
    """gradient_accumulation_steps updates each weight from its own accumulated gradients, so the
    folds stack (only clipping keeps them side by side, the case below); the rounding of one XLA
    program is all that separates the training losses."""
    spec = spec_for(workspace, "accumulated", jit_compile="auto")
    ours, trainer = foldsweep_in_layout(spec, "accumulated")
    keras_with, keras_without = keras_fit(spec, "accumulated"), keras_fit(spec, "accumulated_dropped")
    assert trainer.plan.layout == "stacked", trainer.plan
    assert abs(ours.train_loss - keras_with.train_loss) <= LOSS_TOLERANCE, (ours, keras_with, keras_without)
    assert abs(keras_without.train_loss - keras_with.train_loss) >= DROPOUT_FAR, (ours, keras_with, keras_without)


def test_clipping_of_accumulated_gradients_trains_side_by_side_as_keras_fit_clips_them(workspace):
    """Keras clips the mean of the accumulated gradients as it applies them; a stacked step clips
    each step's gradient before the optimizer sees it, which lands apart, so these folds train
    side by side, through the optimizer's own clipping."""
    spec = spec_for(workspace, "accumulated_clipped", jit_compile="auto")
    ours, trainer = foldsweep_in_layout(spec, "accumulated_clipped")
    keras_with = keras_fit(spec, "accumulated_clipped")
    assert trainer.plan.layout == "side_by_side", trainer.plan
    assert "gradient_accumulation_steps" in trainer.plan.reason, trainer.plan.reason
    assert abs(ours.train_loss - keras_with.train_loss) <= LOSS_TOLERANCE, (ours, keras_with)
    assert abs(ours.val_accuracy - keras_with.val_accuracy) <= TOLERANCE, (ours, keras_with)


@pytest.mark.parametrize("layout", ["stacked", "side_by_side"])
def test_variables_left_out_of_weight_decay_train_as_keras_fit_trains_them(workspace, layout):
    """exclude_from_weight_decay(var_list=, var_names=) is not in the optimizer's config, from
    which each fold's optimizer is made: foldsweep carries it over as the variables' positions in
    the model, in each fold's optimizer and in the stacked one (whose variables' names carry no
    layer, so a layer's name would find none of them)."""
    spec = spec_for(workspace, "decay_excluded", jit_compile="auto")
    ours, trainer = foldsweep_in_layout(spec, "decay_excluded", layout)
    keras_with, keras_without = keras_fit(spec, "decay_excluded"), keras_fit(spec, "decay_excluded_dropped")
    assert trainer.plan.layout == layout and trainer.plan.decay_exclusions, trainer.plan
    assert abs(ours.train_loss - keras_with.train_loss) <= LOSS_TOLERANCE, (ours, keras_with, keras_without)
    assert abs(keras_without.train_loss - keras_with.train_loss) >= 100 * LOSS_TOLERANCE, (keras_with, keras_without)


def test_a_loss_scale_factor_trains_stacked_as_keras_fit_does(workspace):
    spec = spec_for(workspace, "loss_scaled", jit_compile="auto")
    ours, trainer = foldsweep_in_layout(spec, "loss_scaled")
    keras_with, keras_without = keras_fit(spec, "loss_scaled"), keras_fit(spec, "loss_scaled_dropped")
    assert trainer.plan.layout == "stacked" and trainer.plan.loss_scale_factor == 128.0, trainer.plan
    assert abs(ours.val_accuracy - keras_with.val_accuracy) <= TOLERANCE, (ours, keras_with, keras_without)
    assert abs(keras_without.val_accuracy - keras_with.val_accuracy) >= FAR, (ours, keras_with, keras_without)


def trained_stacked_by_statistics(workspace, builder: str) -> tuple[Path, Any]:
    """The builder's random layers draw foldsweep's numbers (another stream than Keras'), so a
    stacked trial is compared with Keras' fit by what they do to training: the training loss,
    which they raise (``{builder}_dropped`` without them lands lower); validation runs without
    them in both, so the CV means agree give or take what another stream changes in training.
    The spec and the trainer."""
    spec = spec_for(workspace, builder, jit_compile="auto")
    ours, trainer = foldsweep_in_layout(spec, builder)
    keras_with, keras_without = keras_fit(spec, builder), keras_fit(spec, f"{builder}_dropped")
    assert trainer.plan.layout == "stacked" and trainer.plan.random_draws == "counter", trainer.plan
    assert abs(ours.train_loss - keras_with.train_loss) <= DROPOUT_TOLERANCE, (ours, keras_with, keras_without)
    assert keras_with.train_loss - keras_without.train_loss >= DROPOUT_FAR, (ours, keras_with, keras_without)
    assert abs(ours.val_accuracy - keras_with.val_accuracy) <= 3 * TOLERANCE, (ours, keras_with)
    assert_stacked_forward_is_each_folds_own(trainer, spec)
    return spec, trainer


def test_dropout_stacked_trains_as_keras_fit_does_by_its_statistics(workspace):
    trained_stacked_by_statistics(workspace, "dropout")


def test_augmentation_with_batch_norm_stacked_trains_as_keras_fit_does_by_its_statistics(workspace):
    """RandomFlip and RandomContrast, as Dropout (``trained_stacked_by_statistics``)."""
    import keras
    from keras import layers

    from pipeline.checks import prepare
    from pipeline.inputs.spec import load_spec

    spec, trainer = trained_stacked_by_statistics(workspace, "augmented")
    # Each fold's validation loss is Keras' evaluate of its trained model, the images as they are;
    # with the augmentation applied at validation it would land apart.
    prepared = prepare(load_spec(spec))
    for k, fold in enumerate(prepared.folds.folds):
        model, x_val, y_val = trainer.models[k], prepared.dataset.x[fold.val], prepared.dataset.y[fold.val]
        evaluated = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)["loss"]
        augmented = x_val
        for layer in model.layers:
            augmented = layer(augmented, training=isinstance(layer, layers.RandomFlip | layers.RandomContrast))
        augmented_loss = float(np.mean(keras.losses.binary_crossentropy(y_val[:, None], augmented)))
        assert trainer.engines[k].evaluate(EPOCHS)[0] == pytest.approx(evaluated, rel=1e-4), k
        assert abs(augmented_loss - evaluated) >= 0.1 * evaluated, (k, augmented_loss, evaluated)


COMPILED_METRICS = ("auc", "tp", "mcc")


def trial_fold_scores(spec: Path) -> dict[tuple[int, str], float]:
    """{(fold, name): val_<name>} of the last epoch `foldsweep trial` prints."""
    result = CliRunner().invoke(app, ["trial", str(spec), "--epochs", str(EPOCHS)])
    assert result.exit_code == 0, result.output
    last = [line for line in result.output.splitlines() if line.startswith(f"epoch {EPOCHS}:")][0]
    scores = {}
    for part in last.split(" | "):
        fold = re.match(r"(?:epoch \d+: )?fold (\d+) ", part)
        if fold:
            scores.update(
                {(int(fold.group(1)), name): float(value) for name, value in re.findall(r"val_(\w+) (\S+)", part)}
            )
    return scores


def keras_fold_fits(spec: Path, builder: str, *, cast=None, validate: bool = False, **fit_arguments):
    """Per fold of the spec: Keras' fit of the builder's model on foldsweep's batches
    (``fit_on_foldsweeps_batches``; the targets through ``cast`` if given, the fold's validation
    samples as validation_data with ``validate``); yields the fold's number, its model, its
    validation (x, y) and the fit's history."""
    import keras

    from pipeline.checks import prepare
    from pipeline.engine.fold_engine import fold_seed
    from pipeline.inputs.hypermodel import build_model, load_builder
    from pipeline.inputs.spec import load_spec

    prepared = prepare(load_spec(spec))
    data = prepared.dataset
    build = load_builder(spec.parent / "parity.py", builder)
    for k, fold in enumerate(prepared.folds.folds):
        seed = fold_seed(prepared.spec.train.seed, k)
        keras.utils.set_random_seed(seed)
        model = build_model(build, {}, input_shape=data.input_shape)
        validation = (data.x[fold.val], data.y[fold.val])
        history = fit_on_foldsweeps_batches(
            model,
            data,
            fold,
            seed,
            cast=cast,
            validation_data=validation if validate else None,
            **fit_arguments,
        )
        yield k, model, validation, history
    keras.backend.clear_session()


def keras_fold_scores(spec: Path, builder: str, *, cast=None) -> list[dict[str, float]]:
    """Keras' fit of each fold on foldsweep's batches (the targets through ``cast`` if given), then
    its evaluate on the fold's validation samples."""
    return [
        model.evaluate(*validation, batch_size=BATCH, verbose=0, return_dict=True)
        for _, model, validation, _ in keras_fold_fits(spec, builder, cast=cast)
    ]


@pytest.mark.parametrize(
    "builder, names",
    [
        ("regression", ("loss", "mae", "root_mean_squared_error", "r2_score")),
        ("huber", ("loss", "logcosh", "mae")),
        ("log_cosh", ("loss", "mae")),
    ],
)
def test_a_regression_cnn_trains_and_scores_as_keras_fit_and_evaluate(workspace, threads_kept, builder, names):
    """Float targets under MSE, Huber and log-cosh, and their compiled metrics per fold, as Keras'
    fit + evaluate give them; the same model trained on the targets cast to int (what foldsweep's
    int labels did) lands far."""
    spec = spec_for(workspace, builder, dataset="regress.npz", splitter="kfold", metric="mae")
    ours = trial_fold_scores(spec)
    theirs = keras_fold_scores(spec, builder)
    truncated = keras_fold_scores(spec, builder, cast=lambda y: y.astype(np.int32)) if builder == "regression" else None
    for k, scores in enumerate(theirs):
        for name in names:
            assert ours[(k, name)] == pytest.approx(scores[name], rel=REGRESSION_TOLERANCE, abs=PRINTED), (
                k,
                name,
                ours,
                scores,
            )
        if truncated is not None:
            assert abs(truncated[k]["mae"] - scores["mae"]) >= REGRESSION_FAR * scores["mae"], (truncated[k], scores)


def test_every_compiled_metric_is_each_folds_own_over_the_whole_fold_as_keras_evaluate(workspace, threads_kept):
    """AUC, TruePositives and a researcher's Metric subclass, as `trial` prints them per fold,
    equal what Keras' evaluate gives on each fold after its own fit; a mean of batch means (here
    of TruePositives, a count) would land far away."""
    spec = spec_for(workspace, "metrics")
    ours = trial_fold_scores(spec)
    for k, model, (x_val, y_val), _ in keras_fold_fits(spec, "metrics"):
        theirs = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)
        for name in COMPILED_METRICS:
            assert abs(ours[(k, name)] - theirs[name]) <= TOLERANCE * max(1.0, abs(theirs[name])), (
                k,
                name,
                ours,
                theirs,
            )
        batch_means = np.mean(
            [
                model.evaluate(x_val[i : i + BATCH], y_val[i : i + BATCH], verbose=0, return_dict=True)["tp"]
                for i in range(0, len(y_val), BATCH)
            ]
        )
        assert abs(batch_means - theirs["tp"]) >= 0.5 * theirs["tp"], (batch_means, theirs["tp"])


@pytest.mark.parametrize(
    ("dataset", "said"),
    [
        ("onehot.npz", "labels: one-hot rows of 2 classes, split by class"),
        # Integer labels under a loss that takes rows: fit refuses them, and fit on to_categorical(y)
        # is what foldsweep gives loss and metrics alike (the metrics given the integers scored 0).
        ("binary.npz", "labels: integer classes, given to the loss categorical_crossentropy and the metrics as"),
    ],
    ids=["rows", "integers"],
)
def test_one_hot_labels_train_a_compiled_categorical_crossentropy_and_score_as_keras_fit(
    workspace, threads_kept, dataset, said
):
    """Labels stored as one-hot rows, or integer labels under a loss that takes rows, a compiled
    categorical_crossentropy, AUC and F1: each fold's loss, accuracy, AUC and F1 as Keras' fit and
    evaluate give them on the rows. Keras' AUC takes the rows: given the class indices foldsweep
    holds instead, it cannot score (the trial fails)."""

    spec = spec_for(workspace, "one_hot", dataset=dataset)
    validated = CliRunner().invoke(app, ["validate", str(spec)])
    assert validated.exit_code == 0 and said in " ".join(validated.output.split()), validated.output
    ours = trial_fold_scores(spec)

    def rows(y):
        return np.eye(2, dtype=np.float32)[y]

    for k, model, (x_val, y_val), _ in keras_fold_fits(spec, "one_hot", cast=rows):
        theirs = model.evaluate(x_val, rows(y_val), batch_size=BATCH, verbose=0, return_dict=True)
        for name in ("loss", "accuracy", "auc", "f1"):
            assert abs(ours[(k, name)] - theirs[name]) <= TOLERANCE, (k, name, ours, theirs)


def test_the_accuracy_a_logit_head_compiles_is_each_folds_as_keras_evaluate_scores_it(workspace, threads_kept):
    """A one-unit head read as logits, compiling "accuracy": Keras scores it with BinaryAccuracy's
    threshold, 0.5, whatever the outputs are, and so does each fold's val_accuracy (validate warns
    of it). Counted above 0, as a probability above 0.5 would be, the folds land far away."""
    spec = spec_for(workspace, "logit_accuracy")
    validated = CliRunner().invoke(app, ["validate", str(spec)])
    assert validated.exit_code == 0, validated.output
    assert "Keras' accuracy counts an output above 0.5 as class 1" in validated.output
    ours = trial_fold_scores(spec)
    for k, model, (x_val, y_val), _ in keras_fold_fits(spec, "logit_accuracy"):
        theirs = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)["accuracy"]
        assert abs(ours[(k, "accuracy")] - theirs) <= TOLERANCE, (k, ours, theirs)
        signs = float(np.mean((model.predict(x_val, verbose=0)[:, 0] > 0) == y_val))
        assert abs(signs - theirs) >= FAR, (k, signs, theirs)


def test_the_validation_loss_has_the_models_loss_terms_and_a_metric_named_accuracy_is_the_accuracy(
    workspace, threads_kept
):
    """Keras' evaluate adds the model's loss terms to each batch's loss (the weights' L2, an activity
    regularizer, a penalty on each batch's mean activation) and reports the metric the model
    compiles as "accuracy" (here thresholded at 0.8): so do each fold's val_loss and val_accuracy.
    The loss without the terms, and the accuracy at 0.5, land far away."""
    spec = spec_for(workspace, "loss_terms")
    ours = trial_fold_scores(spec)
    for k, model, (x_val, y_val), _ in keras_fold_fits(spec, "loss_terms"):
        theirs = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)
        assert ours[(k, "loss")] == pytest.approx(theirs["loss"], rel=REGRESSION_TOLERANCE, abs=PRINTED), (k, ours)
        assert abs(ours[(k, "accuracy")] - theirs["accuracy"]) <= TOLERANCE, (k, ours, theirs)
        predicted = model.predict(x_val, batch_size=BATCH, verbose=0)[:, 0]
        data_loss = float(np.mean(keras_binary_crossentropy(y_val, predicted)))
        assert theirs["loss"] - data_loss >= 0.1 * data_loss, (k, data_loss, theirs)
        at_half = float(np.mean((predicted > 0.5) == y_val))
        assert abs(at_half - theirs["accuracy"]) >= FAR / 3, (k, at_half, theirs)


def test_a_model_that_changes_its_state_at_every_call_is_validated_batch_by_batch_as_keras_evaluate(
    workspace, threads_kept
):
    """A layer that normalizes every batch by its own statistics and counts its calls, inference
    too: Keras' evaluate runs the fold's batches one after another, each on the state the one before
    left, and foldsweep's validation gives its numbers; the model's state is what fit left it at
    every step (foldsweep's own looks at the model leave none of it behind)."""
    spec = spec_for(workspace, "every_call")
    ours = trial_fold_scores(spec)
    # fit validates every epoch, as foldsweep does (those calls count too): its last validation.
    for k, _, _, history in keras_fold_fits(spec, "every_call", validate=True):
        theirs = {name: history[f"val_{name}"][-1] for name in ("loss", "accuracy")}
        assert ours[(k, "loss")] == pytest.approx(theirs["loss"], rel=REGRESSION_TOLERANCE, abs=PRINTED), (k, ours)
        assert abs(ours[(k, "accuracy")] - theirs["accuracy"]) <= TOLERANCE, (k, ours, theirs)


def keras_binary_crossentropy(labels: np.ndarray, probabilities: np.ndarray) -> np.ndarray:
    import keras

    return keras.ops.convert_to_numpy(
        keras.losses.binary_crossentropy(labels[:, None].astype(np.float32), probabilities[:, None])
    )


CLASS_WEIGHT = {0: 1.0, 1: 5.0}


def test_class_weights_train_as_keras_fit_class_weight(workspace, threads_kept):
    """train.class_weight weighs each training sample's loss as fit(class_weight=...) does: the
    training loss (weighted) and the validation loss (unweighted) per fold land where Keras' own
    land; fit without the weights trains a loss far from it."""
    from pipeline.checks import prepare
    from pipeline.inputs.spec import load_spec

    spec = spec_for(workspace, "sigmoid", class_weight=CLASS_WEIGHT)
    result = CliRunner().invoke(app, ["trial", str(spec), "--epochs", str(EPOCHS)])
    assert result.exit_code == 0, result.output
    ours = {}
    for line in result.output.splitlines():
        epoch = re.match(r"epoch (\d+): ", line)
        if epoch:
            for k, train, val in re.findall(r"fold (\d+) train_loss (\S+) val_loss (\S+)", line):
                ours[(int(epoch.group(1)), int(k))] = (float(train), float(val))
    assert prepare(load_spec(spec)).spec.train.class_weight == CLASS_WEIGHT
    for weighted in (True, False):
        fits = keras_fold_fits(spec, "sigmoid", validate=True, class_weight=CLASS_WEIGHT if weighted else None)
        for k, _, _, history in fits:
            for epoch in range(EPOCHS):
                train, val = ours[(epoch + 1, k)]
                if weighted:
                    assert train == pytest.approx(history["loss"][epoch], rel=0.01, abs=PRINTED), (k, epoch, history)
                    assert val == pytest.approx(history["val_loss"][epoch], rel=0.01, abs=PRINTED), (k, epoch, history)
                elif epoch == 0:  # unweighted, the first epoch's training loss is a fraction of the weighted one
                    assert history["loss"][0] < 0.6 * train, (k, train, history)


def test_labels_per_position_with_ignored_padding_score_as_keras_fit_and_evaluate(workspace, threads_kept):
    """A [batch, L, classes] model with SparseCategoricalCrossentropy(ignore_class=-1): the
    per-fold validation loss (each batch's mean over the positions kept, as Keras reduces it) and
    the compiled accuracy equal Keras' fit + evaluate; the mean over every position, padding
    included, lands far away."""
    spec = spec_for(workspace, "per_position", dataset="positions.npz", splitter="kfold", metric="loss")
    ours = trial_fold_scores(spec)
    theirs = keras_fold_scores(spec, "per_position")
    data = np.load(workspace / "positions.npz")
    padded = float(np.mean(data["y"] == -1))
    assert padded > 0.2
    for k, scores in enumerate(theirs):
        for name in ("loss", "accuracy"):
            assert ours[(k, name)] == pytest.approx(scores[name], rel=REGRESSION_TOLERANCE, abs=2 * PRINTED), (
                k,
                name,
                ours,
                scores,
            )
        # A mean over every position (the padded ones adding 0) would be (1 - padded) of it.
        assert abs(ours[(k, "loss")] * (1 - padded) - scores["loss"]) >= 0.15 * scores["loss"]


def test_a_frozen_base_trains_as_keras_fit_trains_it_stacked_and_not(workspace, threads_kept):
    """keras.io's transfer learning: a base loaded from a weights file and frozen, its
    BatchNormalization in inference mode. Its weights are held once for every fold when stacked,
    and never move; the head lands where Keras' fit lands, side by side and stacked."""
    spec = spec_for(workspace, "transfer", jit_compile="auto")
    keras_with = keras_fit(spec, "transfer")
    keras_without = keras_fit(spec, "transfer_dropped")
    assert abs(foldsweep_cv_mean(spec) - keras_with.val_accuracy) <= TOLERANCE, (keras_with, keras_without)
    ours, trainer = foldsweep_in_layout(spec, "transfer")
    assert trainer.plan.layout == "stacked", trainer.plan.reason
    assert abs(ours.val_accuracy - keras_with.val_accuracy) <= TOLERANCE, (ours, keras_with, keras_without)
    assert abs(ours.train_loss - keras_with.train_loss) <= 0.01 * keras_with.train_loss, (ours, keras_with)
    # With the base trained (the feature dropped), fit trains another model.
    assert abs(keras_without.train_loss - keras_with.train_loss) >= 0.1 * keras_with.train_loss
    from pipeline.inputs.hypermodel import load_builder

    loaded = load_builder(workspace / "parity.py", "backbone")()
    loaded.load_weights(str(workspace / "backbone.weights.h5"))
    for model in trainer.models:
        base = model.get_layer("backbone")
        assert not base.trainable_variables
        for variable, stored in zip(base.variables, loaded.variables):
            np.testing.assert_array_equal(variable, stored, err_msg=variable.path)
