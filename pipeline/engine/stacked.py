"""Stacked fold fusion: the k fold models' weights stacked along a leading fold axis and trained
by one XLA program per step, as horizontally fused training arrays (HFTA) do.

Why: at small batches a CPU step costs mostly a fixed price per compiled kernel, not arithmetic
(the MNIST-1D CNN's step runs ~120 kernels; 234 us at batch 2 against 308 us at batch 8, one
thread). Stacked, each kernel runs once for all k folds: 3 folds on one core trained 1.4x faster
than one fold after another (#9). Side-by-side loops (``pipeline.engine.fused``) do better once a trial
has a core per fold loop, so ``pipeline.contract.plan`` stacks for trials with one compute thread, or a GPU.

The researcher's ``build(hp)`` model is not rewritten: its graph is walked (``Functional``'s own
walk) with each weighted layer swapped for its stacked form, and every other layer called as it
is on the folds' samples merged into one batch, which is exact for per-sample layers (pooling,
flatten, activations). A stacked forward pass is checked against every fold model's own output
before it is used. The folds stay independent: each has its own slice of every variable and of
the optimizer's state, its loss, gradient norm and clipping are its own, and a fold whose step is
not finite keeps its slices as they were (the folds' steps are masked, not skipped).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import keras
import numpy as np

from pipeline.contract.plan import has_random_layers
from pipeline.engine.resident import ResidentData
from pipeline.inputs.losses import TrainingLoss
from pipeline.engine.recipe import OptimizerRecipe, TrainingParams
from pipeline.engine.training import EpochTally, FoldEngine, close_shared_epoch, launch_loop, tally_step

STACKED_LAYERS = (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D)
# Optimizers whose update of a weight depends on that weight's own gradient and state only, so
# that one optimizer over the stacked weights updates each fold's slice as the fold's own would
# (Adafactor, say, factors its state over a weight's axes, the fold axis included).
ELEMENTWISE_OPTIMIZERS = (keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.SGD, keras.optimizers.RMSprop,
                          keras.optimizers.Nadam, keras.optimizers.Adamax, keras.optimizers.Adagrad,
                          keras.optimizers.Lion)
# The stacked forward pass must give each fold model's own outputs up to float rounding
# (its convolutions are patch products, not the backend's convolution kernels).
FORWARD_CHECK_RTOL, FORWARD_CHECK_ATOL = 1e-4, 1e-5


def model_blocker(model: keras.Model) -> str | None:
    """Why this model has no stacked form, or None."""
    if has_random_layers(model):
        return "random layers draw per-fold random numbers"
    if model.non_trainable_variables:
        return f"{len(model.non_trainable_variables)} non-trainable variables (layer state)"
    if _graph(model) is None:
        return "the model has no layer graph (a subclassed model, or a Sequential without an Input)"
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.Model):
            return f"nested model {layer.name!r}"
        if not layer.weights:
            continue
        if not isinstance(layer, STACKED_LAYERS):
            return f"{type(layer).__name__} layers have no stacked form"
        if any(getattr(layer, name, None) is not None for name in
               ("kernel_regularizer", "bias_regularizer", "activity_regularizer", "kernel_constraint",
                "bias_constraint")):
            return f"layer {layer.name!r} has a regularizer or constraint"
        if getattr(layer, "lora_enabled", False):
            return f"layer {layer.name!r} has LoRA enabled"
        if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D)):
            if layer.groups != 1 or layer.data_format != "channels_last" or layer.padding not in ("same", "valid"):
                return (f"convolution {layer.name!r} (groups {layer.groups}, {layer.data_format}, padding "
                        f"{layer.padding!r}) has no stacked form")
    return None


def steps_blocker(folds_train_sizes: Sequence[int], batch_size: int) -> str | None:
    """Stacked folds step in lockstep: every fold needs as many steps per epoch."""
    steps = sorted({math.ceil(n / batch_size) for n in folds_train_sizes})
    if len(steps) > 1:
        return f"folds take {steps[0]} to {steps[-1]} steps per epoch at batch {batch_size}"
    return None


def stacking_blocker(models: Sequence[keras.Model], data: ResidentData, train_folds: Sequence[np.ndarray], *,
                     batch_size: int, jit_compile: bool, optimizer: OptimizerRecipe) -> str | None:
    """Why these fold models cannot train stacked, or None (their stacked forward pass checked)."""
    import tensorflow as tf

    if not jit_compile:
        return "the step runs without XLA"
    if optimizer.cls not in ELEMENTWISE_OPTIMIZERS:
        return f"the {optimizer.cls.__name__} optimizer is not known to update each weight on its own"
    blocker = model_blocker(models[0]) or steps_blocker([len(train) for train in train_folds], batch_size)
    if blocker:
        return blocker
    rows = min(batch_size, *(len(train) for train in train_folds))
    samples = tf.gather(data.x, np.concatenate([train[:rows] for train in train_folds]).astype(np.int32))
    if not forward_matches(models, samples):
        return "the stacked forward pass does not reproduce the model's outputs"
    return None


def _graph(model: keras.Model) -> Any:
    """The Functional graph a model runs through, if it has one."""
    if isinstance(model, keras.Sequential):
        return model._functional
    if hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    return None


def stacked_forward(model: keras.Model, stacked: Sequence[Any], x: Any, n_folds: int) -> Any:
    """The model's outputs for ``x`` = the k folds' batches merged fold-major ([k * b, ...]),
    computed with ``stacked`` = the model's trainable variables with a leading fold axis."""
    index = {id(variable): i for i, variable in enumerate(model.trainable_variables)}

    def fold_weights(variable):
        return stacked[index[id(variable)]]

    def stacked_form(layer):
        if isinstance(layer, keras.layers.Dense):
            return lambda inputs, **_: _dense(layer, fold_weights, inputs, n_folds)
        if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D)):
            return lambda inputs, **_: _convolution(layer, fold_weights, inputs, n_folds)
        return layer

    return _graph(model)._run_through_graph(x, operation_fn=stacked_form)


def _per_fold(inputs, n_folds):
    import tensorflow as tf

    return tf.reshape(inputs, [n_folds, -1, *inputs.shape[1:]])


def _merged(outputs):
    import tensorflow as tf

    return tf.reshape(outputs, [-1, *outputs.shape[2:]])


def _dense(layer, fold_weights, inputs, n_folds):
    import tensorflow as tf

    x = _per_fold(inputs, n_folds)
    outputs = tf.einsum("kb...i,kio->kb...o", x, fold_weights(layer.kernel))
    return _bias_and_activation(layer, fold_weights, outputs)


def _convolution(layer, fold_weights, inputs, n_folds):
    """A stride/dilation convolution as one product of patches with each fold's kernel."""
    import tensorflow as tf

    spatial = inputs.shape[1:-1]
    sizes, strides, dilations = layer.kernel_size, layer.strides, layer.dilation_rate
    padding = []
    out_sizes = []
    for size, kernel, stride, dilation in zip(spatial, sizes, strides, dilations):
        reach = (kernel - 1) * dilation + 1
        if layer.padding == "same":
            out = -(-size // stride)
            total = max((out - 1) * stride + reach - size, 0)
            padding.append((total // 2, total - total // 2))  # TensorFlow's SAME: the extra at the end
        else:
            out = (size - reach) // stride + 1
            padding.append((0, 0))
        out_sizes.append(out)
    x = tf.pad(inputs, [[0, 0], *padding, [0, 0]])
    patches = []
    for offsets in np.ndindex(*sizes):  # kernel taps in the kernel's own (row-major) order
        begin = [0] + [o * d for o, d in zip(offsets, dilations)] + [0]
        end = [0] + [b + (n - 1) * s + 1 for b, n, s in zip(begin[1:], out_sizes, strides)] + [0]
        patches.append(tf.strided_slice(x, begin, end, [1, *strides, 1], begin_mask=1 | (1 << (len(begin) - 1)),
                                        end_mask=1 | (1 << (len(begin) - 1))))
    patches = _per_fold(tf.concat(patches, axis=-1), n_folds)  # [k, b, *out, taps * channels]
    kernel = fold_weights(layer.kernel)
    kernel = tf.reshape(kernel, [n_folds, -1, kernel.shape[-1]])  # [k, taps * channels, filters]
    outputs = tf.einsum("kb...c,kcf->kb...f", patches, kernel)
    return _bias_and_activation(layer, fold_weights, outputs)


def _bias_and_activation(layer, fold_weights, outputs):
    """The layer's bias (each fold's own) and activation on [k, b, ..., units] outputs."""
    if layer.use_bias:
        outputs += _over_folds(fold_weights(layer.bias), outputs.shape.rank)
    return layer.activation(_merged(outputs))


def _over_folds(values, rank):
    """[k, *trailing] per-fold values (a mask, a scale, a bias) shaped to broadcast against a
    rank-``rank`` tensor whose first axis is the fold axis and whose last axes are ``trailing``."""
    import tensorflow as tf

    return tf.reshape(values, [values.shape[0]] + [1] * (rank - values.shape.rank) + list(values.shape[1:]))


def over_folds(per_fold: Sequence[Any]) -> np.ndarray:
    """One variable's per-fold values, stacked along a leading fold axis."""
    return np.stack([np.asarray(value) for value in per_fold])


def stacked_weights(models: Sequence[keras.Model]) -> list[np.ndarray]:
    """The models' trainable variables, each stacked along a leading fold axis."""
    return [over_folds(weights) for weights in zip(*(model.trainable_variables for model in models))]


def forward_matches(model_list: Sequence[keras.Model], samples: Any) -> bool:
    """Whether the stacked forward pass gives each fold model's own outputs; ``samples`` are the
    folds' batches merged fold-major, different per fold so that mixing across folds shows."""
    import tensorflow as tf

    stacked = [tf.constant(weights) for weights in stacked_weights(model_list)]
    outputs = np.asarray(stacked_forward(model_list[0], stacked, samples, len(model_list)))
    batches = np.split(np.asarray(samples), len(model_list))
    own = np.concatenate([np.asarray(model(batch, training=True)) for model, batch in zip(model_list, batches)])
    return outputs.shape == own.shape and np.allclose(outputs, own, rtol=FORWARD_CHECK_RTOL,
                                                      atol=FORWARD_CHECK_ATOL)


def fold_square_sums(gradient):
    """[k]: each fold's sum of squares of one stacked gradient."""
    import tensorflow as tf

    return tf.reduce_sum(tf.square(gradient), axis=list(range(1, gradient.shape.rank)))


def fold_norms(gradients):
    """[k]: each fold's global norm over all its gradient slices."""
    import tensorflow as tf

    return tf.sqrt(tf.add_n([fold_square_sums(gradient) for gradient in gradients]))


def clip_per_fold(kind: str, threshold: float | None) -> Callable[[list[Any], Any], list[Any]]:
    """Keras' clipping by the optimizer argument of clipping ``kind``, on each fold's slices:
    ``norm`` per variable slice, ``global_norm`` over one fold's slices (``fold_norms``, which the
    step has already computed for its health check), ``value`` elementwise."""
    import tensorflow as tf

    def by_norm(gradients, _):  # keras BaseOptimizer._clip_by_norm, per fold
        clipped = []
        for gradient in gradients:
            l2sum = _over_folds(fold_square_sums(gradient), gradient.shape.rank)
            positive = l2sum > 0
            l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
            clipped.append(gradient * threshold / tf.maximum(l2norm, threshold))
        return clipped

    def by_global_norm(gradients, norm):  # keras clip_by_global_norm, per fold
        scale = threshold * tf.minimum(1.0 / norm, 1.0 / threshold) + (norm - norm)
        return [g * _over_folds(scale, g.shape.rank) for g in gradients]

    def by_value(gradients, _):
        return [tf.clip_by_value(g, -threshold, threshold) for g in gradients]

    return {"none": lambda gradients, _: gradients, "norm": by_norm, "global_norm": by_global_norm,
            "value": by_value}[kind]


class StackedFolds:
    """Trains fold engines one epoch at a time, stacked into one XLA program per step.

    The fold engines keep the truth between epochs (their models are evaluated, checkpointed and
    restored): an epoch starts by stacking their variables and optimizer state and ends by
    writing each fold's slices back.
    """

    def __init__(self, engines: Sequence[FoldEngine], params: TrainingParams, *, data: ResidentData,
                 loss: TrainingLoss, optimizer: OptimizerRecipe, steps_per_launch: int):
        import tensorflow as tf

        self._engines = list(engines)
        self._batch_size = params.batch_size
        n_folds = len(engines)
        self._variables, self._optimizer, self._pairs = _stacked_state(engines, optimizer)
        steps = tf.function(_stacked_steps(engines[0].model, self._variables, self._optimizer, self._pairs, loss=loss,
                                           clipping=optimizer.clipping, data=data), jit_compile=True, autograph=False)
        self.compiled_steps = steps

        def stopped(tally, live):
            return tf.reduce_all(~live | (tally[2] >= 0))

        def train_epoch(indices, weights, live):
            # indices, weights: [steps, k, batch]; the epoch's steps, steps_per_launch per launch.
            zeros = tf.zeros([n_folds])
            tally = (zeros, tf.zeros([n_folds], tf.int32), -tf.ones([n_folds], tf.int32), zeros, zeros)
            return launch_loop(lambda *arguments: steps(*arguments[:2], live, *arguments[2:]), (indices, weights),
                               tally, steps_per_launch=steps_per_launch, stopped=lambda tally: stopped(tally, live))

        self._train_epoch = tf.function(train_epoch, autograph=False)

    def epoch_batches(self, epoch: int, live: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """[steps, k, batch] index and weight arrays: each live fold's batches of this epoch,
        its short last batch padded with weight 0; folds not live get weight 0 throughout."""
        per_fold = {}
        for i in live:
            full, remainder = self._engines[i].epoch_batches(epoch)
            per_fold[i] = [*full, remainder] if len(remainder) else list(full)
        n_steps = len(next(iter(per_fold.values())))
        indices = np.zeros((n_steps, len(self._engines), self._batch_size), dtype=np.int32)
        weights = np.zeros(indices.shape, dtype=np.float32)
        for i, batches in per_fold.items():
            for step, batch in enumerate(batches):
                indices[step, i, :len(batch)] = batch
                weights[step, i, :len(batch)] = 1.0
        return indices, weights

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        """Train the engines at positions ``live`` one epoch; returns their mean training loss."""
        import tensorflow as tf

        self._load(live)
        indices, weights = self.epoch_batches(epoch, live)
        mask = np.isin(np.arange(len(self._engines)), live)
        with tf.device(self._engines[0].device):
            arguments = tf.constant(indices), tf.constant(weights), tf.constant(mask)
        started = time.perf_counter()
        tally = [np.asarray(value) for value in self._train_epoch(*arguments)]
        seconds = time.perf_counter() - started
        self._store(live)
        return close_shared_epoch(self._engines, live, epoch, seconds,
                                 [EpochTally.of([value[i] for value in tally]) for i in live])

    def _load(self, live: tuple[int, ...]) -> None:
        """Stack the engines' weights and optimizer state (they may have been restored)."""
        for stacked, per_fold in self._pairs:
            if stacked.shape.rank:
                stacked.assign(over_folds(per_fold))
            else:  # the step count and learning rate, the same in every fold that trains on
                stacked.assign(np.asarray(per_fold[live[0]]))

    def _store(self, live: tuple[int, ...]) -> None:
        for stacked, per_fold in self._pairs:
            values = np.asarray(stacked)
            for i in live:
                per_fold[i].assign(values[i] if stacked.shape.rank else values)


def _stacked_state(engines: Sequence[FoldEngine], recipe: OptimizerRecipe) -> tuple[list[Any], Any, list[Any]]:
    """The stacked weights, one optimizer over them, and each stacked variable paired with the
    folds' own: weights always carry the fold axis, optimizer state too except the shared scalars
    (step count, learning rate)."""
    n_folds = len(engines)
    models = [engine.model for engine in engines]
    variables = [keras.Variable(weights, name=variable.name) for weights, variable
                 in zip(stacked_weights(models), models[0].trainable_variables)]
    # Clipping is done per fold before the optimizer sees the gradients; everything the
    # optimizers below do is elementwise, so each fold's slice is updated on its own.
    optimizer = recipe.make(clipping=False)
    optimizer.build(variables)
    state_pairs = list(zip(optimizer.variables, zip(*(engine.optimizer.variables for engine in engines))))
    for stacked, per_fold in state_pairs:
        if tuple(stacked.shape) not in (tuple(per_fold[0].shape), (n_folds, *per_fold[0].shape)):
            raise ValueError(f"optimizer variable {stacked.name!r}: stacked shape {tuple(stacked.shape)} "
                             f"does not match a fold's {tuple(per_fold[0].shape)}")
    pairs = list(zip(variables, zip(*(model.trainable_variables for model in models)))) + state_pairs
    return variables, optimizer, pairs


def _stacked_steps(template: keras.Model, variables: list[Any], optimizer: Any, pairs: list[Any], *,
                   loss: TrainingLoss, clipping: tuple[str, float | None], data: ResidentData) -> Any:
    """The stacked folds' training launch, uncompiled: ``train_steps(indices, weights, live,
    first_step, tally)`` runs the unrolled steps of every fold at once ([steps, k, batch]) and
    returns the per-fold tally after them."""
    import tensorflow as tf

    n_folds = int(variables[0].shape[0])
    # What a fold that does not apply a step keeps: its slices of the weights and of the
    # optimizer's per-variable state (the step count and learning rate are shared scalars).
    kept = [stacked for stacked, _ in pairs if stacked.shape.rank]
    clip = clip_per_fold(*clipping)
    features, labels = data.x, data.y

    def train_step(indices, weights, active):
        # indices, weights: [k, batch]; a weight of 0 pads a fold's short last batch.
        x = tf.gather(features, tf.reshape(indices, [-1]))
        y = tf.reshape(tf.gather(labels, indices), [-1])
        counts = tf.reduce_sum(weights, axis=1)
        with tf.GradientTape() as tape:
            predictions = stacked_forward(template, variables, x, n_folds)
            per_sample = tf.reshape(loss.per_sample(y, predictions), [n_folds, -1])
            losses = tf.reduce_sum(per_sample * weights, axis=1) / tf.maximum(counts, 1.0)
            total = tf.reduce_sum(losses)  # each fold's slices get its own loss' gradient only
        gradients = tape.gradient(total, variables)
        norms = fold_norms(gradients)
        healthy = tf.math.is_finite(losses) & tf.math.is_finite(norms)
        applied = healthy & active
        previous = [tf.identity(v.value) for v in kept]
        optimizer.apply_gradients(zip(clip(gradients, norms), variables))
        # A fold not applying this step keeps its slices of the weights and optimizer state.
        for variable, before in zip(kept, previous):
            variable.assign(tf.where(_over_folds(applied, variable.shape.rank), variable.value, before))
        return losses, norms, healthy, counts

    def train_steps(indices, weights, live, first_step, tally):
        for j in range(indices.shape[0]):
            active = live & (tally[2] < 0)
            losses, norms, healthy, counts = train_step(indices[j], weights[j], active)
            tally = tally_step(tally, step=first_step + j, loss=losses, norm=norms, healthy=healthy,
                               active=active, samples=counts)
        return tally

    return train_steps
