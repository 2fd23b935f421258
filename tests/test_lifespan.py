"""When a worker process retires: after N trials, or as its mappings near the kernel's limit."""

from __future__ import annotations

from pipeline.engine import lifespan
from pipeline.engine.lifespan import Lifespan


def test_a_worker_retires_after_its_trials():
    life = Lifespan(max_trials=2)
    life.start_trial()
    assert not life.should_retire(life.observe())
    life.start_trial()
    assert life.should_retire(life.observe())


def test_auto_retires_before_the_mapping_limit(monkeypatch):
    life = Lifespan()
    life.start_trial()
    maps = life.observe()
    assert maps > 0 and not life.should_retire(maps)  # far under the real limit
    life.largest_growth = 1000  # a trial added 1000 mappings: two more must fit under 80% of the limit
    monkeypatch.setattr(lifespan, "map_limit", lambda: int((maps + 2000) / 0.8) + 1)
    assert not life.should_retire(maps)
    monkeypatch.setattr(lifespan, "map_limit", lambda: int((maps + 2000) / 0.8) - 1)
    assert life.should_retire(maps)
    monkeypatch.setattr(lifespan, "map_limit", lambda: 0)  # /proc does not tell: never retire on maps
    assert not life.should_retire(maps)
