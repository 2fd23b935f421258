"""The environment a sweep records (pipeline/base/environment.py): pure logic on a lock written here."""

from __future__ import annotations

from importlib import metadata

from pipeline.base import environment
from pipeline.base.environment import Environment, environment_change, locked_versions, recorded_environment


def write_lock(path, versions):
    path.write_text(
        "version = 1\n"
        + "".join(f'\n[[package]]\nname = "{name}"\nversion = "{version}"\n' for name, version in versions.items())
    )
    return path


def test_installed_versions_that_differ_from_the_lock_are_named(tmp_path, monkeypatch):
    tf = metadata.version("tensorflow")
    lock = write_lock(
        tmp_path / "uv.lock", {"TensorFlow": "1.0.0", "keras": metadata.version("keras"), "foldsweep": "9.9"}
    )
    monkeypatch.setattr(environment, "project_lock", lambda: lock)
    current = Environment.current()
    assert current.differences == (f"tensorflow {tf} (uv.lock 1.0.0)",)
    tags = current.tags()
    assert tags["foldsweep.lock_matches"] == f"false: tensorflow {tf} (uv.lock 1.0.0)"
    assert tags["foldsweep.lock_hash"].startswith("sha256:") and len(tags["foldsweep.lock_hash"]) == 7 + 64
    assert tags["foldsweep.version.tensorflow"] == tf


def test_without_a_lock_the_sweep_says_so(monkeypatch):
    monkeypatch.setattr(environment, "project_lock", lambda: None)
    tags = Environment.current().tags()
    assert tags["foldsweep.lock_hash"] == "none"
    assert tags["foldsweep.lock_matches"] == "false: no uv.lock (foldsweep is not installed from its checkout)"


def test_lock_names_are_normalized(tmp_path):
    lock = write_lock(tmp_path / "uv.lock", {"Keras_Tuner": "1.4.8", "scikit.learn": "1.9.1"})
    assert locked_versions(lock) == {"keras-tuner": "1.4.8", "scikit-learn": "1.9.1"}


def test_a_resume_in_another_environment_is_described():
    recorded = Environment("sha256:" + "a" * 64, {"python": "3.11.7", "ray": "2.60.0"}, ()).tags()
    same = Environment("sha256:" + "a" * 64, {"python": "3.11.7", "ray": "2.60.0"}, ())
    other = Environment("sha256:" + "b" * 64, {"python": "3.11.7", "ray": "2.61.0"}, ())
    assert environment_change(recorded, same) == ""
    assert (
        environment_change(recorded, other) == "lock sha256:aaaaaaaaaaaa -> sha256:bbbbbbbbbbbb, ray 2.60.0 -> 2.61.0"
    )
    assert environment_change({}, other) == ""  # recorded before environments were


def test_recorded_environment_lines():
    tags = Environment("sha256:abc", {"ray": "2.60.0", "python": "3.11.7"}, ()).tags()
    assert recorded_environment(tags) == [
        "lock sha256:abc (installed versions match it: true)",
        "python 3.11.7, ray 2.60.0",
    ]
    assert recorded_environment({}) == []


def test_a_rerun_in_another_environment_says_it_differs_from_the_trial():
    from types import SimpleNamespace

    from pipeline.rerun import rerun_changes

    current = Environment.current()
    older = {**current.tags(), "foldsweep.version.ray": "2.50.0"}
    recorded = SimpleNamespace(config={}, plan=object(), sweep_tags=older)
    assert rerun_changes(recorded, {}, eager=False) == (
        f"another environment (ray 2.50.0 -> {current.versions['ray']})",
    )
    assert rerun_changes(SimpleNamespace(config={}, plan=object(), sweep_tags=current.tags()), {}, eager=False) == ()
