"""Engine: one trial executed: the Ray trainable (``trainable``) and the same trial without Ray
(``runner``), the training recipe (``recipe``), the k folds trained in lockstep (``trainer``),
one fold's engine (``fold_engine``) and an executor per fold layout (``sequential``,
``side_by_side``, ``stacked``, with the registry of layers' stacked forms in ``stacked_layers``),
device-resident data, and where a resumed sweep's Ray Tune
trials are made.
May import: pipeline.base, pipeline.inputs, pipeline.contract.

The engine runs on Keras, so loading it loads TensorFlow and Keras first, through
``import_tensorflow_and_keras``: a Ray worker loads them here, as it unpickles its first trial.
"""

from pipeline.base.quiet import import_tensorflow_and_keras

import_tensorflow_and_keras()
