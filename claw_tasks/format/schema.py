"""Namespace schema: payload fields (dtype, shape, ragged leading dim) and free tags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, cast

import numpy as np
from numpy.typing import DTypeLike

from claw_tasks.codecs import CodecError
from claw_tasks.codecs.spec import Codec
from claw_tasks.format.arrays import check_dtype

__all__ = ["FieldSpec", "Schema", "SchemaError", "key_tag", "tag_column", "tag_key", "tag_name"]

TagKind = Literal["str", "num"]

# Metadata that is not a payload field; names a user may not reuse for fields or tags.
RESERVED = frozenset(
    {
        "reward",
        "terminated",
        "truncated",
        "info",
        "next_obs",
        "episode_id",
        "step_index",
        "agent_id",
        "task_id",
        "skill_tag",
        "reward_source",
        "policy_version",
        "timestamp",
        "priority",
        "quality",
        "trainable",
        "id",
        "ids",
        "weights",
    }
)

MAX_STEP_BYTES = 16 * 1024 * 1024
MAX_FIELDS = 64
MAX_TAGS = 64

# The LLM step preset (docs/llm.md). ``prompt_uid`` is a number, the 53-bit hash of the
# group key (``claw_tasks.format.turns.prompt_key``): one per prompt would grow a string dictionary
# without bound, a number column has none. ``retokenized`` is 1 where the token ids were
# recomputed by the recorder's tokenizer instead of returned by the inference server.
LLM_FIELDS = {
    "prompt_ids": ("<i4", (None,)),
    "response_ids": ("<i4", (None,)),
    "response_logprobs": ("<f4", (None,)),
}
LLM_MASK_FIELD = ("response_mask", ("|u1", (None,)))
LLM_TAGS: dict[str, TagKind] = {
    "prompt_uid": "num",
    "final_reward": "num",
    "retokenized": "num",
    "min_version": "num",
    "max_version": "num",
}

# The on-policy step convention (docs/recipes.md, "On-policy"): what the behaviour policy
# said about each step, as numeric tags, so the prefetch workers compute advantages from
# the metadata columns alone (no payload read). ``bootstrap_value`` is V(next_obs), given
# where the step's successor does not carry it: a segment's last step and a truncated one.
LOG_PROB, VALUE, BOOTSTRAP_VALUE = "log_prob", "value", "bootstrap_value"
ROLLOUT_TAGS: dict[str, TagKind] = {LOG_PROB: "num", VALUE: "num", BOOTSTRAP_VALUE: "num"}


# A free tag has two names: the stored column (``t:<name>``: Redis keys, batch columns,
# the sampling index) and the key users write (``tags.<name>``: where filters, recipe
# fields, step records). These four functions are the only place that maps between them.
TAG_COLUMN_PREFIX = "t:"
TAG_KEY_PREFIX = "tags."


def tag_column(name: str) -> str:
    """The metadata column (and batch column) of free tag ``name``."""
    return TAG_COLUMN_PREFIX + name


def tag_name(column: str) -> str | None:
    """The tag a metadata column holds, or None for fixed metadata."""
    return column[len(TAG_COLUMN_PREFIX) :] if column.startswith(TAG_COLUMN_PREFIX) else None


def tag_key(name: str) -> str:
    """The user-facing key of free tag ``name`` (``tags.<name>``)."""
    return TAG_KEY_PREFIX + name


def key_tag(key: str) -> str | None:
    """The tag a user-facing key names, or None when it is not ``tags.<name>``."""
    if key.startswith(TAG_KEY_PREFIX) and len(key) > len(TAG_KEY_PREFIX):
        return key[len(TAG_KEY_PREFIX) :]
    return None


class SchemaError(ValueError):
    """A batch does not match the namespace schema, or a schema is malformed."""


@dataclass(frozen=True, init=False)
class FieldSpec:
    """One payload field. ``shape[0] is None`` marks a ragged (variable-length) field.

    ``codec`` compresses it in the store (``"zstd"``, ``"zstd:9"``, ``"lz4"``, ``"png"``,
    ``"jpeg:90"``, ``"delta:16"``...; :class:`claw_tasks.codecs.Codec`); None stores the
    raw bytes. In a batch's implied schema None means "raw rows": they fit a field of
    any codec (the ingest worker encodes them)."""

    dtype: str
    shape: tuple[int | None, ...]
    codec: Codec | None = None

    def __init__(
        self,
        dtype: DTypeLike,
        shape: Sequence[int | None],
        codec: Codec | str | None = None,
    ) -> None:
        # Written out (not the dataclass's): it takes what it normalizes, a dtype's or a
        # codec's name among them, and keeps the normal form.
        object.__setattr__(self, "shape", tuple(shape))
        try:  # one spelling per dtype ("uint8" is "|u1"): specs compare as written
            object.__setattr__(self, "dtype", np.dtype(dtype).str)
        except TypeError as e:
            raise SchemaError(f"dtype {dtype!r}: {e}") from None
        try:
            object.__setattr__(self, "codec", Codec.of(codec))
        except CodecError as e:
            raise SchemaError(str(e)) from None

    @property
    def ragged(self) -> bool:
        return bool(self.shape) and self.shape[0] is None

    @property
    def row_items(self) -> int:
        """Items per row (fixed) or per element of the ragged dimension."""
        dims = self.shape[1:] if self.ragged else self.shape
        return int(np.prod(cast(tuple[int, ...], dims), dtype=np.int64)) if dims else 1

    @property
    def row_bytes(self) -> int:
        return self.row_items * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        dims = ", ".join("*" if d is None else str(d) for d in self.shape)
        codec = "" if self.codec is None else f" ({self.codec})"
        return f"{np.dtype(self.dtype).name}[{dims}]{codec}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.codec is not None:
            d["codec"] = str(self.codec)
        return d

    def fits(self, other: FieldSpec) -> bool:
        """Whether rows of ``other`` (a batch's) belong in this field: same dtype and
        shape, and either raw rows (codec None) or frames of this field's codec."""
        return (self.dtype, self.shape) == (other.dtype, other.shape) and (
            other.codec is None or other.codec == self.codec
        )


@dataclass(frozen=True)
class Schema:
    """Fields and tags of a namespace. Declared, or taken from the first batch.

    Immutable (read-only mappings): the Store caches it and hands it out, so a change is
    a new object (``merged``, ``with_tags``) that goes through ``Store.ensure_schema``."""

    fields: Mapping[str, FieldSpec]
    tags: Mapping[str, TagKind] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))
        object.__setattr__(self, "tags", MappingProxyType(dict(self.tags)))

    @classmethod
    def llm(
        cls, *, response_mask: bool = False, tags: Mapping[str, TagKind] | None = None
    ) -> Schema:
        """The LLM step preset: one agent turn per step (docs/llm.md). Ragged ``prompt_ids``
        and ``response_ids`` (int32), ``response_logprobs`` (float32, the behaviour
        policy's); with ``response_mask``, a ragged uint8 marking trainable response tokens
        (tool output spliced into a turn is 0). Tags ``prompt_uid`` (group key hash),
        ``final_reward``, ``retokenized``, ``min_version`` and ``max_version`` (the
        trajectory's oldest and newest turn's policy version, set with its reward), plus
        ``tags`` (e.g. ``{"dataset": "str"}``)."""
        specs = dict(LLM_FIELDS)
        if response_mask:
            specs[LLM_MASK_FIELD[0]] = LLM_MASK_FIELD[1]
        schema = cls(
            fields={k: FieldSpec(d, s) for k, (d, s) in specs.items()},
            tags={**LLM_TAGS, **(tags or {})},
        )
        schema.check_self()
        return schema

    @classmethod
    def rollout(
        cls,
        obs_shape: tuple[int, ...],
        action_shape: tuple[int, ...] = (),
        *,
        obs_dtype: str = "<f4",
        action_dtype: str = "<i8",
        tags: Mapping[str, TagKind] | None = None,
    ) -> Schema:
        """The on-policy step preset (docs/recipes.md, "On-policy"): ``obs`` and
        ``action`` payload fields, and the numeric tags ``log_prob`` (the behaviour
        policy's log-probability of the action), ``value`` (its critic's V(obs)) and
        ``bootstrap_value`` (V(next_obs), on a segment's last step and a truncated step),
        plus ``tags``. ``policy_version`` is step metadata already."""
        schema = cls(
            fields={
                "obs": FieldSpec(obs_dtype, obs_shape),
                "action": FieldSpec(action_dtype, action_shape),
            },
            tags={**ROLLOUT_TAGS, **(tags or {})},
        )
        schema.check_self()
        return schema

    def to_dict(self) -> dict[str, Any]:
        return {
            "fields": {k: v.to_dict() for k, v in self.fields.items()},
            "tags": dict(self.tags),
        }

    @property
    def default_fields(self) -> list[str]:
        """What a read returns when asked for no fields in particular: every field, and
        ``next_obs`` only where there is an ``obs`` to take it from (not an LLM namespace)."""
        return [*self.fields, "next_obs"] if "obs" in self.fields else list(self.fields)

    @property
    def codecs(self) -> dict[str, Codec]:
        """The fields stored compressed, with their codec."""
        return {k: v.codec for k, v in self.fields.items() if v.codec is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schema:
        try:
            fields = {
                k: FieldSpec(np.dtype(v["dtype"]).str, tuple(v["shape"]), v.get("codec"))
                for k, v in d["fields"].items()
            }
        except (KeyError, TypeError) as e:
            raise SchemaError(f"malformed schema: missing {e}") from None
        schema = cls(fields=fields, tags=dict(d.get("tags", {})))
        schema.check_self()
        return schema

    def check_self(self) -> None:
        if len(self.fields) > MAX_FIELDS or len(self.tags) > MAX_TAGS:
            raise SchemaError(
                f"{len(self.fields)} fields and {len(self.tags)} tags: a namespace holds at "
                f"most {MAX_FIELDS} and {MAX_TAGS} (each is a column in every shard)"
            )
        for name, spec in self.fields.items():
            if name in RESERVED:
                raise SchemaError(f"field '{name}' is reserved metadata, not a payload field")
            check_dtype(np.dtype(spec.dtype), f"field '{name}'")
            if any(d is None for d in spec.shape[1:]):
                raise SchemaError(f"field '{name}': only the leading dimension may be ragged")
            if spec.codec is not None:
                try:
                    spec.codec.check_field(spec.dtype, spec.shape, f"field '{name}'")
                except CodecError as e:
                    raise SchemaError(str(e)) from None
        for name, kind in self.tags.items():
            if kind not in ("str", "num"):
                raise SchemaError(f"tag '{name}': kind must be 'str' or 'num', not {kind!r}")
            if name in RESERVED:
                raise SchemaError(f"tag '{name}' is reserved metadata")

    def merged(self, other: Schema) -> Schema:
        """This schema plus the new tags of ``other``; a conflict is a SchemaError."""
        for name, spec in other.fields.items():
            mine = self.fields.get(name)
            if mine is None:
                raise SchemaError(
                    f"field '{name}' is not in the namespace schema "
                    f"(fields: {', '.join(sorted(self.fields))})"
                )
            if not mine.fits(spec):
                raise SchemaError(
                    f"field '{name}' is {spec.describe()}, schema says {mine.describe()}"
                )
        missing = set(self.fields) - set(other.fields)
        if missing:
            raise SchemaError(f"batch lacks schema field(s): {', '.join(sorted(missing))}")
        return self.with_tags(other.tags)

    def with_codecs(self, codecs: Mapping[str, Codec | str | None]) -> Schema:
        """This schema with the codecs of some fields changed (at namespace creation: a
        namespace's codecs never change once it holds steps)."""
        unknown = set(codecs) - set(self.fields)
        if unknown:
            raise SchemaError(f"codecs for unknown field(s): {', '.join(sorted(unknown))}")
        fields = {
            k: FieldSpec(v.dtype, v.shape, codecs[k]) if k in codecs else v
            for k, v in self.fields.items()
        }
        schema = Schema(fields=fields, tags=self.tags)
        schema.check_self()
        return schema

    def with_tags(self, tags: Mapping[str, TagKind]) -> Schema:
        """This schema plus ``tags``; a tag of another kind is a SchemaError."""
        for name, kind in tags.items():
            if self.tags.get(name, kind) != kind:
                raise SchemaError(f"tag '{name}' is {kind}, schema says {self.tags[name]}")
        new = {k: v for k, v in tags.items() if k not in self.tags}
        if not new:
            return self
        schema = Schema(fields=self.fields, tags={**self.tags, **new})
        schema.check_self()
        return schema
