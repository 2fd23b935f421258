"""The scoring seam: each Keras metric's direction as KerasTuner and Keras know it (the table is
written out because a spec is read before TensorFlow may start), and a fold's metrics accumulated
over every batch rather than averaged per batch."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.inputs.scoring import KNOWN_DIRECTIONS, Scorer, ValidationMetrics, direction_of, objective_problem

# Where the table departs from KerasTuner's rule, which calls every keras.metrics class it does not
# list "min": these improve upwards.
KERAS_TUNER_WRONG = {
    "F1Score",
    "f1_score",
    "FBetaScore",
    "fbeta_score",
    "R2Score",
    "r2_score",
    "CosineSimilarity",
    "cosine_similarity",
    "PearsonCorrelation",
    "pearson_correlation",
    "ConcordanceCorrelation",
    "concordance_correlation",
    "IoU",
    "MeanIoU",
    "mean_iou",
    "BinaryIoU",
    "binary_iou",
    "OneHotIoU",
    "OneHotMeanIoU",
    "PrecisionAtRecall",
    "RecallAtPrecision",
    "SensitivityAtSpecificity",
    "SpecificityAtSensitivity",
    "TruePositives",
    "true_positives",
    "TrueNegatives",
    "true_negatives",
}


def test_the_direction_table_is_keras_tuners_rule_put_right_where_it_is_wrong():
    from keras_tuner.engine.metrics_tracking import infer_metric_direction

    for name, direction in KNOWN_DIRECTIONS.items():
        try:
            inferred = infer_metric_direction(name)
        except TypeError:  # a class Keras cannot make without arguments (PrecisionAtRecall(recall))
            inferred = None
        if name in KERAS_TUNER_WRONG:
            assert direction == "max", name
        elif inferred is not None:
            assert inferred == direction, (name, inferred, direction)


def test_every_keras_metric_class_has_a_direction():
    import inspect

    import keras

    classes = [
        name
        for name in dir(keras.metrics)
        if inspect.isclass(getattr(keras.metrics, name))
        and issubclass(getattr(keras.metrics, name), keras.metrics.Metric)
    ]
    unknown = set(classes) - set(KNOWN_DIRECTIONS) - {"Metric", "Mean", "Sum", "MeanMetricWrapper"}
    assert not unknown
    # A Keras metric object by its class; a researcher's own by nothing (its name proves nothing).
    assert direction_of(keras.metrics.AUC(name="whatever")) == "max"
    assert direction_of(keras.metrics.RootMeanSquaredError()) == "min"

    class Mine(keras.metrics.Mean):
        pass

    assert direction_of(Mine(name="auc")) is None


def test_a_folds_metrics_are_accumulated_over_all_its_batches_not_averaged_per_batch():
    import keras

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 96)
    p = np.clip(y * 0.3 + rng.uniform(size=96) * 0.7, 0, 1).astype(np.float32)[:, None]
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(
        loss="binary_crossentropy",
        metrics=[keras.metrics.AUC(name="auc"), "accuracy"],
        weighted_metrics=[keras.metrics.TruePositives(name="tp")],
    )
    metrics = ValidationMetrics(model)
    metrics.build(y[:1], p[:1])
    assert metrics.names == ("auc", "tp")  # accuracy is foldsweep's own (the same rule)
    for begin in range(0, 96, 32):
        metrics.update(y[begin : begin + 32], p[begin : begin + 32])
    whole = keras.metrics.AUC()
    whole.update_state(y, p)
    results = metrics.results()
    assert float(results["auc"]) == pytest.approx(float(whole.result()), abs=1e-6)
    assert float(results["tp"]) == float(np.sum((p[:, 0] > 0.5) & (y == 1)))  # a count over all 96, not a mean
    assert [scorer.name for scorer in metrics.scorers()] == ["auc", "tp"]
    metrics.reset()
    assert float(metrics.results()["tp"]) == 0.0


def test_an_objective_is_a_scalar_score_the_model_computes_with_a_known_direction():
    scorers = [Scorer("auc", "max"), Scorer("mcc", None), Scorer("f1_score", "max", scalar=False)]
    assert objective_problem("auc", None, scorers, classifier=True) is None
    assert objective_problem("mcc", "max", scorers, classifier=True) is None
    assert objective_problem("mcc", None, scorers, classifier=True)[0] == "mode"
    assert "one value per fold" in objective_problem("f1_score", None, scorers, classifier=True)[1]
    key, rule = objective_problem("mae", None, scorers, classifier=True)
    assert key == "metric" and "(accuracy, loss, auc, mcc, f1_score:" in rule
    assert (Scorer("auc", "max").worst, Scorer("mae", "min").worst, Scorer("accuracy", "max").worst) == (-1e6, 1e6, 0.0)


def test_balanced_class_weights_come_from_each_training_folds_own_labels():
    from types import SimpleNamespace

    from sklearn.utils.class_weight import compute_class_weight

    from pipeline.engine.fold_engine import fold_class_weights
    from pipeline.inputs.folds import Fold

    y = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 1])
    fold = Fold(train=np.array([0, 1, 2, 3, 5, 6]), val=np.array([4, 7, 8, 9]))
    data = SimpleNamespace(y=y)
    balanced = fold_class_weights("balanced", data, fold)
    # the training fold's labels 0,0,0,1,2,2: never the validation fold's
    assert balanced.tolist() == pytest.approx(
        compute_class_weight("balanced", classes=np.array([0, 1, 2]), y=y[fold.train]).tolist()
    )
    assert balanced[1] == pytest.approx(6 / (3 * 1))
    assert fold_class_weights({1: 4.0}, data, fold).tolist() == [1.0, 4.0, 1.0]  # unnamed classes weigh 1, as fit
    assert fold_class_weights(None, data, fold) is None
