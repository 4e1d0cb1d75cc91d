"""What every part of a recipe is built on: the strict pydantic base (no unknown keys),
the name and param types, the error a schema mismatch raises, and the rows-per-source
split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Protocol

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
)

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)]
Scalar = StrictStr | StrictInt | StrictFloat | StrictBool


def allocate(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` by ``weights``: floors, then +1 by largest remainder (ties: first)."""
    w = np.asarray(weights, dtype=np.float64)
    quotas = w / w.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    order = np.argsort(-(quotas - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts.tolist()


class RecipeError(ValueError):
    """A recipe that does not fit the namespace schema; lists every offending key."""


class SchemaLike(Protocol):
    """What :meth:`Recipe.validate_against` needs from a namespace schema."""

    @property
    def fields(self) -> Mapping[str, Any]: ...  # payload field name -> spec

    @property
    def tags(self) -> Mapping[str, str]: ...  # free tag name -> 'str' | 'num'


class StrictModel(BaseModel):
    """A recipe section: an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")
