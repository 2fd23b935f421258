"""One fold's training engine: its model, optimizer and compiled epoch loop, fast.

Where the time goes at small batch sizes is fixed per-step cost, not arithmetic, so the engine
removes it: batches are index vectors gathered from device-resident tensors inside the compiled
step, a whole epoch runs as one execution (a loop inside one ``tf.function``, what Keras calls
``steps_per_execution`` = steps per epoch), there are no per-batch callbacks, the step is
XLA-compiled where the trial's plan says so, and several steps can be unrolled into one compiled
launch (``pipeline.contract.plan`` decides both). A ``FoldExecutor`` trains a trial's engines one epoch at
a time, in the plan's layout: ``pipeline.engine.sequential`` one after another,
``pipeline.engine.side_by_side`` side by side in one execution, ``pipeline.engine.stacked`` stacked
into one XLA program.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import keras
import numpy as np

from pipeline.base.tensorflow_private import call_with_captures
from pipeline.contract.plan import TrialPlan
from pipeline.contract.results import EVAL_STEP, NanEvent
from pipeline.engine import draws, graph_identity
from pipeline.engine.compiled_loop import EpochTally, compiled_launch, epoch_loop, tally_step
from pipeline.engine.recipe import TrainingParams, TrainingRecipe
from pipeline.engine.resident import ResidentData, step_labels
from pipeline.inputs.folds import Fold
from pipeline.inputs.losses import TrainingLoss
from pipeline.inputs.scoring import ValidationMetrics
from pipeline.inputs.spec import ClassWeight

EVAL_BATCH_SIZE = 2048


def epoch_order(train_indices: np.ndarray, *, seed: int, epoch: int) -> np.ndarray:
    """A fold's training order in one epoch: a permutation drawn from (fold seed, epoch), so any
    epoch can be replayed exactly, in a fresh process or after a restore."""
    return np.random.default_rng([seed, epoch]).permutation(train_indices)


def fold_seed(trial_seed: int, fold: int) -> int:
    """Each fold's initialisation and shuffling seed, independent of which trials ran before."""
    return int(np.random.SeedSequence([trial_seed, fold]).generate_state(1)[0])


class FoldSteps(NamedTuple):
    """One fold's training launch and evaluation, uncompiled (``fold_steps``)."""

    train_steps: Callable[..., Any]
    evaluate_batch: Callable[..., Any]
    # The variables whose gradients the step's global norm adds up, in its order (a variable
    # whose gradient is None is left out), known once the step is traced: TensorFlow names the
    # norm's ops global_norm/L2Loss, L2Loss_1, ... in that order. Empty for a fold that runs
    # another's step, which numeric checking (what reads them) never lets it.
    norm_variables: list[Any]
    # The traced step, for the trial's other folds to run (``shared_step``); None when eager.
    traced: TracedStep | None
    # Whether this fold runs another fold's traced step, where it was given one (a template).
    choice: StepChoice | None


class TracedStep(NamedTuple):
    """A fold's training step traced, with the variables it captures of its fold: the model's, the
    optimizer's and the class weights, in their order (``fold_steps``); the model's training
    forward pass (``forward``), which ``shared_step`` traces in place of the whole step to compare
    a fold's with another's, None where the optimizer's update does to a variable what no forward
    pass shows (a constraint, a gradient that overwrites its variable); and what else the step's
    program follows from (``follows``): which of the variables train, which are the layers' state,
    the optimizer's class and configuration, whether the steps are masked."""

    function: Any  # a tf.function with an input signature
    variables: list[Any]
    forward: Any | None  # a tf.function of the step's batch indices
    follows: tuple[Any, ...]


def traced_once(
    step: Callable[..., Any],
    *,
    eager: bool,
    compiled: bool = False,
    inlined: bool = False,
    signature: Sequence[Any] | None = None,
) -> Callable[..., Any]:
    """A training step that a launch of several unrolled steps traces once, not once per step.

    The launch calls it as a function of its own: tracing a Keras model's forward and backward
    pass is paid once per launch shape instead of once per step. In a ``compiled`` launch
    (``compiled_launch``) XLA also lowers it once and calls it where the launch does, and its
    optimizer inlines the calls: the same instructions as the unrolled Python copies made, so
    the same numbers, where lowering each copy was most of a warm start from the compile cache
    (TensorFlow lowers several of a CNN's ops, ReLU, softmax and the square roots of Adam, through
    an MLIR pipeline of its own per op). (A launch written as a graph loop instead, which XLA would
    also compile once, trained 2.9-15x slower per step on CPU, at batch 8 and 64 on both datasets:
    XLA:CPU runs a convolution's gradient inside a loop body 3.5x slower already at batch 8;
    ``python -m benchmarks.launch_form``.)

    With a ``signature`` whose batch dimension is None, as Keras' fit traces its train step, one
    trace serves an epoch's full batches and its shorter last batch too; XLA still compiles a
    program per batch size, from the shapes the launch calls it with. The numbers are those of a
    step traced per batch size, to the last bit (every score the quickstart sweep records); a
    side-by-side quickstart trial at batch 64 with every program cached compiled in 4.0 s against
    6.3 s (one pair of runs), and the quickstart's trials in 114-126 s in all against 124-127 s
    (5 and 3 sweeps on an empty cache).

    Uncompiled, the step is a function the epoch calls too, unless ``inlined`` (the plan's
    ``step_inlined``): TensorFlow's graph optimizer then works through it once, where inlined at
    each of the epoch's calls (its launches and its last batch) it optimized every copy, 2-3x the
    first epoch's compile of a deep model."""
    import tensorflow as tf

    if eager:
        return step
    return tf.function(
        step,
        autograph=False,
        input_signature=signature,
        experimental_attributes=None if inlined and not compiled else {"_noinline": True},
    )


def shared_step(template: TracedStep, own: TracedStep, *, kept: Sequence[Any]) -> Callable[..., Any] | None:
    """The ``template`` fold's traced step run on this fold's variables (``own``), where that is
    this fold's own step; else None, and the fold runs its own.

    A trial's fold models are one ``build(hp)`` under k seeds: their steps trace to one graph but
    for names and captures, so each fold's launch can call the template's graph with its own
    variables in their place, and TensorFlow traces, optimizes and instantiates one graph per trial
    instead of one per fold (a MobileNet's: tens of seconds each). What the template captures must
    be its variables and the data (``kept``), each with this fold's in its place. The fold's
    forward pass is traced to be compared (for a MobileNetV2, a fifth of tracing its whole step):
    its graph must be the template's program (``graph_identity``) over the same captures. The rest
    of the step follows from the forward graph (TensorFlow derives each op's gradient from the
    op), from the loss (one object for every fold), from the optimizer (made from one recipe for
    every fold) and from which variables train, compared as ``follows``. The fold's whole step is
    traced and compared instead where that is not so: where the forward pass holds an op whose
    gradient a Python function computes (``tf.custom_gradient``: the graph shows the op, not
    what its gradient computes), or where the update does to a variable what no forward pass
    shows (``TracedStep.forward`` None: a weight constraint). A NumPy array or an integer seed
    that ``build`` draws under the fold's seed and keeps outside its variables is a constant or an
    attribute of the graph the comparison reads, so a fold holding one runs its own step. The
    template must have been traced already, where its launch was (this runs in a thread of its
    own, outside the graph the tracing thread builds)."""
    # A step that fails to trace here fails, or not, where the fold calls its own step, which
    # then says why.
    try:
        if template.function.experimental_get_tracing_count() != 1:
            return None
        concrete = template.function.get_concrete_function()
        if template.function.experimental_get_tracing_count() != 1:
            return None
        if [(v.shape, v.dtype) for v in template.variables] != [(v.shape, v.dtype) for v in own.variables]:
            return None
        if template.follows != own.follows:
            return None
        replacement = _replacement(template, own, kept=kept)
        captures = _captures_in_place(concrete, replacement)
        if captures is None:
            return None
        compared = None if template.forward is None else template.forward.get_concrete_function()
        if compared is None or own.forward is None or graph_identity.python_gradients(compared):
            compared, own_compared = concrete, own.function.get_concrete_function()
        else:
            own_compared = own.forward.get_concrete_function()
        own_captures = _captures_in_place(compared, replacement)
        if own_captures is None:
            return None
        if [id(capture) for capture in own_compared.captured_inputs] != [id(capture) for capture in own_captures]:
            return None
        if not graph_identity.same_program(compared, own_compared):
            return None
    except Exception:
        return None

    def step(*arguments):
        return call_with_captures(concrete, arguments, captures)

    return step


def _replacement(template: TracedStep, own: TracedStep, *, kept: Sequence[Any]) -> dict[int, Any]:
    """Each capture of the template fold's traced functions (by id): this fold's in its place."""
    replacement = {id(t.handle): o.handle for t, o in zip(template.variables, own.variables)}
    replacement.update({id(tensor): tensor for tensor in kept})
    return replacement


def _captures_in_place(function: Any, replacement: dict[int, Any]) -> list[Any] | None:
    """What the template's traced ``function`` captures, each with this fold's in its place; None
    where it captures something not in ``replacement``."""
    captured = function.captured_inputs
    return None if any(id(c) not in replacement for c in captured) else [replacement[id(c)] for c in captured]


class StepChoice:
    """A fold's step, the ``template`` fold's where ``shared_step`` finds it this fold's own, else
    the fold's own traced step (``own.function``): called as a step, chosen as the launch first
    calls it, so that the comparison counts in the trial's compile time, or earlier where the
    trial's epoch asks (``shared_epochs``); chosen once either way. The fold's forward pass is
    traced for the comparison in a thread of its own: this one may be tracing the launch."""

    def __init__(self, template: TracedStep, own: TracedStep, *, kept: Sequence[Any], device: str):
        self.template, self.own, self.kept, self.device = template, own, kept, device
        self._chosen: list[Callable[..., Any] | None] = []

    def shared(self) -> Callable[..., Any] | None:
        """The template's step on this fold's variables where it is this fold's step, else None."""
        import tensorflow as tf

        def check() -> Callable[..., Any] | None:
            with tf.device(self.device):
                return shared_step(self.template, self.own, kept=self.kept)

        if not self._chosen:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                self._chosen.append(pool.submit(check).result())
        return self._chosen[0]

    def __call__(self, *arguments: Any) -> Any:
        return (self.shared() or self.own.function)(*arguments)


@dataclass(frozen=True)
class FoldStepForm:
    """How one fold's training step is built, as the trial's plan says (``of``): its batch size;
    whether its random layers draw foldsweep's numbers (``counter_draws``); whether a step's
    update is masked rather than skipped (``masked``: the per-epoch stop test); eager, compiled
    by XLA, or a graph whose step is inlined at each call (``inlined``); and whether a short last
    batch runs padded (``padded``)."""

    batch_size: int = 1
    counter_draws: bool = False
    masked: bool = False
    eager: bool = False
    compiled: bool = False
    inlined: bool = False
    padded: bool = False

    @classmethod
    def of(cls, plan: TrialPlan, *, batch_size: int, eager: bool) -> FoldStepForm:
        return cls(
            batch_size=batch_size,
            counter_draws=plan.random_draws == "counter",
            masked=plan.stop_test == "per_epoch",
            eager=eager,
            compiled=plan.jit_compile,
            inlined=plan.step_inlined,
            padded=plan.last_batch_padded,
        )


def fold_steps(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    loss: TrainingLoss,
    data: ResidentData,
    form: FoldStepForm,
    *,
    metrics: ValidationMetrics | None = None,
    class_weights: np.ndarray | None = None,
    template: TracedStep | None = None,
) -> FoldSteps:
    """One fold's training launch and evaluation, uncompiled, over device-resident data:
    ``train_steps(batches, first_step, tally)`` runs the unrolled steps of ``batches``
    ([steps, batch] indices) and returns the epoch's tally after them; ``evaluate_batch(indices)``
    the summed loss and correct predictions of one batch, adding it to ``metrics``' states (Keras'
    stateful metrics, as its ``test_step`` updates them). As ``form`` says (``FoldStepForm``):
    with ``counter_draws`` the model's random layers draw foldsweep's numbers
    (``pipeline.engine.draws``), else Keras' own. With
    ``masked`` (the plan's per-epoch stop test) a step computes its update whatever its health
    and keeps it only where it applies, with no tf.cond: a step not active keeps the layer state
    too, so that steps after a failure change nothing. With ``eager`` the steps run op by op; with
    ``compiled`` (an XLA-compiled launch, ``compiled_launch``) XLA lowers the step once; uncompiled,
    the step is called as a function of its own unless ``inlined`` (``traced_once``). With a
    ``template`` (another fold's ``FoldSteps.traced``) the launch runs that fold's traced step on
    this fold's variables where it is this fold's step (``StepChoice``). With ``padded``
    (the plan's ``last_batch_padded``) each step is told how many of its batch's samples are the
    batch's own (``rows``): the rest pad a short last batch and are masked out of its loss, its
    gradient and the tally, so that the launch has one shape per batch size."""
    import tensorflow as tf

    features, labels = data.x, data.y
    norm_variables: list[Any] = []
    # fit(class_weight=...): each sample's loss weighted by its class's weight, the batch's loss
    # their mean (Keras' sum_over_batch_size divides by the batch, not by the weights' sum). A
    # variable, which a traced step captures as it captures the model's, where a small tensor
    # would be a constant of the graph, each fold's another (``shared_step``).
    weights = None if class_weights is None else tf.Variable(class_weights, trainable=False, dtype=tf.float32)
    random_numbers = (
        functools.partial(draws.counter_draws, under_xla=form.compiled)
        if form.counter_draws
        else contextlib.nullcontext
    )

    def train_step(indices, *arguments):
        rows, enabled = arguments if form.padded else (None, *arguments)
        x = tf.gather(features, indices)
        y = step_labels(tf.gather(labels, indices))
        states = list(model.non_trainable_variables) if form.masked else []
        states_before = [tf.identity(state.value) for state in states]
        with tf.GradientTape() as tape, random_numbers():
            predictions = model(x, training=True)
            per_sample = loss.per_sample(y, predictions)
            if weights is not None:
                per_sample = per_sample * tf.cast(tf.gather(weights, y), per_sample.dtype)
            if rows is None:
                value = loss.batch_loss(y, per_sample)
            else:
                value = loss.padded_batch_loss(y, per_sample, tf.range(tf.shape(indices)[0]) < rows)
            if model.losses:
                value = value + tf.add_n(model.losses)
        gradients = tape.gradient(value, model.trainable_variables)
        normed = [
            (gradient, variable)
            for gradient, variable in zip(gradients, model.trainable_variables)
            if gradient is not None
        ]
        norm_variables[:] = [variable for _, variable in normed]
        norm = tf.linalg.global_norm([gradient for gradient, _ in normed])
        # A scalar test per step: a non-finite loss or gradient is never applied, so the fold
        # stops with the weights of its last good step.
        healthy = tf.math.is_finite(value) & tf.math.is_finite(norm)

        if form.masked:
            _masked_update(optimizer, gradients, model.trainable_variables, applied=healthy & enabled)
            for state, before in zip(states, states_before):
                state.assign(tf.where(enabled, state.value, before))
            return value, norm, healthy

        def apply():
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return (0,)

        tf.cond(healthy & enabled, apply, lambda: (0,))
        return value, norm, healthy

    # Index batches of any length (the last batch of an epoch is shorter, unless padded), how many
    # of them are the batch's own where padded, and the step's switch.
    signature = (
        tf.TensorSpec([None], data.index_dtype),
        *([tf.TensorSpec([], tf.int32)] if form.padded else []),
        tf.TensorSpec([], tf.bool),
    )

    def forward(indices):
        # The model's part of ``train_step``, as it calls it (``shared_step`` compares folds by it).
        with random_numbers():
            predictions = model(tf.gather(features, indices), training=True)
        return predictions, (tf.add_n(model.losses) if model.losses else tf.constant(0.0))

    step = traced_once(train_step, eager=form.eager, compiled=form.compiled, inlined=form.inlined, signature=signature)
    traced = None
    if not form.eager:
        variables = [*model.variables, *optimizer.variables, *([] if weights is None else [weights])]
        position = {id(variable): i for i, variable in enumerate(variables)}
        follows = (
            [position.get(id(variable)) for variable in model.trainable_variables],
            [position.get(id(variable)) for variable in model.non_trainable_variables],
            type(optimizer),
            _settings(optimizer),
            form.masked,
        )
        # A constraint (or a gradient that overwrites its variable) is applied in the update.
        update_unseen = any(
            getattr(variable, "constraint", None) is not None or getattr(variable, "overwrite_with_gradient", False)
            for variable in model.trainable_variables
        )
        traced_forward = None if update_unseen else tf.function(forward, autograph=False, input_signature=signature[:1])
        traced = TracedStep(step, variables, traced_forward, follows)
    choice = None
    if template is not None and traced is not None:
        step = choice = StepChoice(template, traced, kept=(features, labels), device=data.device)

    def train_steps(batches, *arguments):
        # One compiled launch: the steps of ``batches`` (a static number of steps, unrolled),
        # each adding to the epoch's tally inside the launch. Once a step fails, the steps after
        # it in the launch apply nothing. Padded, each step's own samples come as ``rows``.
        rows, first_step, tally = arguments if form.padded else (None, *arguments)
        for j in range(batches.shape[0]):
            active = tally.intact
            value, norm, healthy = step(batches[j], rows[j], active) if form.padded else step(batches[j], active)
            tally = tally_step(
                tally,
                step=first_step + j,
                loss=value,
                norm=norm,
                healthy=healthy,
                active=active,
                samples=(batches.shape[1] or tf.shape(batches)[1]) if rows is None else rows[j],
            )
        return tally

    def evaluate_batch(indices):
        y = step_labels(tf.gather(labels, indices))
        predictions = model(tf.gather(features, indices), training=False)
        if metrics is not None:
            metrics.update(loss.metric_targets(y, predictions), predictions)
        correct = tf.reduce_sum(loss.correct(y, predictions)) if loss.own_accuracy else tf.constant(0.0)
        # Keras' evaluate adds up its batches' losses (of the trial's batch size) weighted by
        # their sizes: with ignore_class that is not the mean over every position kept.
        total = loss.batches_loss_sum(y, loss.per_sample(y, predictions), form.batch_size)
        if model.losses:  # and each batch's loss has the model's loss terms in it, as in training
            total = total + tf.cast(tf.shape(indices)[0], total.dtype) * tf.add_n(model.losses)
        return total, correct

    return FoldSteps(train_steps, evaluate_batch, norm_variables, traced, choice)


def _settings(optimizer: keras.optimizers.Optimizer) -> Any:
    """The optimizer's configuration, or the optimizer itself where it has none to give (a
    schedule that cannot say its own): another fold's optimizer is then never taken for it."""
    try:
        return optimizer.get_config()
    except Exception:
        return optimizer


def _masked_update(
    optimizer: keras.optimizers.Optimizer, gradients: Sequence[Any], variables: Sequence[Any], *, applied: Any
) -> None:
    """The optimizer's update of ``variables`` kept where ``applied``, else every variable it
    touches (weights and optimizer state, its step count included) left as it was: the same
    values as applying under a tf.cond, with no predicate for the host to read."""
    import tensorflow as tf

    kept = [*variables, *optimizer.variables]
    previous = [tf.identity(variable.value) for variable in kept]
    optimizer.apply_gradients(zip(gradients, variables))
    for variable, before in zip(kept, previous):
        variable.assign(tf.where(applied, variable.value, before))


@dataclass(frozen=True)
class StoppedCall:
    """Where an error (TensorFlow's numeric checking) stopped a fold engine mid-call: its model,
    the variables its step's gradient norm adds up (``FoldSteps.norm_variables``), the epoch
    (1-based) and the step within it (0-based; ``EVAL_STEP`` in validation), as ``NanEvent``
    counts them, and the fold's number in the sweep once the trainer adds it."""

    model: Any
    norm_variables: tuple[Any, ...]
    epoch: int
    step: int
    fold: int | None = None


class CallTimer:
    """Execution times of one compiled function; the first call carries tracing and compilation."""

    def __init__(self) -> None:
        self.first_s = 0.0
        self.first_samples = 0
        self.steady_s = 0.0
        self.steady_samples = 0

    def add(self, seconds: float, samples: int) -> None:
        if self.first_samples == 0:
            self.first_s, self.first_samples = seconds, samples
        else:
            self.steady_s += seconds
            self.steady_samples += samples

    def samples_per_s(self) -> float:
        """Steady-state rate once a compiled call has been timed, else the first call's rate."""
        if self.steady_samples:
            return self.steady_samples / self.steady_s
        return self.first_samples / self.first_s if self.first_s else float("nan")

    def compile_s(self) -> float:
        """First call's time beyond what its samples cost at the steady rate (NaN until known)."""
        if not self.steady_samples:
            return float("nan")
        return max(0.0, self.first_s - self.first_samples / self.samples_per_s())


class ModelProbe(NamedTuple):
    """What one look at a model (a call on a sample, its state given back) tells its validation."""

    loss_terms: bool  # it has loss terms (``model.losses``), which evaluate adds to each batch's loss
    per_batch: bool  # its layers add loss terms or change its state as they are called


def probe_model(model: keras.Model, data: ResidentData, fold: Fold) -> ModelProbe:
    """Call the model on a sample of ``fold`` as validation calls it, and give its state back: its
    weights' regularization shows without a call, what its layers add or change as they are called
    only in one. Where they do, evaluate computes it on each batch of the trial's size, one after
    another (``TrialPlan.validated_per_batch``)."""
    import tensorflow as tf

    with tf.device(data.device), state_kept(model) as changed:
        model(tf.gather(data.x, np.asarray(fold.val[:1], dtype=data.index_dtype)), training=False)
    return ModelProbe(loss_terms=bool(model.losses), per_batch=adds_losses_when_called(model) or bool(changed))


@contextlib.contextmanager
def state_kept(model: keras.Model) -> Iterator[list[bool]]:
    """Run the block (calls of the model that only look at it), then give the model's
    non-trainable state back as it was: a layer may update it at every call, inference too (a
    counter, a BatchNormalization called in training mode), which fit never saw these calls do.
    The list yielded holds True after the block if the calls changed it."""
    variables = list(model.non_trainable_variables)
    before = [np.array(variable.numpy(), copy=True) for variable in variables]
    changed: list[bool] = []
    yield changed
    for variable, value in zip(variables, before):
        if not np.array_equal(variable.numpy(), value, equal_nan=value.dtype.kind == "f"):
            variable.assign(value)
            changed[:] = [True]


def adds_losses_when_called(model: keras.Model) -> bool:
    """Whether, of the model's loss terms (``model.losses``) after a call, some are added by its
    layers as they are called (activity regularizers, ``add_loss``), rather than computed from
    its weights (their regularizers)."""
    regularized = sum(1 for variable in model.trainable_weights if variable.regularizer is not None)
    return len(model.losses) > regularized


class FoldEngine:
    """One fold's model, optimizer and compiled epoch loop over device-resident data."""

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        data: ResidentData,
        fold: Fold,
        *,
        plan: TrialPlan,
        recipe: TrainingRecipe,
        params: TrainingParams,
        loss: TrainingLoss,
        seed: int,
        template: TracedStep | None = None,
    ):
        """``model`` trained by its own ``optimizer`` on ``fold`` of ``data``, executed as the
        trial's ``plan`` says, with what its ``recipe`` (the spec's ``train`` section, eager or
        not) and ``params`` (batch size, shuffling) ask, its ``loss`` and the fold's ``seed``;
        its step another fold's traced step (``template``, ``shared_step``) where that is the same."""
        import tensorflow as tf

        self.model = model
        self.optimizer = optimizer
        # An epoch's index batches, full and the remainder, of any fold's length (``shared_epochs``).
        self.epoch_signature = (
            tf.TensorSpec([None, params.batch_size], data.index_dtype),
            tf.TensorSpec([None], data.index_dtype),
        )
        self.step_inlined = plan.step_inlined
        self.own_accuracy = loss.own_accuracy
        self.batch_size = params.batch_size
        self.seed = seed
        self.jit_compile = plan.jit_compile
        self.last_batch_padded = plan.last_batch_padded
        self.stop_test = plan.stop_test
        self.device = data.device
        self._train_indices = np.asarray(fold.train, dtype=data.index_dtype)
        self._val_indices = np.asarray(fold.val, dtype=data.index_dtype)
        self.train_timer = CallTimer()
        self.eval_timer = CallTimer()
        self.failure: NanEvent | None = None
        self.shuffle = params.shuffle
        # What the engine is running, from the start of a call until it returns, so that an error
        # leaves it set (``stopped_call``): the epoch, and in training the steps the optimizer
        # had applied before it.
        self._running: tuple[int, int | None] | None = None
        optimizer.build(model.trainable_variables)
        # The model's compiled metrics and the spec's, this fold's own objects, their variables
        # made before the evaluation is traced.
        self.metrics = ValidationMetrics(model, recipe.train.metrics, own_accuracy=loss.own_accuracy)
        with tf.device(self.device), state_kept(model):
            first = self._val_indices[:1]
            predictions = model(tf.gather(data.x, first), training=False)
            self.metrics.build(loss.metric_targets(step_labels(tf.gather(data.y, first)), predictions), predictions)
        # Validation chunks hold whole batches of the trial's size (see ``batches_loss_sum``), one
        # each where the plan says so (``TrialPlan.validated_per_batch``).
        per_launch = 1 if plan.validated_per_batch else max(1, EVAL_BATCH_SIZE // self.batch_size)
        self._eval_chunk = self.batch_size * per_launch
        eager = recipe.choices.eager
        per_epoch = plan.stop_test == "per_epoch"
        train_steps, evaluate_batch, self.norm_variables, self.traced_step, self.step_choice = fold_steps(
            model,
            optimizer,
            loss,
            data,
            FoldStepForm.of(plan, batch_size=self.batch_size, eager=eager),
            metrics=self.metrics,
            class_weights=fold_class_weights(recipe.train.class_weight, data, fold),
            template=template,
        )
        # Shapes are not relaxed: the unrolled step needs its number of steps statically (it
        # sees at most three: a launch, one batch, the remainder).
        # No AutoGraph, as in Keras' fit (its step is do_not_convert): the researcher's loss and
        # layers are traced as Python, exactly as fit traces them, and the engine writes its own
        # loops and conditions as tf.while_loop and tf.cond. Converting the engine's functions
        # cost each process about a second of CPU before its first trial, for the same graph.
        steps = train_steps if eager else compiled_launch(train_steps, jit_compile=plan.jit_compile)
        # The uncompiled epoch loop (its steps compiled), for ``pipeline.engine.side_by_side`` to
        # run several folds' loops in one execution.
        self.epoch_loop = epoch_loop(
            steps,
            steps_per_launch=plan.steps_per_launch,
            per_epoch=per_epoch,
            padded_to=self.batch_size if plan.last_batch_padded else None,
        )
        if eager:
            self._train_epoch, self._evaluate_batch = self.epoch_loop, evaluate_batch
        else:
            self._train_epoch = tf.function(self.epoch_loop, autograph=False)
            self._evaluate_batch = tf.function(evaluate_batch, reduce_retracing=True, autograph=False)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This epoch's training order (the fold's own order when a hypermodel's fit asks for
        ``shuffle=False``)."""
        return epoch_order(self._train_indices, seed=self.seed, epoch=epoch) if self.shuffle else self._train_indices

    def epoch_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's index batches: the full ones as a [steps, batch_size] array, and the
        remainder (shorter than a batch, possibly empty)."""
        order = self.epoch_order(epoch)
        steps = len(order) // self.batch_size
        return order[: steps * self.batch_size].reshape(steps, self.batch_size), order[steps * self.batch_size :]

    @property
    def train_samples(self) -> int:
        return len(self._train_indices)

    def epoch_batch_tensors(self, epoch: int) -> tuple[Any, Any]:
        """This epoch's index batches as device tensors, the arguments of the epoch loop."""
        import tensorflow as tf

        # Index batches go to the device as one small int tensor per epoch; the features never
        # leave it. (A tf.data iterator consumed inside the compiled loop was measured at
        # ~15k samples/s whatever the batch size on the 2-core CPU; this reaches 37k-100k.)
        full, remainder = self.epoch_batches(epoch)
        with tf.device(self.device):
            return tf.constant(full), tf.constant(remainder)

    def train_epoch(self, epoch: int) -> float:
        self._running = (epoch, int(self.optimizer.iterations.numpy()))
        started = time.perf_counter()
        tally = self._train_epoch(*self.epoch_batch_tensors(epoch)).numbers()
        self._running = None
        self.train_timer.add(time.perf_counter() - started, self.train_samples)
        return self.close_epoch(epoch, tally)

    def close_epoch(self, epoch: int, tally: EpochTally) -> float:
        """The epoch's mean training loss; records where the fold failed if it did."""
        good = tally.trained > 0
        if tally.failed_at >= 0:
            self.failure = NanEvent(
                epoch=epoch + 1,
                step=tally.failed_at,
                last_finite_loss=tally.last_loss if good else math.nan,
                grad_norm=tally.last_norm if good else math.nan,
            )
        return tally.loss_sum / tally.trained if good else math.nan

    def stopped_call(self) -> StoppedCall | None:
        """What this engine was running when an error stopped it; None if nothing was stopped."""
        if self._running is None:
            return None
        epoch, applied = self._running
        # Under numeric checking every step before the one it stopped in was applied (a step is
        # skipped only for a non-finite loss or gradient norm, where the check stops first), so
        # the steps the optimizer applied since the epoch began number the step it stopped in.
        step = EVAL_STEP if applied is None else int(self.optimizer.iterations.numpy()) - applied
        return StoppedCall(self.model, tuple(self.norm_variables), epoch + 1, step)

    def evaluate(self, epoch: int) -> tuple[float, float | None, dict[str, float]]:
        """The validation fold's loss, accuracy (None for regression) and every other metric
        (``ValidationMetrics``), each over all its samples."""
        import tensorflow as tf

        self._running = (epoch, None)
        started = time.perf_counter()
        self.metrics.reset()
        loss_sum = correct = 0.0
        for begin in range(0, len(self._val_indices), self._eval_chunk):
            with tf.device(self.device):
                indices = tf.constant(self._val_indices[begin : begin + self._eval_chunk])
            batch_loss, batch_correct = self._evaluate_batch(indices)
            loss_sum += float(batch_loss)
            correct += float(batch_correct)
        others = {name: float(value) for name, value in self.metrics.results().items()}
        self._running = None
        self.eval_timer.add(time.perf_counter() - started, len(self._val_indices))
        loss = loss_sum / len(self._val_indices)
        compiled_accuracy = self.metrics.compiled_accuracy()
        if compiled_accuracy is not None:
            accuracy: float | None = compiled_accuracy
        else:
            accuracy = correct / len(self._val_indices) if self.own_accuracy else None
        if not math.isfinite(loss) and self.failure is None:
            self.failure = NanEvent(
                epoch=epoch + 1, step=EVAL_STEP, last_finite_loss=float("nan"), grad_norm=float("nan")
            )
        return loss, accuracy, others


@dataclass(frozen=True)
class TracedEpoch:
    """A fold's epoch as a traced function of its epoch's batches (``shared_epochs``): the
    traced ``function`` run on ``captures``, this fold's variables in place of what it captured
    (another fold's), or as it is where None."""

    function: Any  # a ConcreteFunction of (full batches, remainder)
    captures: list[Any] | None
    device: str

    def __call__(self, full_batches: Any, remainder: Any) -> EpochTally:
        import tensorflow as tf

        with tf.device(self.device):
            if self.captures is None:
                return self.function(full_batches, remainder)
            return call_with_captures(self.function, (full_batches, remainder), self.captures)


def shared_epochs(engines: Sequence[FoldEngine]) -> list[TracedEpoch] | None:
    """Each engine's epoch as a function of its own (``TracedEpoch``), for the trial's folds to
    run side by side (``pipeline.engine.side_by_side``): the first engine's traced once, for any
    fold's batches (its remainder of any length); each other engine's that traced epoch run on its
    own variables where its step is the first's (``StepChoice``), else its own, traced alike.
    TensorFlow then traces, optimizes and instantiates one epoch for the trial's folds, not one
    per fold; the folds' ops are the same, so are their numbers, to the last bit. None where each
    fold's loop stays in one execution of the trial's folds: where its step is inlined in its
    epoch (``TrialPlan.step_inlined``), whose rounding is that of TensorFlow's graph optimizer
    working through the step with the execution around it, and where XLA compiles the launches
    of a last batch left as it is, a program per launch shape, which an epoch traced for any
    fold's remainder would leave to the run. With the last batch padded
    (``TrialPlan.last_batch_padded``) every launch has the batch's shape whatever the remainder's
    length: the traced epoch calls the programs each fold's own would (on CPU: the GPU's epoch
    holds no tf.cond, and the traced one runs its remainder under one)."""
    import tensorflow as tf

    first = engines[0]
    if first.step_inlined or first.traced_step is None:
        return None
    # The remainder runs under a tf.cond on its length, which the GPU's epoch (the per-epoch stop
    # test) holds none of: there XLA's folds keep their own loops.
    if first.jit_compile and (not first.last_batch_padded or first.stop_test == "per_epoch"):
        return None

    def traced(engine: FoldEngine) -> Any:
        with tf.device(engine.device):
            return tf.function(
                engine.epoch_loop,
                autograph=False,
                input_signature=engine.epoch_signature,
                experimental_attributes={"_noinline": True},
            ).get_concrete_function()

    epoch = traced(first)
    epochs = [TracedEpoch(epoch, None, first.device)]
    for engine in engines[1:]:
        choice, captures = engine.step_choice, None
        if choice is not None and choice.template is first.traced_step and choice.shared() is not None:
            captures = _captures_in_place(epoch, _replacement(choice.template, choice.own, kept=choice.kept))
        own = captures is None
        epochs.append(TracedEpoch(traced(engine) if own else epoch, captures, engine.device))
    return epochs


class FoldExecutor(Protocol):
    """Trains a trial's fold engines one epoch at a time, in one layout."""

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        """Train the engines at positions ``live`` one epoch; returns their mean training loss."""
        ...


def close_shared_epoch(
    engines: Sequence[FoldEngine], live: tuple[int, ...], epoch: int, seconds: float, tallies: Sequence[EpochTally]
) -> dict[int, float]:
    """Charge the live engines for an epoch trained together in ``seconds`` and close it with
    each one's tally; returns their mean training loss."""
    # The folds trained together: each is charged an equal share of the wall time, so that the
    # trial's rate (all samples over all fold seconds) is the rate the trial trained at.
    share = seconds / len(live)
    losses = {}
    for i, tally in zip(live, tallies):
        engine = engines[i]
        engine.train_timer.add(share, engine.train_samples)
        losses[i] = engine.close_epoch(epoch, tally)
    return losses


def fold_class_weights(class_weight: ClassWeight | None, data: ResidentData, fold: Fold) -> np.ndarray | None:
    """Each class's weight in a fold's training loss, indexed by label (``train.class_weight``):
    balanced by scikit-learn's rule from the fold's own training labels (never its validation
    data), or the given weights (1 for a class they leave out, as Keras' fit)."""
    if class_weight is None:
        return None
    labels = np.asarray(data.y)
    weights = np.ones(int(labels.max()) + 1, np.float32)
    if class_weight == "balanced":
        from sklearn.utils.class_weight import compute_class_weight

        train = labels[np.asarray(fold.train)]
        present = np.unique(train)
        weights[present] = compute_class_weight("balanced", classes=present, y=train)
        return weights
    for label, weight in class_weight.items():
        if label < len(weights):
            weights[label] = weight
    return weights
