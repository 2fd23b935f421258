"""When this process began loading foldsweep (``time.perf_counter``), imported first of all its
modules (``pipeline/__init__``): a Ray worker loads foldsweep, and with it TensorFlow and Keras,
when it receives its first trial, so that trial's time account starts here
(``pipeline.engine.trainable``)."""

import time

LOADED_AT = time.perf_counter()
