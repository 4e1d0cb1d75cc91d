"""The chaos soak's short variant (tests/soak/soak.py): 75 seconds of seeded faults, one
every 6-12 s, over simulated hosts, no violation. Seed 9 draws a master's SIGKILL, a
trainer's, the gateway's and an actor host's partition. ``make soak`` runs the long one
(30 minutes by default, a fault every 20-40 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak.hosts import unavailable
from tests.soak.soak import Soak, report

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.mark.timeout(900)
def test_a_short_soak_of_faults_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    result = Soak(1.25, seed=9, work=tmp_path, gaps=(6.0, 12.0), archive_every="10s").run()
    assert len(result["faults"]) >= 3, report(result)
    assert result["store"]["confirmed_episodes"] > 0, report(result)
    assert not result["violations"], report(result)
