"""What of a researcher's Keras model foldsweep refuses, and how it reads what it honours: each
refusal is exit 2 from `foldsweep run` with the named feature, before any trial starts and before
anything is written; a schedule is shown as its call.

The refusals run beside the session's Ray, which `run` joins instead of starting its own, and so
leaves running: that a refusal stops the Ray it started, for each kind of input, is
test_cli_bad_inputs' battery."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app

HEADS = {
    "linear": "keras.layers.Dense(2)",
    "softmax": "keras.layers.Dense(2, activation='softmax')",
    "sigmoid": "keras.layers.Dense(1, activation='sigmoid')",
    "three": "keras.layers.Dense(3, activation='softmax')",
}


def experiment(
    head: str = "softmax", *, compile_args: str = "", model_class: str = "keras.Sequential", prelude: str = ""
) -> str:
    compiled = f"    model.compile(optimizer='adam', {compile_args})\n" if compile_args else ""
    return (
        "import keras\n" + prelude + "def build(hp):\n"
        f"    model = {model_class}([keras.layers.Flatten(), {HEADS[head]}])\n" + compiled + "    return model\n"
    )


def overriding(method: str) -> str:
    arguments = {
        "train_step": "self, data",
        "test_step": "self, data",
        "compute_loss": "self, *args, **kwargs",
        "compute_metrics": "self, *args, **kwargs",
    }[method]
    return experiment(
        model_class="Custom",
        prelude=(
            "class Custom(keras.Sequential):\n"
            f"    def {method}({arguments}):\n"
            f"        return super().{method}({arguments.replace('self, ', '')})\n"
        ),
    )


def labelled(y, y_test=None):
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(len(y), 8, 1)).astype(np.float32), "y": np.asarray(y, np.int32)}
    if y_test is not None:
        arrays.update(
            x_test=rng.normal(size=(len(y_test), 8, 1)).astype(np.float32), y_test=np.asarray(y_test, np.int32)
        )
    return arrays


BINARY = [0, 1] * 30
BRANCHY_LOSS = (
    "import tensorflow as tf\n"
    "def halved(y_true, y_pred):\n"
    "    loss = keras.losses.sparse_categorical_crossentropy(y_true, y_pred)\n"
    "    if tf.reduce_mean(loss) > 100.0:\n"
    "        return loss * 0.5\n"
    "    return loss\n"
)
EAGER_LOSS = (
    "def rescaled(y_true, y_pred):\n"
    "    loss = keras.losses.sparse_categorical_crossentropy(y_true, y_pred)\n"
    "    return loss / float(loss.numpy().mean())\n"
)
TWO_OUTPUTS = (
    "import keras\n"
    "def build(hp):\n"
    "    inputs = keras.Input((8, 1))\n"
    "    flat = keras.layers.Flatten()(inputs)\n"
    "    outputs = [keras.layers.Dense(2, activation='softmax', name=name)(flat) for name in ('label', 'aux')]\n"
    "    model = keras.Model(inputs, outputs)\n"
    "    COMPILE\n"
    "    return model\n"
)
REFUSED = {
    "linear head without from_logits": (
        experiment("linear"),
        labelled(BINARY),
        [
            "ends in layer 'dense' (Dense, activation linear)",
            "reads them as probabilities",
            "set train.from_logits: true",
        ],
    ),
    "compiled loss without from_logits on a linear head": (
        experiment("linear", compile_args="loss='sparse_categorical_crossentropy'"),
        labelled(BINARY),
        [
            "not probabilities that sum to 1",
            "compile the loss with from_logits=True (keras.losses.SparseCategoricalCrossentropy(from_logits=True))",
        ],
    ),
    "sigmoid head compiled with a probability loss on logits": (
        experiment("linear").replace("Dense(2)", "Dense(1)"),
        labelled(BINARY),
        ["not probabilities between 0 and 1", "binary_crossentropy (from_logits=False)", "set train.from_logits: true"],
    ),
    **{
        f"{method} override": (overriding(method), labelled(BINARY), [f"Custom overrides {method}", "bypass"])
        for method in ("train_step", "test_step", "compute_loss", "compute_metrics")
    },
    "one class in y": (experiment(), labelled([1] * 60), ["y of", "has a single class (every label is 1)"]),
    "y_test labels beyond the outputs": (
        experiment(),
        labelled(BINARY, y_test=[0, 1, 2, 1]),
        ["labels of", "go up to 2, but the model of", "has only 2 outputs (in y_test)"],
    ),
    "labels 0/1/2 for a one-unit head": (
        experiment("sigmoid", compile_args="loss='binary_crossentropy'"),
        labelled([0, 1, 2] * 20),
        [
            "has labels [0, 1, 2]",
            "one output unit, a binary classifier of labels 0 and 1",
            "Dense(3, activation='softmax')",
        ],
    ),
    "y_test labels 0/1/2 for a one-unit head": (
        experiment("sigmoid", compile_args="loss='binary_crossentropy'"),
        labelled(BINARY, y_test=[0, 2]),
        ["y_test of", "has labels [0, 2]"],
    ),
    "softmax over one unit": (
        experiment("sigmoid", compile_args="loss='binary_crossentropy'").replace("'sigmoid'", "'softmax'"),
        labelled(BINARY),
        ["activation softmax)", "whose one output is 1 for every sample", "Dense(1, activation='sigmoid')"],
    ),
    "categorical loss on one unit": (
        experiment("sigmoid", compile_args="loss='sparse_categorical_crossentropy'"),
        labelled(BINARY),
        ["one output unit and compiles sparse_categorical_crossentropy", "nothing would train"],
    ),
    "binary loss on several units": (
        experiment("three", compile_args="loss=keras.losses.BinaryCrossentropy()"),
        labelled([0, 1, 2] * 20),
        ["3 output units and compiles binary_crossentropy", "multi-label"],
    ),
    "summed loss": (
        experiment(compile_args="loss=keras.losses.SparseCategoricalCrossentropy(reduction='sum')"),
        labelled(BINARY),
        ["reduction='sum'", "batch mean"],
    ),
    "moving-average weights": (
        experiment(compile_args="loss='sparse_categorical_crossentropy'").replace(
            "optimizer='adam'", "optimizer=keras.optimizers.Adam(use_ema=True)"
        ),
        labelled(BINARY),
        ["Adam optimizer with use_ema=True", "drop use_ema"],
    ),
    # Keras' Dice reduces over the whole batch unless given an axis: one value per batch.
    "a loss of one value per batch": (
        experiment("sigmoid", compile_args="loss=keras.losses.Dice()"),
        labelled(BINARY),
        [
            "its loss dice gives one value for a whole batch (shape () for 60 samples), not one per sample",
            "axis=(1,) for one value per sample",
        ],
    ),
    # Keras' fit on TensorFlow builds it inside its traced step, where its momentum starts again
    # at the weights at every step.
    "a schedule-free optimizer left unbuilt": (
        experiment(compile_args="loss='sparse_categorical_crossentropy'").replace(
            "optimizer='adam'", "optimizer=keras.optimizers.ScheduleFreeAdamW(0.01)"
        ),
        labelled(BINARY),
        [
            "compiles a ScheduleFreeAdamW optimizer, unbuilt, that trains otherwise when built inside the training step",
            "model.optimizer.build(model.trainable_variables)",
        ],
    ),
    # keras.io's examples write their warm-up schedules so: Keras cannot write the optimizer's config.
    "a schedule without get_config": (
        experiment(
            compile_args="loss='sparse_categorical_crossentropy'",
            prelude=(
                "class WarmUp(keras.optimizers.schedules.LearningRateSchedule):\n"
                "    def __call__(self, step):\n"
                "        return 0.001 * keras.ops.minimum(1.0, (step + 1) / 100)\n"
            ),
        ).replace("optimizer='adam'", "optimizer=keras.optimizers.Adam(WarmUp())"),
        labelled(BINARY),
        [
            "compiles a Adam optimizer whose configuration Keras cannot write",
            "'WarmUp' must override `get_config()`",
            "give the schedule a get_config() that returns its __init__ arguments",
        ],
    ),
    # A class defined in build: nowhere to be found by the name Keras writes for it.
    "a schedule class Keras cannot find": (
        experiment(compile_args="loss='sparse_categorical_crossentropy'")
        .replace(
            "def build(hp):\n",
            "def build(hp):\n"
            "    class WarmUp(keras.optimizers.schedules.LearningRateSchedule):\n"
            "        def __call__(self, step):\n"
            "            return 0.001 * keras.ops.minimum(1.0, (step + 1) / 100)\n"
            "        def get_config(self):\n"
            "            return {}\n",
        )
        .replace("optimizer='adam'", "optimizer=keras.optimizers.Adam(WarmUp())"),
        labelled(BINARY),
        [
            "compiles a Adam optimizer that Keras cannot make again from its configuration",
            "Could not locate class 'WarmUp'",
            "@keras.saving.register_keras_serializable()",
        ],
    ),
    # Keras' fit wants a label per output; foldsweep scores one output against the data's y.
    "two outputs": (
        TWO_OUTPUTS.replace("COMPILE", "pass"),
        labelled(BINARY),
        ["the model of model.py has 2 outputs ('label', 'aux')", "return one output"],
    ),
    "one loss per output": (
        TWO_OUTPUTS.replace(
            "COMPILE",
            "model.compile(optimizer='adam', loss={'label': 'mse', 'aux': 'sparse_categorical_crossentropy'})",
        ),
        labelled(BINARY),
        ["compiles one loss per output ('label', 'aux')", "return one output and compile one loss"],
    ),
    "loss weights": (
        experiment(compile_args="loss='sparse_categorical_crossentropy', loss_weights=[2.0]"),
        labelled(BINARY),
        ["loss_weights=[2.0]"],
    ),
    # Keras' fit scales the loss under mixed_float16; foldsweep's step does not (MIXED_PRECISION_FIX).
    "mixed_float16 set at import, as keras.io's examples do": (
        experiment(
            compile_args="loss='sparse_categorical_crossentropy'",
            prelude="keras.mixed_precision.set_global_policy('mixed_float16')\n",
        ),
        labelled(BINARY),
        [
            "model.py sets the global dtype policy 'mixed_float16'",
            "does not scale the loss as Keras' fit does",
            "drop the call to keras.mixed_precision.set_global_policy",
        ],
    ),
    "mixed_bfloat16 set by the build": (
        experiment().replace(
            "def build(hp):\n", "def build(hp):\n    keras.config.set_dtype_policy('mixed_bfloat16')\n"
        ),
        labelled(BINARY),
        ["sets the global dtype policy 'mixed_bfloat16'"],
    ),
    "a layer under mixed_float16": (
        experiment().replace("activation='softmax'", "activation='softmax', dtype='mixed_float16'"),
        labelled(BINARY),
        ["(Dense) computes under the dtype policy 'mixed_float16'", "drop dtype='mixed_float16'"],
    ),
    "a LossScaleOptimizer compiled in float32": (
        experiment(compile_args="loss='sparse_categorical_crossentropy'").replace(
            "optimizer='adam'", "optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))"
        ),
        labelled(BINARY),
        ["compiles a LossScaleOptimizer", "compile the optimizer it wraps"],
    ),
    "mixed_float16 in one branch of the space only": (
        experiment().replace(
            "def build(hp):\n",
            "def build(hp):\n    if hp.Boolean('half', default=False):\n"
            "        keras.mixed_precision.set_global_policy('mixed_float16')\n",
        ),
        labelled(BINARY),
        ["built with {'half': True} sets the global dtype policy 'mixed_float16'"],
    ),
    "a Python if on a tensor in the loss, which fit cannot trace": (
        experiment(compile_args="loss=halved", prelude=BRANCHY_LOSS),
        labelled(BINARY),
        [
            "its loss halved cannot be traced as Keras' fit traces its training step",
            "Using a symbolic `tf.Tensor` as a Python `bool` is not allowed",
            "tf.where or tf.cond",
        ],
    ),
    "a tensor's .numpy() in the loss, which fit's graph has not": (
        experiment(compile_args="loss=rescaled", prelude=EAGER_LOSS),
        labelled(BINARY),
        [
            "its loss rescaled cannot be traced as Keras' fit traces its training step",
            "AttributeError: 'SymbolicTensor' object has no attribute 'numpy'",
            "without NumPy or Python values",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_model_foldsweep_would_train_otherwise_is_refused_before_anything_runs(
    ray_cluster, case, tmp_path, monkeypatch
):
    import ray

    source, arrays, expected = REFUSED[case]
    (tmp_path / "model.py").write_text(source)
    np.savez(tmp_path / "data.npz", **arrays)
    (tmp_path / "spec.yaml").write_text(
        yaml.safe_dump({"name": "refused", "experiment": "model.py", "dataset": "data.npz", "cv": {"n_splits": 2}})
    )
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    monkeypatch.chdir(tmp_path)  # the default store, sqlite:///mlflow.db, would be created here
    result = CliRunner().invoke(app, ["run", "spec.yaml"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    for phrase in expected:
        assert phrase in output, (phrase, output)
    assert "Traceback" not in output
    assert ray.is_initialized(), "the refusal stopped a Ray it had not started"
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    assert keras.config.dtype_policy().name == "float32"  # a refused build's policy reaches no later one


def validated(tmp_path, monkeypatch, source: str, arrays: dict[str, np.ndarray]):
    """`foldsweep validate` of ``source`` as model.py on ``arrays`` (2 folds, batch 8), in ``tmp_path``."""
    (tmp_path / "model.py").write_text(source)
    np.savez(tmp_path / "data.npz", **arrays)
    spec = {"name": "checked", "experiment": "model.py", "dataset": "data.npz", "cv": {"n_splits": 2}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**spec, "search": {"space": {"batch_size": 8}}}))
    monkeypatch.chdir(tmp_path)
    return CliRunner().invoke(app, ["validate", "spec.yaml"])


def test_a_sigmoid_head_saturated_on_samples_far_from_zero_is_not_taken_for_a_softmax_over_one_unit(
    without_ray, tmp_path, monkeypatch
):
    """Samples around 100 (raw, unscaled values) drive a fresh sigmoid head's output to 1.0 in
    float32 for every sample, as a softmax over one unit's always is; it is validated, not refused."""
    source = experiment("sigmoid", compile_args="loss='binary_crossentropy'").replace(
        "activation='sigmoid'", "activation='sigmoid', kernel_initializer='ones'"
    )
    arrays = labelled(BINARY)
    result = validated(tmp_path, monkeypatch, source, {"x": arrays["x"] + 100.0, "y": arrays["y"]})
    assert result.exit_code == 0, result.output
    assert "softmax over one unit" not in result.output


def test_a_schedule_class_from_a_module_beside_the_experiment_is_found_for_each_folds_optimizer(
    without_ray, tmp_path, monkeypatch
):
    """keras.io's warm-up schedule, unregistered, in a module the experiment imports: each fold's
    optimizer is made from the compiled one's config, naming the class by that module."""
    (tmp_path / "schedules.py").write_text(
        "import keras\n"
        "class WarmUp(keras.optimizers.schedules.LearningRateSchedule):\n"
        "    def __init__(self, rate):\n"
        "        self.rate = rate\n"
        "    def __call__(self, step):\n"
        "        return self.rate * keras.ops.minimum(1.0, (step + 1) / 100)\n"
        "    def get_config(self):\n"
        "        return {'rate': self.rate}\n"
    )
    source = experiment(compile_args="loss='sparse_categorical_crossentropy'", prelude="from schedules import WarmUp\n")
    source = source.replace("optimizer='adam'", "optimizer=keras.optimizers.Adam(WarmUp(0.01))")
    result = validated(tmp_path, monkeypatch, source, labelled(BINARY))
    assert result.exit_code == 0, result.output
    assert "its WarmUp(rate=0.01) schedule" in " ".join(result.output.split()), result.output


def test_a_build_that_sets_mixed_precision_in_a_worker_fails_its_trial_and_leaves_float32_behind():
    """A worker's build (``build_model``) refuses it too: a branch the space's discovery did not
    build, or an experiment file changed after validation, fails its trial with the reason, and
    the worker's next trial builds in float32."""
    from pipeline.base.errors import ExperimentError
    from pipeline.inputs.hypermodel import build_model

    def build(hp):
        keras.mixed_precision.set_global_policy("mixed_float16")
        return keras.Sequential([keras.Input((8, 1)), keras.layers.Flatten(), keras.layers.Dense(2)])

    with pytest.raises(ExperimentError, match="experiment: build\\(hp\\) sets the global dtype policy 'mixed_float16'"):
        build_model(build, {})
    assert keras.config.dtype_policy().name == "float32"
    afterwards = build_model(lambda hp: keras.Sequential([keras.Input((8, 1)), keras.layers.Dense(2)]), {})
    assert afterwards.dtype_policy.name == "float32"


def test_a_worker_build_with_several_outputs_fails_its_trial_with_the_reason():
    """A branch of the space that validate's default model does not take returns two outputs:
    the worker's build (``build_model``) refuses it, naming the outputs and the values."""
    from pipeline.base.errors import ExperimentError
    from pipeline.inputs.hypermodel import build_model

    def build(hp):
        inputs = keras.Input((8, 1))
        flat = keras.layers.Flatten()(inputs)
        heads = [keras.layers.Dense(2, activation="softmax", name=name)(flat) for name in ("label", "aux")]
        return keras.Model(inputs, heads if hp.Boolean("two", default=False) else heads[0])

    assert len(build_model(build, {}).outputs) == 1
    with pytest.raises(ExperimentError) as refused:
        build_model(build, {"two": True})
    assert str(refused.value) == (
        "experiment: the model build(hp) returns for {'two': True} has 2 outputs ('label', 'aux'); foldsweep "
        "trains and scores one output against the data's y: return one output"
    )


def test_a_fold_that_trains_on_one_class_is_refused(tmp_path, monkeypatch):
    # Three single-class groups in 2 folds: one fold trains on one group, so on one class.
    arrays = labelled([1] * 20 + [0] * 40)
    arrays["groups"] = np.repeat([0, 1, 2], 20)
    np.savez(tmp_path / "data.npz", **arrays)
    (tmp_path / "model.py").write_text(experiment())
    (tmp_path / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "grouped",
                "experiment": "model.py",
                "dataset": "data.npz",
                "cv": {"splitter": "group", "n_splits": 2},
                "search": {"space": {"batch_size": 8}},
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["validate", "spec.yaml"])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert re.search(r"cv.splitter group: fold \d of '.*data.npz' trains on a single class \(\d\)", output), output


@pytest.mark.training
def test_validate_says_the_spec_replaces_a_compiled_schedule_with_a_constant(tmp_path, monkeypatch):
    schedule = "keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)"
    (tmp_path / "model.py").write_text(
        experiment(compile_args="loss='sparse_categorical_crossentropy'").replace(
            "optimizer='adam'", f"optimizer=keras.optimizers.Adam({schedule})"
        )
    )
    np.savez(tmp_path / "data.npz", **labelled(BINARY))
    spec = {
        "name": "scheduled",
        "experiment": "model.py",
        "dataset": "data.npz",
        "cv": {"n_splits": 2},
        "search": {"space": {"batch_size": 8}},
    }
    (tmp_path / "kept.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "replaced.yaml").write_text(
        yaml.safe_dump({**spec, "search": {"space": {"batch_size": 8, "learning_rate": 0.001}}})
    )
    monkeypatch.chdir(tmp_path)
    kept = CliRunner().invoke(app, ["validate", "kept.yaml"])
    replaced = CliRunner().invoke(app, ["validate", "replaced.yaml"])
    assert kept.exit_code == 0 and replaced.exit_code == 0, kept.output + replaced.output
    call = "ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)"
    assert f"the Adam optimizer with its {call} schedule and loss that model.py compiles are used" in " ".join(
        kept.output.split()
    )
    assert (
        f"search.space.learning_rate replaces the {call} schedule of the Adam optimizer that model.py compiles "
        "with a constant"
    ) in " ".join(replaced.output.split())


def test_a_schedule_is_recorded_as_its_call_and_drawn_with_a_short_label():
    import keras

    from pipeline.engine.recipe import TrainingParams, optimizer_recipe
    from pipeline.inputs.hypermodel import schedule_text
    from pipeline.records.plots import tick_label

    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(schedule), "binary_crossentropy")
    recipe = optimizer_recipe(model, TrainingParams(batch_size=8, learning_rate=1e-3, optimizer="adam"))
    assert recipe.learning_rate == "ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)"
    assert (
        schedule_text(keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.1, 0.01]))
        == "PiecewiseConstantDecay(boundaries=[10], values=[0.1, 0.01])"
    )
    assert tick_label(recipe.learning_rate) == "ExponentialDecay(0.01…)"
    assert tick_label("0.001") == "0.001"
    # The schedule itself is what a fold's optimizer gets, not a constant.
    assert recipe.make([]).get_config()["learning_rate"]["class_name"] == "ExponentialDecay"


@pytest.mark.parametrize(
    "head, loss",
    [
        ("sigmoid", "'binary_crossentropy'"),
        ("sigmoid", "keras.losses.binary_crossentropy"),
        ("sigmoid", "keras.losses.BinaryFocalCrossentropy(gamma=2.0)"),
        ("sigmoid", "keras.losses.BinaryCrossentropy(label_smoothing=0.1)"),
        ("linear1", "keras.losses.BinaryCrossentropy(from_logits=True)"),
        ("softmax", "'sparse_categorical_crossentropy'"),
        ("softmax", "'categorical_crossentropy'"),
        ("softmax", "keras.losses.CategoricalFocalCrossentropy()"),
        ("linear", "keras.losses.SparseCategoricalCrossentropy(from_logits=True)"),
    ],
)
def test_the_training_loss_is_the_batch_loss_keras_fit_computes(head, loss):
    """For integer labels as `fit` gets them (shape [batch]), the mean of foldsweep's per-sample
    loss equals the compiled loss Keras' own step computes (its compute_loss)."""
    import keras

    from pipeline.inputs.hypermodel import output_units
    from pipeline.inputs.losses import training_loss
    from pipeline.inputs.spec import TrainSpec

    heads = {**HEADS, "linear1": "keras.layers.Dense(1)"}
    namespace: dict = {}
    exec(experiment("softmax", compile_args=f"loss={loss}").replace(HEADS["softmax"], heads[head]), namespace)
    model = namespace["build"](None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 1)).astype(np.float32)
    units = output_units(model, (8, 1))
    y = rng.integers(0, 2, 16).astype(np.int32)
    ours = training_loss(model, train=TrainSpec(), units=units)
    predictions = model(x)
    # Keras' own step gets one-hot rows where the loss wants them; foldsweep makes them itself.
    given = keras.ops.one_hot(y, units) if ours.one_hot else y
    keras_loss = float(model.compute_loss(x=x, y=given, y_pred=predictions))
    assert ours.binary == (units == 1)
    assert float(keras.ops.mean(ours.per_sample(keras.ops.convert_to_tensor(y), predictions))) == pytest.approx(
        keras_loss, rel=1e-5
    )


def test_train_label_smoothing_smooths_foldsweeps_own_loss_as_keras_does():
    import keras
    import tensorflow as tf

    from pipeline.base.errors import ExperimentError
    from pipeline.inputs.losses import training_loss
    from pipeline.inputs.spec import TrainSpec

    samples = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    labels = np.array([0, 2, 1, 1, 0], np.int32)
    for units, activation, keras_loss, targets in (
        (3, "softmax", keras.losses.CategoricalCrossentropy, keras.utils.to_categorical(labels, 3)),
        (1, "sigmoid", keras.losses.BinaryCrossentropy, (labels % 2)[:, None].astype("float32")),
    ):
        # Confident predictions, always the same: where smoothing moves the loss most.
        initializer = keras.initializers.RandomNormal(stddev=3.0, seed=0)
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(units, activation, kernel_initializer=initializer)]
        )
        outputs = model(samples)
        classes = tf.constant(labels if units > 1 else labels % 2)
        smoothed = training_loss(model, train=TrainSpec(label_smoothing=0.2), units=units)
        expected = float(keras_loss(label_smoothing=0.2)(targets, outputs))
        assert float(tf.reduce_mean(smoothed.per_sample(classes, outputs))) == pytest.approx(expected, rel=1e-6)
        plain = float(tf.reduce_mean(training_loss(model, train=TrainSpec(), units=units).per_sample(classes, outputs)))
        assert plain != pytest.approx(expected, rel=1e-3)
        assert "label_smoothing=0.2" in smoothed.name

    model.compile(loss="binary_crossentropy")
    with pytest.raises(ExperimentError, match="train.label_smoothing applies to foldsweep's own loss"):
        training_loss(model, train=TrainSpec(label_smoothing=0.1), units=1)
