"""Schema (format.schema): immutable, so a cached schema can be shared; the LLM preset."""

from __future__ import annotations

import dataclasses

import pytest

from claw_tasks.format.schema import FieldSpec, Schema, SchemaError

FIELDS = {"obs": FieldSpec("<f4", (4,)), "action": FieldSpec("<i8", ())}


def test_schema_cannot_be_changed_in_place():
    schema = Schema(fields=dict(FIELDS), tags={"color": "str"})
    with pytest.raises(TypeError):
        schema.tags["level"] = "num"  # type: ignore[index]
    with pytest.raises(TypeError):
        schema.fields["extra"] = FieldSpec("<f4", ())  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        schema.tags = {}  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        schema.fields["obs"].shape = (8,)  # type: ignore[misc]


def test_with_tags_returns_a_new_schema():
    schema = Schema(fields=dict(FIELDS), tags={"color": "str"})
    wider = schema.with_tags({"level": "num"})
    assert dict(wider.tags) == {"color": "str", "level": "num"}
    assert dict(schema.tags) == {"color": "str"}
    assert schema.with_tags({"color": "str"}) == schema
    with pytest.raises(SchemaError, match="tag 'color' is num, schema says str"):
        schema.with_tags({"color": "num"})


def test_preset_fields_and_tags():
    s = Schema.llm(response_mask=True, tags={"dataset": "str"})
    assert {k: (v.dtype, v.shape) for k, v in s.fields.items()} == {
        "prompt_ids": ("<i4", (None,)),
        "response_ids": ("<i4", (None,)),
        "response_logprobs": ("<f4", (None,)),
        "response_mask": ("|u1", (None,)),
    }
    assert dict(s.tags) == {
        "prompt_uid": "num",
        "final_reward": "num",
        "retokenized": "num",
        "min_version": "num",
        "max_version": "num",
        "dataset": "str",
    }
    assert "response_mask" not in Schema.llm().fields
    assert Schema.from_dict(s.to_dict()) == s
