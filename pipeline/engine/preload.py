"""What the workers of a sweep's local Ray load as they start (``pipeline.sweep.LOCAL_RAY_SETTINGS``):
the trainable, and with it TensorFlow, Keras and Ray Tune, in a worker started ahead, as the
driver connects. It loads them while the driver still checks the sweep and opens its store; its
first trial's time account then starts at the trial's set-up (``pipeline.base.loaded``). A worker
Ray starts later for a task loads only what the task needs, as it unpickles it."""

from pipeline.base import loaded
from pipeline.base.ray_private import started_ahead_of_any_job

if started_ahead_of_any_job():
    loaded.load_ahead()
    import pipeline.engine.trainable  # noqa: F401
