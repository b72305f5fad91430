"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from trio_rollouts.pipeline._epochs import Admission


@pytest.fixture
def run_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission inside the staleness bound off: new calls run ahead as far as
    ``parallel_generation_tasks`` allows, as they did before it (and as a consumer that
    takes fewer than ``num_groups`` groups per update still lets them go stale). For the
    tests of what happens to groups that go stale."""
    monkeypatch.setattr(Admission, "may_start", lambda self, slot: True)
