"""The chaos soak's short variant (tests/soak/soak.py): two minutes of seeded faults over
simulated hosts, no violation. ``make soak`` runs the long one (30 minutes by default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak.hosts import unavailable
from tests.soak.soak import Soak, report

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.mark.timeout(900)
def test_two_minutes_of_faults_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    result = Soak(2.0, seed=1, work=tmp_path).run()
    assert len(result["faults"]) >= 3, report(result)
    assert result["store"]["confirmed_episodes"] > 0, report(result)
    assert not result["violations"], report(result)
