"""The recipe's optional sections, each its own model: prefetch depth, rate limit, token
collation, on-policy rollouts, admission, nearest neighbours and the delivered layout
(docs/recipes.md)."""

from __future__ import annotations

from typing import Any, Literal, Self

import numpy as np
from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from claw_tasks.settings import get_settings
from orchestrator.recipe.base import Name, StrictModel


class Prefetch(StrictModel):
    """Queue depth, and the level below which a pop asks for a refill (default depth/2)."""

    depth: PositiveInt = 8
    low_water: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _low_water(self) -> Self:
        if self.low_water is None:
            self.low_water = self.depth // 2
        elif self.low_water >= self.depth:
            raise ValueError(f"low_water ({self.low_water}) must be below depth ({self.depth})")
        return self


class RateLimit(StrictModel):
    """Samples per inserted step, with slack ``error_buffer``, once ``min_size`` steps exist."""

    samples_per_insert: PositiveFloat
    error_buffer: NonNegativeFloat = 100.0
    min_size: PositiveInt = 1


TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_logprobs")
"""The fields a ``tokens`` recipe must ask for (``response_mask`` is used when asked for)."""


class Tokens(StrictModel):
    """Collation of LLM turns into token batches (docs/recipes.md, "Token batches")."""

    mode: Literal["transition", "trajectory"] = "transition"
    padding_side: Literal["right", "left"] = "right"
    pad_multiple: PositiveInt = 1
    pad_token_id: NonNegativeInt = 0
    max_tokens: PositiveInt | None = None
    advantage: Literal["grpo", "dr_grpo", "none"] | None = None
    eps: NonNegativeFloat = 1e-6


ROLLOUT_FIELDS = ("advantages", "returns", "log_prob", "value", "policy_version")
"""What a rollout recipe's minibatches carry besides its ``fields``."""


class Rollout(StrictModel):
    """On-policy delivery: the steps of one policy version, consumed once, as ``epochs``
    passes of shuffled minibatches with advantages (docs/recipes.md, "On-policy")."""

    steps: PositiveInt
    epochs: PositiveInt = 1
    version_param: Name = "policy_version"
    max_lag: NonNegativeInt = 0
    advantage: Literal["gae", "vtrace"] = "gae"
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0)
    normalize: StrictBool = True
    rho_bar: PositiveFloat = 1.0
    c_bar: PositiveFloat = 1.0
    scorer: StrictStr | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.scorer is not None and ":" not in self.scorer:
            raise ValueError(f"scorer {self.scorer!r}: name it as 'module:function'")
        if self.advantage == "vtrace" and self.max_lag > 0 and self.scorer is None:
            raise ValueError(
                "advantage: vtrace with max_lag > 0 needs the target policy's log-probs and "
                "values of the older steps: name a scorer (module:function, allowed by the "
                "workers' CLAW_SCORERS)"
            )
        if self.scorer is not None and self.advantage != "vtrace":
            raise ValueError("scorer: only with advantage: vtrace")
        return self


class Admission(StrictModel):
    """Staleness-bounded generation (docs/llm.md, "Admission"): the capture gateway starts
    a new trajectory only while ``admitted <= (max_staleness + v + 1) * trajectories``,
    v being ``params[version_param]`` (the trainer's current policy version, moved by
    ``set_params``); ``params[min_version_param]`` is kept at ``max(0, v - max_staleness)``
    for the sources' ``where`` (``tags.min_version >= $min_version``: nothing older is
    served)."""

    max_staleness: NonNegativeInt = 0
    version_param: Name = "policy_version"
    min_version_param: Name = "min_version"
    trajectories: PositiveInt | None = None
    """Trajectories per batch (default: ``batch_size`` x the group sampler's ``group_size``,
    or ``batch_size``)."""


class Nearest(StrictModel):
    """Attach each row's ``k`` nearest steps of a vector index (docs/retrieval.md): the
    prefetch workers query the index with the row's ``query`` field (as drawn, before
    augmentation) and add ``nearest.<field>`` (B, k, ...), ``nearest.id`` and
    ``nearest.distance`` (B, k) to the batch."""

    index: Name = "default"
    namespace: StrictStr | None = None  # another namespace's index (an expert dataset)
    k: PositiveInt = 1
    query: StrictStr = "obs"
    where: StrictStr | dict[str, Any] = {}
    fields: list[StrictStr] = ["action"]
    exclude_self: StrictBool = True
    """Drop a row's own step from its neighbours (a row drawn from the indexed steps)."""

    @field_validator("k")
    @classmethod
    def _k_bounded(cls, k: int) -> int:
        bound = get_settings().nearest_max_k
        if k > bound:  # each row's k neighbours are held in the prefetch worker
            raise ValueError(f"nearest.k must be at most {bound} (CLAW_NEAREST_MAX_K), got {k}")
        return k


class Layout(StrictModel):
    """How the prefetch workers lay a batch out for its trainer, so that the trainer only
    wraps the bytes (docs/recipes.md, "Layout"): ``dtypes`` casts fields to the dtype the
    trainer's framework takes (e.g. ``terminated: float32`` for SB3's ``dones``), ``parts``
    orders the rows so each of the batch's ``parts`` equal parts (what an adapter serves a
    ``sample()`` call from) is contiguous and keeps the sources' mix: part ``j`` is rows
    ``j::parts`` of the drawn batch."""

    dtypes: dict[StrictStr, StrictStr] = {}
    parts: PositiveInt = 1

    @field_validator("dtypes")
    @classmethod
    def _numeric(cls, dtypes: dict[str, str]) -> dict[str, str]:
        out = {}
        for name, given in dtypes.items():
            fix = "name a numeric dtype such as float32 or int64"
            try:
                dtype = np.dtype(given)
            except (TypeError, ValueError, SyntaxError):  # numpy parses some as literals
                raise ValueError(f"layout.dtypes.{name}: {given!r} is not a dtype: {fix}") from None
            if dtype.kind not in "biuf":
                raise ValueError(f"layout.dtypes.{name}: {given!r} is not a numeric dtype: {fix}")
            if not dtype.isnative:  # a trainer's framework wraps native arrays only
                raise ValueError(
                    f"layout.dtypes.{name}: {given!r} is not in this machine's byte order: "
                    f"name it without one ({dtype.name!r})"
                )
            out[name] = dtype.str
        return out
