"""foldsweep's own random numbers for Keras' random layers, drawn inside its compiled step at the
cost of a few integer ops per number.

Keras' Dropout, SpatialDropout1D/2D/3D, GaussianNoise, GaussianDropout, AlphaDropout and the
image augmentation layers RandomFlip, RandomContrast, RandomBrightness, RandomCrop,
RandomRotation, RandomTranslation and RandomZoom draw through ``keras.random`` from the
``SeedGenerator`` each layer holds: a (seed, counter) pair that
advances by one at every draw. TensorFlow turns that pair into numbers with Philox or ThreeFry,
whose XLA form is slow on CPU: a dropout mask of 23K numbers cost ~250 us without XLA, ~0.85 ms
with Philox and ~20 ms with TensorFlow's default algorithm under XLA, against ~15 us for the hash
below under XLA (one thread, best of 5 loops of 200 masks, on a busy 2-core machine). While
foldsweep traces its training step, ``counter_draws`` routes those draws to a hash of (seed,
counter, element index): 32-bit integer ops that XLA fuses into the op that uses the numbers, so
a mask costs little more than the multiply it feeds. Where the step is compiled by XLA, the same
block has Keras' affine image transform (RandomRotation's, RandomTranslation's, RandomZoom's)
computed by ``pipeline.engine.image_transforms``, which XLA compiles and TensorFlow's op it
replaces does not (without XLA that op is faster, and computes the same pixels).

Everything else stays Keras': the layer's own ``call`` decides whether and what to draw (its rate,
``noise_shape``, scaling by 1 / (1 - rate), an augmentation's factor and its transform of the
image, nothing at validation), and each draw advances the
layer's ``SeedGenerator`` as Keras' does (``SeedGenerator.next``), so every fold draws from its own
generator (seeded when the fold model is built under the fold's seed), a checkpoint carries the
stream's position, and a rerun draws the same numbers. The numbers are not Keras' (another
generator); the distributions are: uniform on [0, 1) in steps of 2^-24 (TensorFlow's: 2^-23), a
normal by Box-Muller from two of them. Only the layers ``pipeline.base.keras_private.counter_drawn``
names are drawn so (its hook checks that their draws go through the functions replaced here); a
model with any other random layer keeps Keras' generator (``pipeline.contract.plan``).

Stacked folds (``pipeline.engine.stacked``) call a random layer once on the folds' merged batch:
there the generator's state is a [folds, 2] variable, and each fold's share of the draw (the
first axis, fold-major) is hashed from its own (seed, counter) with element indices counted from
0 within the fold: the numbers that fold draws when it trains alone.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pipeline.base.keras_private import AFFINE_TRANSFORM, backend_draws, replace_backend_draws
from pipeline.engine import image_transforms

# Chris Wellons' lowbias32 integer hash (a bijection of 32-bit words: two multiply-xorshift
# rounds), applied twice, keyed by the seed, then by the counter.
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_SHIFTS = (16, 15, 16)
_SEED_SALT = 0x243F6A88  # pi's first hex digits: the key of seed 0 is not 0
_FRACTION_BITS = 24  # float32's mantissa: a uniform's steps are 2^-24


def _mix(x: Any) -> Any:
    import tensorflow as tf

    def xorshift(value, bits):
        return tf.bitwise.bitwise_xor(value, tf.bitwise.right_shift(value, tf.constant(bits, tf.uint32)))

    x = xorshift(x, _SHIFTS[0]) * tf.constant(_MULTIPLIERS[0], tf.uint32)
    x = xorshift(x, _SHIFTS[1]) * tf.constant(_MULTIPLIERS[1], tf.uint32)
    return xorshift(x, _SHIFTS[2])


def hashed_words(seeds: Any, count: int) -> Any:
    """[streams, count] uint32 words: word i of a stream hashed from i and that stream's (seed,
    counter) pair, ``seeds`` [streams, 2] integers (their low 32 bits)."""
    import tensorflow as tf

    seeds = tf.cast(seeds, tf.uint32)  # modulo 2^32
    seed_key = _mix(tf.bitwise.bitwise_xor(seeds[:, 0], tf.constant(_SEED_SALT, tf.uint32)))
    counter_key = _mix(tf.bitwise.bitwise_xor(seed_key, seeds[:, 1]))
    index = tf.cast(tf.range(count), tf.uint32)[tf.newaxis]
    return _mix(tf.bitwise.bitwise_xor(_mix(index + seed_key[:, tf.newaxis]), counter_key[:, tf.newaxis]))


def _fractions(seeds: Any, count: int) -> Any:
    """[streams, count] float32 uniforms on [0, 1) in steps of 2^-24."""
    import tensorflow as tf

    words = tf.bitwise.right_shift(hashed_words(seeds, count), tf.constant(32 - _FRACTION_BITS, tf.uint32))
    return tf.cast(words, tf.float32) * (2.0**-_FRACTION_BITS)


def _per_stream(seeds: Any, shape: Sequence[Any]) -> Any:
    streams = int(seeds.shape[0])
    if streams > 1 and (not isinstance(shape[0], int) or shape[0] % streams):
        raise ValueError(f"a draw of shape {list(shape)} cannot be split between {streams} folds")
    return math.prod(shape) // streams


def counter_uniform(seeds: Any, shape: Sequence[Any]) -> Any:
    """float32 uniforms on [0, 1) of ``shape``: one stream per row of ``seeds`` [streams, 2], whose
    share of ``shape`` is its first axis split evenly (fold-major), numbered from 0 within it."""
    import tensorflow as tf

    return tf.reshape(_fractions(seeds, _per_stream(seeds, shape)), shape)


def counter_normal(seeds: Any, shape: Sequence[Any]) -> Any:
    """Standard normals of ``shape`` (streams as ``counter_uniform``'s) by Box-Muller: element i
    from its stream's uniforms 2i and 2i + 1, whatever the draw's length (a fold's batch padded
    when stacked draws the same numbers for its own samples)."""
    import tensorflow as tf

    count = _per_stream(seeds, shape)
    pairs = tf.reshape(_fractions(seeds, 2 * count), [-1, count, 2])
    radius = tf.sqrt(-2.0 * tf.math.log(pairs[..., 0] + 2.0**-_FRACTION_BITS))  # (0, 1]: finite
    return tf.reshape(radius * tf.cos((2.0 * math.pi) * pairs[..., 1]), shape)


def _sizes(shape: Any) -> list[Any]:
    """A draw's shape as its sizes: ints where known when the step is traced, else scalar tensors
    (the batch of a step traced for batches of any length, as Keras' fit traces its step). The
    numbers drawn are the same either way: element i of a stream is hashed from i."""
    import tensorflow as tf

    if not isinstance(shape, (list, tuple)):
        static = tf.get_static_value(shape)
        shape = tf.unstack(shape) if static is None else list(static)
    return [_size(size) for size in shape]


def _size(size: Any) -> Any:
    import tensorflow as tf

    static = tf.get_static_value(size)
    return size if static is None else int(static)


# The functions of Keras' random backend (``keras_private.backend_draws``) replaced while a step
# is traced (what the drawn layers call), each with the same parameters as Keras' own but
# ``seed``, and the pairs in front.


def _dropout(seeds, inputs, rate, noise_shape=None):
    import tensorflow as tf

    if rate == 1.0:
        return tf.zeros_like(inputs)
    if rate == 0.0:
        return inputs
    inputs = tf.convert_to_tensor(inputs)
    sizes = _sizes([tf.shape(inputs)[axis] if size is None else size for axis, size in enumerate(inputs.shape)])
    shape = (
        sizes
        if noise_shape is None
        else [sizes[i] if size is None else size for i, size in enumerate(_sizes_or_none(noise_shape))]
    )
    # As tf.nn.experimental.stateless_dropout computes it: scaled, then kept where the number
    # drawn is at least the rate.
    scaled = inputs * tf.constant(1 / (1 - rate), inputs.dtype)
    keep = counter_uniform(seeds, shape) >= rate
    return tf.where(keep, scaled, tf.zeros([], inputs.dtype))


def _sizes_or_none(noise_shape: Any) -> list[Any]:
    return [None if size is None else _size(size) for size in noise_shape]


def _normal(seeds, shape, mean=0.0, stddev=1.0, dtype=None):
    import tensorflow as tf
    from keras.config import floatx

    return tf.cast(counter_normal(seeds, _sizes(shape)) * stddev + mean, dtype or floatx())


def _uniform(seeds, shape, minval=0.0, maxval=1.0, dtype=None):
    import tensorflow as tf
    from keras.config import floatx

    minval, maxval = tf.cast(minval, tf.float32), tf.cast(maxval, tf.float32)
    return tf.cast(counter_uniform(seeds, _sizes(shape)) * (maxval - minval) + minval, dtype or floatx())


REPLACEMENTS = {"dropout": _dropout, "normal": _normal, "uniform": _uniform}


class _Routing:
    """Where the replaced draws take their (seed, counter) pairs from while a step is traced."""

    def __init__(self, stacked_states: Mapping[int, Any] | None):
        self.stacked_states = stacked_states

    def seeds(self, generator: Any) -> Any:
        """[streams, 2]: the generator's pair, advanced as ``SeedGenerator.next`` advances it, or
        each fold's pair when the folds are stacked."""
        import tensorflow as tf

        if self.stacked_states is None:
            return generator.next()[tf.newaxis]
        state = self.stacked_states[id(generator)]
        pairs = tf.identity(state)
        state.assign(pairs + tf.constant([0, 1], state.dtype))
        return pairs


_keras_draws: dict[str, Any] = {}  # Keras' own functions the block replaces, by name
_routing: _Routing | None = None


def _drawn(name: str, keras_draw: Any) -> Any:
    """Keras' ``name`` as foldsweep draws it: its numbers for a layer's SeedGenerator, Keras' own
    function for any other seed (an int, the global generator)."""
    signature = inspect.signature(keras_draw)

    def draw(*args: Any, **kwargs: Any) -> Any:
        from keras.random import SeedGenerator

        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        seed = arguments.arguments.pop("seed")
        if _routing is None or not isinstance(seed, SeedGenerator):
            return keras_draw(*args, **kwargs)
        return REPLACEMENTS[name](_routing.seeds(seed), **arguments.arguments)

    return draw


@contextlib.contextmanager
def counter_draws(stacked_states: Mapping[int, Any] | None = None, *, under_xla: bool = False) -> Iterator[None]:
    """Inside the block (a step being traced, or run eagerly), the drawn layers' numbers are
    foldsweep's (the module's docstring); ``stacked_states`` maps each SeedGenerator of the
    template model (by id) to the stacked folds' [folds, 2] state variable. ``under_xla``: the
    block is traced for XLA, and images are transformed by ``image_transforms``."""
    global _routing
    if not _keras_draws:
        _keras_draws.update(backend_draws())
    outer = _routing
    _routing = _Routing(stacked_states)
    if outer is None:
        replacing = {name: _drawn(name, _keras_draws[name]) for name in REPLACEMENTS}
        if under_xla:
            replacing[AFFINE_TRANSFORM] = image_transforms.affine_transform
        replace_backend_draws(replacing)
    try:
        yield
    finally:
        _routing = outer
        if outer is None:
            replace_backend_draws(_keras_draws)
