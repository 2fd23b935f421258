"""KerasTuner hypermodels run unchanged: their space is discovered, and trials build with fixed values."""

from __future__ import annotations

import re
from pathlib import Path

import keras
import keras_tuner
import pytest
from helpers import MNIST1D_EXPERIMENT, Replace
from ray import tune

from pipeline.base.errors import ExperimentError, SpecError
from pipeline.inputs.hypermodel import load_experiment
from pipeline.inputs.space import build_space, hp_domain, split_config
from pipeline.inputs.spec import load_spec

KT_HYPERMODEL = """
import keras
import keras_tuner

class Model(keras_tuner.HyperModel):
    def build(self, hp):
        inputs = keras.Input(shape=(12, 1))
        x = keras.layers.Conv1D(hp.Int("filters", 4, 12, step=4), 3)(inputs)
        if hp.Boolean("pool"):
            x = keras.layers.MaxPooling1D(2)(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dropout(hp.Float("dropout", 1e-3, 0.5, sampling="log"))(x)
        outputs = keras.layers.Dense(3, activation=hp.Choice("act", ["softmax"]))(x)
        return keras.Model(inputs, outputs)
"""


def test_discovers_the_mnist1d_space_and_builds_with_given_values():
    experiment = load_experiment(MNIST1D_EXPERIMENT, "build")
    names = {hp.name for hp in experiment.hyperparameters.space}
    assert names == {"conv_layers", "filters", "kernel_size", "dropout"}
    assert experiment.input_shape == (40, 1) and experiment.output_units((40, 1)) == 10
    model = experiment.build({"conv_layers": 3, "filters": 48, "kernel_size": 7, "dropout": 0.2})
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv1D)]
    assert len(convs) == 3
    assert {conv.filters for conv in convs} == {48}
    assert convs[0].kernel_size == (7,)


def test_a_keras_tuner_hypermodel_class_maps_to_equivalent_ray_domains(write_experiment):
    experiment = load_experiment(write_experiment(KT_HYPERMODEL), "Model")
    domains = {hp.name: hp_domain(hp) for hp in experiment.hyperparameters.space}
    assert domains["filters"].categories == [4, 8, 12]  # KerasTuner's step counts from min_value
    assert domains["pool"].categories == [True, False]
    assert isinstance(domains["dropout"].get_sampler(), tune.search.sample.Float._LogUniform)
    assert (domains["dropout"].lower, domains["dropout"].upper) == (1e-3, 0.5)
    model = experiment.build({"filters": 8, "pool": True, "dropout": 0.1, "act": "softmax"})
    assert model.layers[1].filters == 8
    assert any(isinstance(layer, keras.layers.MaxPooling1D) for layer in model.layers)


def test_a_reverse_log_range_no_ray_domain_draws_is_refused_unless_stepped():
    from keras_tuner.src.engine.hyperparameters import hp_types

    momentum = hp_types.Float("momentum", 0.01, 0.999, sampling="reverse_log")
    with pytest.raises(SpecError, match=r"hyperparameter 'momentum': .*sampling='reverse_log'.* search\.space"):
        hp_domain(momentum)
    stepped = hp_types.Float("decay", 0.1, 0.9, step=2, sampling="reverse_log")
    assert hp_domain(stepped).categories == [round(value, 10) for value in stepped.values]


SHARED_HIDDEN = """
import keras

HIDDEN = keras.layers.Dense(4, activation="relu", name="hidden")


def build(hp):
    units = hp.Choice("units", [8, 16])
    return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(units), HIDDEN, keras.layers.Dense(2)])
"""


def test_a_layer_made_outside_build_is_found_by_the_builds_discovery_makes(write_experiment):
    """Discovery's own builds (one per choice here) tell a shared layer from the default's: the
    check costs no build of its own where the hypermodel has hyperparameters."""
    with pytest.raises(ExperimentError, match=r"share the trainable layers \['hidden'\] between calls"):
        load_experiment(write_experiment(SHARED_HIDDEN), "build")
    frozen = SHARED_HIDDEN.replace('name="hidden")', 'name="hidden", trainable=False)')
    assert load_experiment(write_experiment(frozen, "frozen.py"), "build").hyperparameters.get("units") == 8


def test_a_hypermodel_that_declares_a_name_kept_for_the_spec_clipping_is_refused(write_spec):
    hyperparameters = keras_tuner.HyperParameters()
    hyperparameters.Float("clip_threshold", 0.001, 1.0, sampling="log")
    with pytest.raises(SpecError, match="hyperparameter 'clip_threshold': .* only where clipping is on"):
        build_space(load_spec(write_spec()), hyperparameters)


def test_spec_entries_override_the_hypermodel_and_fill_training_defaults(write_spec):
    spec = load_spec(write_spec({"search": {"space": {"batch_size": {"grid": [8, 16]}, "kernel_size": 5}}}))
    experiment = load_experiment(MNIST1D_EXPERIMENT, "build")
    space = build_space(spec, experiment.hyperparameters).param_space
    assert space["kernel_size"] == 5
    assert space["filters"] == 16  # from the tiny spec
    assert space["batch_size"] == {"grid_search": [8, 16]}
    assert space["learning_rate"] == 1e-3 and space["optimizer"] == "adam"
    assert space["dropout"].categories == [0.0, 0.1, 0.2, 0.3, 0.4]  # no 0.30000000000000004
    # The hypermodel's order, the spec's entries in their place: a searcher draws a seed's configs
    # in this order, so it is what makes a seed give the same configs.
    declared = [hp.name for hp in experiment.hyperparameters.space]
    assert [name for name in space if name in declared] == declared


def test_spec_entry_the_hypermodel_never_asks_for_is_refused(write_spec):
    spec = load_spec(write_spec({"search": {"space": {"fliters": 8}}}))
    experiment = load_experiment(MNIST1D_EXPERIMENT, "build")
    with pytest.raises(SpecError, match=r"search.space.fliters is not a hyperparameter of .* never asks for it"):
        build_space(spec, experiment.hyperparameters)


def test_split_config_gives_training_values_and_the_build_every_value():
    training, model = split_config({"batch_size": 8, "filters": 16, "dropout": 0.1, "learning_rate": 0.01})
    assert training == {
        "batch_size": 8,
        "learning_rate": 0.01,
        "optimizer": "adam",
        "epochs": None,
        "clipping": "none",
        "clip_threshold": 1.0,
    }
    assert model == {"batch_size": 8, "filters": 16, "dropout": 0.1, "learning_rate": 0.01}


@pytest.mark.parametrize(
    ("source", "attr", "message"),
    [
        (None, "build", "experiment: file not found"),
        ("import not_a_module_anywhere\n", "build", "importing .* failed: ModuleNotFoundError"),
        ("x = 1 / 0\n", "build", "importing .* failed: ZeroDivisionError"),
        ("def make(hp):\n    pass\n", "build", "has no 'build'; callables found: make"),
        ("build = 3\n", "build", "must be a build\\(hp\\) function or a keras_tuner.HyperModel, got int"),
        (
            "def build(hp):\n    raise RuntimeError('boom')\n",
            "build",
            "raised RuntimeError when built .* at .*:2 \\(`raise RuntimeError\\('boom'\\)`\\): boom$",
        ),
        ("def build(hp):\n    return 'model'\n", "build", "must return a keras.Model, got str"),
    ],
)
def test_broken_experiments_are_refused(tmp_path: Path, write_experiment, source, attr, message):
    path = write_experiment(source) if source is not None else tmp_path / "absent.py"
    with pytest.raises(ExperimentError, match=message):
        load_experiment(path, attr)


WIDE_NETS_BREAK = """
import keras

def build(hp):
    width = hp.Int("width", 4, 64, default=8)
    inputs = keras.Input(shape=(40, 1))
    x = keras.layers.Conv1D(width, 3)(inputs)
    if width > 32:
        x = keras.layers.Reshape((7, -1))(x)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
"""


def test_a_build_that_fails_for_one_config_names_the_researchers_line_and_layer(write_experiment):
    """What a trial's build raises is the researcher's error, told as theirs: their file, line and
    code, the layer Keras names, the config, on one line (never foldsweep's internal error)."""
    path = write_experiment(WIDE_NETS_BREAK)
    experiment = load_experiment(path, "build")
    assert experiment.build({"width": 16}).count_params() > 0
    with pytest.raises(ExperimentError) as raised:
        experiment.build({"width": 48})
    message = str(raised.value)
    assert message.startswith(
        f"experiment: build(hp) raised ValueError when built with hyperparameters {{'width': 48}} at {path}:9 "
        "(`x = keras.layers.Reshape((7, -1))(x)`): Exception encountered when calling Reshape.call(). The total "
        "size of the tensor must be unchanged"
    )
    assert "\n" not in message and "Arguments received" not in message and "\x1b" not in message


STYLES = Path(__file__).resolve().parent / "experiments" / "kerastuner_styles.py"


def test_discovery_reaches_names_inside_a_loop_with_their_condition(write_spec):
    experiment = load_experiment(STYLES, "sequential_no_input")
    found = {hp.name: [(c.name, list(c.values)) for c in hp.conditions] for hp in experiment.hyperparameters.space}
    assert found["units_0"] == [] and found["units_1"] == [("num_layers", [2, 3])]
    assert found["units_2"] == [("num_layers", [3])]
    assert experiment.input_shape is None and experiment.compiled_optimizer == "Adam"
    spec = load_spec(write_spec({"experiment": f"{STYLES}:sequential_no_input", "search": {"space": Replace({})}}))
    space = build_space(spec, experiment.hyperparameters, own_optimizer=True)
    assert "learning_rate" not in space.domains and "optimizer" not in space.domains  # the hypermodel's own
    one = space.resolve({"num_layers": 1, "units_0": 64, "units_1": 96, "units_2": 128})
    assert "units_1" not in one and "units_2" not in one
    assert space.resolve({"num_layers": 3, "units_0": 64, "units_1": 96, "units_2": 128})["units_2"] == 128
    assert experiment.output_units((40, 1)) == 10  # built on the data's shape


FIT_OVERRIDES = {
    "its own loop": ("for _ in range(2):\n            model.fit(*args, **kwargs)", "calls model.fit 2 times"),
    "callbacks": (
        "return model.fit(*args, callbacks=[keras.callbacks.TerminateOnNaN()], "
        "validation_data=kwargs['validation_data'])",
        "passes model.fit 1 thing foldsweep cannot honour: (1) the "
        "callback TerminateOnNaN, which foldsweep cannot honour",
    ),
    "sample weights": (
        "return model.fit(*args, sample_weight=None, **kwargs)",
        "(1) sample_weight=...: foldsweep trains the loss unweighted",
    ),
    "a loop of its own": ("model.train_on_batch(args[0], args[1])", "calls model.fit 0 times"),
    # Weights computed from the labels fit() is given would be the probe's, not each fold's.
    "class weights of its labels": (
        "return model.fit(*args, class_weight={int(args[1][0]): 2.0}, **kwargs)",
        "(1) class_weight=... computed from the labels fit() is given, which are not a "
        "fold's: use train.class_weight: balanced",
    ),
}


def test_a_fit_override_passing_class_weights_weighs_the_training_loss_as_the_spec_would(write_experiment):
    source = (
        "import keras\nimport keras_tuner\n\n"
        "class Model(keras_tuner.HyperModel):\n"
        "    def build(self, hp):\n"
        "        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2, activation='softmax')])\n"
        "        model.compile(optimizer='adam', loss='sparse_categorical_crossentropy')\n"
        "        return model\n\n"
        "    def fit(self, hp, model, *args, **kwargs):\n"
        "        return model.fit(*args, class_weight={0: 1, 1: 3.5}, **kwargs)\n"
    )
    experiment = load_experiment(write_experiment(source), "Model")
    assert experiment.fit_class_weight == {0: 1.0, 1: 3.5}


@pytest.mark.parametrize("what", FIT_OVERRIDES)
def test_a_fit_override_foldsweep_cannot_reproduce_is_refused(write_experiment, what):
    body, message = FIT_OVERRIDES[what]
    source = (
        "import keras\nimport keras_tuner\n\n"
        "class Model(keras_tuner.HyperModel):\n"
        "    def build(self, hp):\n"
        "        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(10, activation='softmax')])\n"
        "        model.compile(optimizer='adam', loss='sparse_categorical_crossentropy')\n"
        "        return model\n\n"
        "    def fit(self, hp, model, *args, **kwargs):\n"
        f"        {body}\n"
    )
    with pytest.raises(ExperimentError, match=rf"Model: its HyperModel.fit .*{re.escape(message)}"):
        load_experiment(write_experiment(source), "Model")


def test_a_fit_override_that_tunes_fit_arguments_is_read():
    experiment = load_experiment(STYLES, "TunedFit")
    assert experiment.fit_arguments == {"batch_size": "batch_size", "shuffle": "shuffle"}
    assert {hp.name for hp in experiment.hyperparameters.space} == {"units", "batch_size", "shuffle"}
