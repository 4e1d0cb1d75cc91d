"""``str_column``: the forms a producer's string column may take."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.client.checks import str_column
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import SchemaError


def test_a_str_column_is_taken_as_it_is_and_equals_the_strings():
    given = StrColumn(["a.0.1", "a.1.1"], np.array([0, 1, 0, 1], np.int64))
    got = str_column(given, 4, "episode_id")
    assert got.index.dtype == np.int32
    assert got.strings() == str_column(["a.0.1", "a.1.1"] * 2, 4, "episode_id").strings()
    with pytest.raises(SchemaError, match="3 rows, expected 4"):
        str_column(StrColumn(["a"], np.zeros(3, np.int32)), 4, "episode_id")
