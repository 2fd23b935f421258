"""One config of a spec, or a recorded trial again: `--set` values read as a spec's numbers, and a
value whose condition does not hold neither required nor refused, but left out (as the record
leaves it)."""

from __future__ import annotations

import keras_tuner
import pytest
from helpers import Replace
from typer.testing import CliRunner

from pipeline.base.errors import InputError
from pipeline.cli import app
from pipeline.inputs.space import build_space
from pipeline.inputs.spec import load_spec
from pipeline.rerun import inactive_overrides, parse_assignments, single_config

CLIP_SPACE = {"clipping": {"choice": ["none", "global_norm"]}, "clip_threshold": {"choice": [0.5, 1.0]}}


def test_set_values_are_read_as_a_spec_reads_numbers():
    assert parse_assignments(
        ["learning_rate=1e-3", "clip_threshold=1E-1", "dropout=.5", "batch_size=8", "optimizer=adam"]
    ) == {"learning_rate": 1e-3, "clip_threshold": 0.1, "dropout": 0.5, "batch_size": 8, "optimizer": "adam"}
    with pytest.raises(InputError, match="--set filters: the value must be a YAML scalar"):
        parse_assignments(["filters={8"])


def test_a_training_name_the_hypermodel_declares_is_checked_against_its_declaration_unless_the_spec_names_it():
    from pipeline.rerun import checked_overrides

    hyperparameters = keras_tuner.HyperParameters()
    hyperparameters.Choice("optimizer", ["nadam", "adagrad"])
    known = {"optimizer", "batch_size"}
    assert checked_overrides({"optimizer": "adagrad"}, known, hyperparameters) == {"optimizer": "adagrad"}
    with pytest.raises(InputError, match="--set optimizer: the hypermodel declares it hp.Choice of 'nadam', 'adagrad'"):
        checked_overrides({"optimizer": "adam"}, known, hyperparameters)
    named = {"optimizer"}  # the spec's search space replaces the hypermodel's: foldsweep's optimizers
    assert checked_overrides({"optimizer": "adam"}, known, hyperparameters, spec_names=named) == {"optimizer": "adam"}
    with pytest.raises(InputError, match="optimizer must be one of adam, adamw, sgd, rmsprop"):
        checked_overrides({"optimizer": "adagrad"}, known, hyperparameters, spec_names=named)


def test_a_single_trial_needs_no_value_its_condition_leaves_out(write_spec):
    spec = load_spec(write_spec({"search": {"space": Replace(CLIP_SPACE)}}))
    space = build_space(spec, keras_tuner.HyperParameters())
    config = single_config(spec, space, keras_tuner.HyperParameters(), {"clipping": "none"})
    assert config["clipping"] == "none" and "clip_threshold" not in config
    with pytest.raises(InputError, match=r"needs one value for clip_threshold \(choice in the spec\)"):
        single_config(spec, space, keras_tuner.HyperParameters(), {"clipping": "global_norm"})
    # With clipping itself open, the threshold's condition cannot be told yet: clipping is asked for first.
    with pytest.raises(InputError, match=r"needs one value for clipping \(choice in the spec\), clip_threshold"):
        single_config(spec, space, keras_tuner.HyperParameters(), {})


def test_a_set_value_whose_condition_does_not_hold_is_left_out_with_a_note():
    from keras_tuner.src.engine import conditions

    layers = {"units_2": (conditions.Parent("num_layers", [3]),)}
    left_out = inactive_overrides(
        {"clipping": "none", "num_layers": 1}, {"clip_threshold": 1.0, "units_2": 16, "num_layers": 1}, layers
    )
    assert left_out == {
        "clip_threshold": "--set clip_threshold=1.0 is left out: clip_threshold only counts when clipping is 'norm', "
        "'value', 'global_norm', and this trial has clipping='none'",
        "units_2": "--set units_2=16 is left out: units_2 only counts when num_layers is 3, and this trial has "
        "num_layers=1",
    }
    assert inactive_overrides({"clipping": "norm"}, {"clip_threshold": 1.0}, {}) == {}


@pytest.mark.training
def test_a_trial_without_clipping_runs_from_a_spec_that_searches_the_threshold(write_spec, threads_kept):
    spec = write_spec({"search": {"space": {**CLIP_SPACE, "kernel_size": 3}}})
    for extra in ([], ["--set", "clip_threshold=1.0"]):
        result = CliRunner().invoke(
            app, ["trial", str(spec), "--set", "clipping=none", *extra, "--fold", "0", "--epochs", "1"]
        )
        assert result.exit_code == 0, result.output
        shown = next(line for line in result.output.splitlines() if line.startswith("trial of "))
        assert "clipping=none" in shown and "clip_threshold" not in shown
        assert ("--set clip_threshold=1.0 is left out" in result.output) == bool(extra)
        assert "status: ok" in result.output
