"""Engine: one trial executed, with Ray or without: the training recipe, the k folds trained in
lockstep, one fold's engine and an executor per fold layout, the data resident on the device,
and where a resumed sweep's Ray Tune trials are made.
May import: pipeline.base, pipeline.inputs, pipeline.contract.

The engine runs on Keras, so loading it loads TensorFlow and Keras first, through
``import_tensorflow_and_keras``: a Ray worker loads them here, as it unpickles its first trial.
"""

from pipeline.base.quiet import import_tensorflow_and_keras

import_tensorflow_and_keras()
