"""Fuzz the ingest boundary: hostile messages published straight to the queue with kombu
(no client, no Celery sender) against a real worker (two pool processes) on a private Redis.

Cases come from structured mutations of valid current-format messages of every kind, each
kind to its own namespace: plain vectors with a zstd image, every codec (lz4, png, delta,
jpeg, webp), ragged fields (one zstd-compressed), the LLM preset; inline or claim-checked;
raw rows or a producer's frames. Mutations reach every layer (envelope, headers, body,
args, batch map, array frames, a compressed field's frames: bombs, lying sizes, per-codec
garbage), values that overflow their stored type, messages whose every step is refused
carrying new tags (and such messages to a namespace with no schema yet), lz4 frames that
fit the decompression budget one by one but not together, and redeliveries racing the
original. Hypothesis adds arbitrary msgpack where each part goes. Afterwards: the worker
is alive, no pool process was replaced, and every kind still commits; every delivery has
exactly one outcome (committed, partial, rejected with a reason, duplicate) — none
vanishes, none counts twice; every live step's values are in their documented ranges
(finite reward, priority NaN or finite >= 0, numeric tags NaN or finite) and every stored
field decodes to its schema's shape; no schema gained a field or a refused message's tag,
the fresh namespace has none; Redis grew by at most the dead letters' byte caps plus 10 %
(beyond done records and the test's own claim checks); the worker's RSS at most doubled
and no pool process's peak RSS grew by the decompression budget; other namespaces are
byte-for-byte unchanged; ``claw doctor`` is clean.

CI runs a fixed seed; ``pytest -m slow tests/stack/test_fuzz_ingest.py`` runs a longer storm
(``CLAW_FUZZ_SEED`` picks another seed).
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lz4.block
import msgpack
import numpy as np
import psutil
import pytest
import redis
import zstandard
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from claw_tasks.client import Ingestor
from claw_tasks.codecs import Codec, CodecFrames, encode
from claw_tasks.codecs.delta import key_frame
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.arrays import pack_array, packb
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.message import MESSAGE_VERSION
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from claw_tasks.store.layout import Keys
from claw_tasks.worker.deadletter import REJECTS
from tests.support.hostile import (
    MSGPACK,
    Publisher,
    body,
    dump_keys,
    headers,
    messages_done,
    outcomes,
    wait_for,
)
from tests.support.paths import ROOT
from tests.support.processes import Worker

SEED = int(os.environ.get("CLAW_FUZZ_SEED", "20261130"))
CAP = 1 << 20  # CLAW_DEAD_LETTER_BYTES: per namespace, and for claw:rejects
PREFIX = 16 << 10  # CLAW_DEAD_LETTER_PREFIX
CAPACITY = 256  # each fuzzed namespace's slots: the storm cannot grow its columns
BUDGET = 64 << 20  # CLAW_MAX_DECOMPRESSED_BYTES: bombs cost less to build than at 256 MiB
OBS = 8
IMG = (8, 8)  # the image fields' rows
ZSTD = Codec.of("zstd")


# ---- valid material: one namespace per kind of message ---------------------------------
def _base(rng: random.Random, batch_id: str, n: int, fields: dict[str, Any]) -> StepBatch:
    b = StepBatch(
        episode=StrColumn.constant(f"ep{rng.randrange(4)}", n),
        step_index=np.arange(n, dtype=np.int64) + rng.randrange(1000),
        reward=np.array([rng.random() for _ in range(n)], np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields=fields,
        priority=np.full(n, rng.random(), np.float32) if rng.random() < 0.3 else None,
        batch_id=batch_id,
    )
    if rng.random() < 0.3:
        b.info_rows, b.info = np.array([0], np.int32), [{"k": rng.randrange(9), "s": "x"}]
    return b


def _u8(rng: random.Random, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(rng.randrange(2**32)).integers(0, 256, shape, np.uint8)


def _maybe_encoded(codec: Codec, rows: Any, rng: random.Random) -> Any:
    """Rows of a compressed field: raw (the worker encodes) or frames (the producer did)."""
    if rng.random() < 0.5:
        return rows
    if isinstance(rows, Ragged):
        frames = encode(codec, [rows.row(i) for i in range(len(rows))])
        return Encoded(codec, rows.values.dtype, (len(rows), None), frames)
    return Encoded(codec, rows.dtype, rows.shape, encode(codec, rows))


@dataclass(frozen=True)
class Kind:
    """One kind of valid message and the namespace it goes to (its schema fixed first)."""

    ns: str
    schema: Schema
    fields: Callable[[random.Random, int], dict[str, Any]]

    @property
    def codecs(self) -> dict[str, Codec]:
        return self.schema.codecs

    def batch(self, rng: random.Random, batch_id: str) -> StepBatch:
        n = rng.randint(1, 6)
        b = _base(rng, batch_id, n, self.fields(rng, n))
        if self.ns == "fuzz-llm":  # the LLM preset's tags
            b.nums = {
                "t:prompt_uid": np.full(n, float(rng.randrange(2**53))),
                "t:final_reward": np.full(n, np.nan if rng.random() < 0.5 else rng.random()),
                "t:retokenized": np.zeros(n),
            }
        return b


def _vectors(rng: random.Random, n: int) -> dict[str, Any]:
    img = np.arange(n * 64, dtype=np.uint8).reshape(n, *IMG)
    return {
        "obs": np.full((n, OBS), rng.random(), np.float32),
        "action": np.arange(n, dtype=np.int64),
        "img": _maybe_encoded(ZSTD, img, rng),
    }


CODEC_FIELDS = {  # every codec: name -> (codec, row shape)
    "lz": ("lz4", (16,)),
    "png": ("png", IMG),
    "delta": ("delta:4", IMG),
    "jpeg": ("jpeg:90", (*IMG, 3)),
    "webp": ("webp:80", (*IMG, 3)),
}


def _codecs(rng: random.Random, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"action": np.arange(n, dtype=np.int64)}
    for name, (codec, shape) in CODEC_FIELDS.items():
        out[name] = _maybe_encoded(Codec.of(codec), _u8(rng, (n, *shape)), rng)  # type: ignore[arg-type]
    return out


def _ragged(rng: random.Random, n: int) -> dict[str, Any]:
    lens = [rng.randint(0, 5) for _ in range(n)]
    toks = Ragged.of([np.arange(k, dtype=np.int32) for k in lens], np.int32)
    return {
        "obs": Ragged.of([np.full((k, 4), rng.random(), np.float32) for k in lens], np.float32),
        "action": np.arange(n, dtype=np.int64),
        "tok": _maybe_encoded(ZSTD, toks, rng),
    }


def _llm(rng: random.Random, n: int) -> dict[str, Any]:
    def rows(dtype: Any, fill: Callable[[int], np.ndarray]) -> Ragged:
        return Ragged.of([fill(k) for k in lens], dtype)

    lens = [rng.randint(1, 6) for _ in range(n)]
    return {
        "prompt_ids": rows(np.int32, lambda k: np.arange(k, dtype=np.int32)),
        "response_ids": rows(np.int32, lambda k: np.arange(k, dtype=np.int32) + 7),
        "response_logprobs": rows(np.float32, lambda k: -np.full(k, rng.random(), np.float32)),
        "response_mask": rows(np.uint8, lambda k: np.ones(k, np.uint8)),
    }


KINDS = [
    Kind(
        "fuzz",
        Schema(
            {
                "obs": FieldSpec("<f4", (OBS,)),
                "action": FieldSpec("<i8", ()),
                "img": FieldSpec("|u1", IMG, "zstd"),
            }
        ),
        _vectors,
    ),
    Kind(
        "fuzz-codecs",
        Schema(
            {
                "action": FieldSpec("<i8", ()),
                **{k: FieldSpec("|u1", s, c) for k, (c, s) in CODEC_FIELDS.items()},
            }
        ),
        _codecs,
    ),
    Kind(
        "fuzz-ragged",
        Schema(
            {
                "obs": FieldSpec("<f4", (None, 4)),
                "action": FieldSpec("<i8", ()),
                "tok": FieldSpec("<i4", (None,), "zstd"),
            }
        ),
        _ragged,
    ),
    Kind("fuzz-llm", Schema.llm(response_mask=True), _llm),
]
KIND_WEIGHTS = [4, 3, 2, 2]
FRESH = "fuzz-fresh"  # no schema yet: only messages whose every step is refused go there
REFUSED_TAG = "refused"  # tags only all-refused messages carry: no schema may gain one


def _bad_frames(codec: Codec, row: tuple[int | None, ...], m: Material) -> list[bytes]:
    """CodecFrames a producer must not get stored in a field of ``codec``: bombs, frames of
    another row size, truncated and garbage ones; a delta from a producer."""
    if row and row[0] is None:  # ragged: items of the field's dtype
        good, other = encode(codec, [np.arange(3, dtype=np.int32)]), None
    else:
        shape = tuple(d for d in row if d is not None)
        good = encode(codec, np.zeros((1, *shape), np.uint8))
        bigger = (shape[0] * 2, *shape[1:]) if shape else (2,)
        other = encode(codec, np.zeros((1, *bigger), np.uint8))[0].tobytes()
    g = good[0].tobytes()
    out = [b"", g[:-3], g[: len(g) // 2], b"\x00" * 12, *([other] if other else [])]
    if codec.name in ("zstd", "delta"):
        wrap = (lambda f: key_frame(f, 0)) if codec.name == "delta" else (lambda f: f)
        out += [wrap(m.zstd_bomb), wrap(m.zstd_nosize), wrap(m.zstd_liar)]
    if codec.name == "delta":  # a delta frame refers to a stored key: never from a producer
        out += [b"D" + (5).to_bytes(8, "little") + g[9:], b"K" + bytes(3)]
    if codec.name == "lz4":
        out += [(1 << 30).to_bytes(4, "little") + g[4:], m.lz4_field_bomb]
    return out


def _mapping(d: dict, key: str) -> dict:
    """``d[key]`` where an earlier mutation of the same case left it a mapping, else empty
    (a case may mutate its payload twice: the first may have replaced the map)."""
    value = d.get(key)
    return value if isinstance(value, dict) else {}


def _sub(d: dict, key: str) -> dict:
    """``d[key]`` as a mapping to write into: a new one where it is missing or not a map."""
    d[key] = _mapping(d, key)
    return d[key]


def m_codec(d: dict, rng: random.Random, m: Material) -> None:
    """Hostile frames of a compressed field: bombs, lying or missing sizes, garbage,
    offsets that do not cover the data, another codec, a malformed map."""
    codecs = m.kind.codecs
    if not codecs:
        return m_packed(d, rng, m)
    name = rng.choice(sorted(codecs))
    spec = m.kind.schema.fields[name]
    n = _n(d)
    good = m.good_frame[(m.kind.ns, name)]
    frames = [good] * n
    bad = rng.choice(m.bad[(m.kind.ns, name)] + [rng.randbytes(30)])
    for i in rng.sample(range(n), k=rng.randint(1, n)) if n else []:
        frames[i] = bad
    enc = Encoded(
        spec.codec, np.dtype(spec.dtype), (n, *spec.shape), CodecFrames.of(frames)
    ).to_msg()  # type: ignore[arg-type]
    what = rng.randrange(9)
    if what == 1:
        enc["offsets"] = pack_array(np.array([0, 5, 2, 10**9][: n + 1], np.int64))
    elif what == 2:
        enc["codec"] = rng.choice(["lz4", "png", "jpeg", "gzip", 5, None, "zstd:99", "delta"])
    elif what == 3:
        enc["row"] = rng.choice([[9, 9], [None, 8], [-1], "x", [8, 8, 1000000]])
    elif what == 4:
        enc["dtype"] = rng.choice(["<f4", "|O", "V8", None, "xyz"])
    elif what == 5:
        enc[rng.choice(["extra", "data"])] = rng.choice(GARBAGE)
    elif what == 6:
        enc = {"codec": "zstd", "values": pack_array(np.zeros(n, np.uint8))}
    elif what == 7:  # offsets lz4-compressed: they must travel plain
        dtype, shape, data, _ = enc["offsets"]
        enc["offsets"] = [dtype, shape, lz4.block.compress(data), True]
    _sub(d, "fields")[name] = enc


def _bomb(declared: int) -> list[Any]:
    """An lz4 frame of zeros that inflates to ``declared`` bytes (~1/255 of it on the wire)."""
    return ["<f4", [declared // (4 * OBS), OBS], lz4.block.compress(bytes(declared)), True]


class Material:
    """Valid messages and the hostile pieces the mutations draw from."""

    def __init__(self, others: list[str]) -> None:
        self.kind = KINDS[0]  # the kind of the case being built
        self.other_keys = [
            k
            for o in others
            for k in (Keys(o).config, Keys(o).dead, Keys(o).shard_key(0, "seq"), Keys(o).stage("x"))
        ]
        self.bomb = _bomb(BUDGET + (4 << 20))  # one frame over the budget
        # CodecFrames that each fit the budget but not together (nor one with its inflating
        # copy): refused before any is inflated.
        self.split = _bomb(BUDGET // 3 + 4096)
        self.half = _bomb(BUDGET * 3 // 4 // (4 * OBS) * (4 * OBS))
        zc = zstandard.ZstdCompressor()
        self.zstd_bomb = zc.compress(bytes(1 << 27))  # 128 MiB of zeros in ~4 KiB
        self.zstd_nosize = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64))
        self.zstd_liar = zc.compress(bytes(65))  # one byte more than the field's row
        self.lz4_field_bomb = lz4.block.compress(bytes(BUDGET))
        self.good_frame: dict[tuple[str, str], bytes] = {}
        self.bad: dict[tuple[str, str], list[bytes]] = {}
        for kind in KINDS:
            for name, codec in kind.codecs.items():
                spec = kind.schema.fields[name]
                if spec.ragged:
                    good = encode(codec, [np.arange(3, dtype=np.int32)])
                else:
                    good = encode(codec, np.zeros((1, *spec.shape), np.uint8))  # type: ignore[arg-type]
                self.good_frame[(kind.ns, name)] = good[0].tobytes()
                self.bad[(kind.ns, name)] = _bad_frames(codec, spec.shape, self)
        self.n_big = 70_000  # rows, over CLAW_MAX_BATCH_STEPS' 65536
        z = pack_array(np.zeros(self.n_big, np.int64))
        self.big_cols = {
            "step_index": z,
            "reward": pack_array(np.zeros(self.n_big, np.float32)),
            "terminated": pack_array(np.zeros(self.n_big, bool)),
            "truncated": pack_array(np.zeros(self.n_big, bool)),
            "episode": [["e"], pack_array(np.zeros(self.n_big, np.int32))],
        }

    @property
    def ns(self) -> str:
        return self.kind.ns

    @property
    def keys(self) -> Keys:
        return Keys(self.kind.ns)


# ---- structured mutations ---------------------------------------------------------------
GARBAGE = [
    None,
    True,
    -1,
    2**40,
    1.5,
    float("inf"),
    "",
    "x" * 300,
    "a:b{c}",
    b"\x00\xff",
    [],
    [1, 2],
    {},
    {"a": 1},
    {1: 2},
]
DTYPES = [
    "|O",
    "<c8",
    "V8",
    "S4",
    "<U2",
    "f4,f4",
    "",
    "xyz",
    "(2,)f4",
    "M8[s]",
    "<f2",
    "|b1",
    5,
    None,
    "x" * 40,
]
PACKED_KEYS = [
    "step_index",
    "reward",
    "terminated",
    "truncated",
    "next_rows",
    "info_rows",
    "priority",
    "policy_version",
]


def _n(d: dict) -> int:
    """The batch's step count as its packed reward array declares it (1 if that is garbage)."""
    try:
        return max(0, min(int(d["reward"][1][0]), 64))
    except (KeyError, TypeError, ValueError, IndexError):
        return 1


def _packed_ref(d: dict, rng: random.Random) -> tuple[Any, Any]:
    """(container, key) of a random packed array in a batch map."""
    choices: list[tuple[Any, Any]] = [(d, k) for k in PACKED_KEYS if isinstance(d.get(k), list)]
    if isinstance(d.get("episode"), list) and len(d["episode"]) == 2:
        choices.append((d["episode"], 1))
    if isinstance(d.get("fields"), dict):
        choices += [(d["fields"], k) for k in d["fields"]]
    return rng.choice(choices) if choices else (d, "reward")


def m_packed(d: dict, rng: random.Random, m: Material) -> None:
    box, key = _packed_ref(d, rng)
    f = box[key]
    f = list(f) if isinstance(f, list) and len(f) == 4 else ["<f4", [1], b"\0" * 4, False]
    what = rng.randrange(9)
    if what == 0:
        f[0] = rng.choice(DTYPES)
    elif what == 1:
        f[1] = rng.choice([[-1], [2**40], "3", None, [1] * 33, [0], [7], [2, 2**31], [2**31]])
    elif what == 2:
        f[2] = f[2][: rng.randrange(len(f[2]) + 1)] if isinstance(f[2], bytes) else b"\x01"
    elif what == 3:
        f[2] = (f[2] if isinstance(f[2], bytes) else b"") + b"\x00" * rng.randrange(1, 9)
    elif what == 4:
        f[2], f[3] = rng.randbytes(rng.randrange(1, 64)), True  # lz4 garbage
    elif what == 5:
        f[2], f[3] = (rng.randrange(2**31)).to_bytes(4, "little") + rng.randbytes(8), True
    elif what == 6:
        f = rng.choice([m.bomb, m.half])
    elif what == 7:
        f[3] = rng.choice(GARBAGE)
    else:
        f = rng.choice(GARBAGE)
    box[key] = f


def m_key(d: dict, rng: random.Random, m: Material) -> None:
    if rng.random() < 0.5 and d:
        d.pop(rng.choice(sorted(d, key=str)))
    else:
        d[rng.choice(["extra", "v2", 7, "fields2"])] = rng.choice(GARBAGE)


def m_value(d: dict, rng: random.Random, m: Material) -> None:
    d[rng.choice(sorted(d, key=str))] = rng.choice(GARBAGE)


def m_version(d: dict, rng: random.Random, m: Material) -> None:
    d["v"] = rng.choice([0, 2, "1", None, 1.0, True, 2**63])


def m_id(d: dict, rng: random.Random, m: Material) -> None:
    d["id"] = rng.choice(["other", "a b", "{x}", "x" * 200, 5, None])


def m_episode(d: dict, rng: random.Random, m: Material) -> None:
    n = _n(d)
    d["episode"] = rng.choice(
        [
            [[1, 2], pack_array(np.zeros(n, np.int32))],
            [["a"], pack_array(np.full(n, 5, np.int32))],
            [["a"], pack_array(np.full(n, -2, np.int32))],
            [["a"]],
            "ep",
            [["a"], pack_array(np.zeros(n + 3, np.int32))],
        ]
    )


def m_info(d: dict, rng: random.Random, m: Material) -> None:
    d["info_rows"] = pack_array(np.array([0], np.int32))
    d["info"] = rng.choice(
        [[{1: "x"}], [{"a": [1, 2]}], "str", [[1]], [{"a": {"b": 1}}], [None], [{"a": 1}, {"b": 2}]]
    )


def m_values(d: dict, rng: random.Random, m: Material) -> None:
    """Rows the client would refuse: priorities, step_index and policy_version ranges."""
    n = _n(d)
    col, arr = rng.choice(
        [
            ("priority", np.full(n, rng.choice([-3.0, np.inf, -np.inf]), np.float32)),
            ("step_index", np.full(n, rng.choice([2**31, 2**40, -5]), np.int64)),
            ("policy_version", np.full(n, rng.choice([2**31, -1]), np.int64)),
            ("reward", np.full(n, rng.choice([np.nan, np.inf]), np.float32)),
        ]
    )
    d[col] = pack_array(arr)


def m_overflow(d: dict, rng: random.Random, m: Material) -> None:
    """Values finite as sent that are not once stored: float64 reward and priority past
    float32, a long double tag past float64; on some rows or all."""
    n = _n(d)
    rows = rng.sample(range(n), k=rng.randint(1, n)) if n else []
    col, dtype, big = rng.choice(
        [
            ("reward", "<f8", rng.choice([1e39, -1e39, 1e300, -1e300, 3.5e38])),
            ("priority", "<f8", rng.choice([1e39, 1e300, 3.5e38])),
            ("nums", np.longdouble, np.longdouble("1e400") * rng.choice([1, -1])),
        ]
    )
    arr = np.full(n, 0.5, dtype)
    arr[rows] = big
    if col == "nums":
        d["nums"] = {**_mapping(d, "nums"), "t:wide": pack_array(arr)}
    else:
        d[col] = pack_array(arr)


def m_refused(d: dict, rng: random.Random, m: Material) -> None:
    """Every step refused (NaN reward), with tags no committed message carries: no schema
    may gain them."""
    n = _n(d)
    d["reward"] = pack_array(np.full(n, np.nan, np.float32))
    tags = {f"t:{REFUSED_TAG}{i}": pack_array(np.zeros(n)) for i in range(rng.choice([1, 63]))}
    d["nums"] = {**_mapping(d, "nums"), **tags}
    d["strs"] = {f"t:{REFUSED_TAG}s": [["x"], pack_array(np.zeros(n, np.int32))]}


def m_split(d: dict, rng: random.Random, m: Material) -> None:
    """lz4 frames that fit the budget one by one, not together."""
    d["fields"] = {**_mapping(d, "fields"), **{f"big{i}": m.split for i in range(3)}}


def m_rows(d: dict, rng: random.Random, m: Material) -> None:
    d[rng.choice(["next_rows", "info_rows"])] = pack_array(
        np.array(rng.choice([[0, 0], [99], [-1]]), np.int32)
    )


def m_ragged(d: dict, rng: random.Random, m: Material) -> None:
    lengths = rng.choice([[-1, 5], [1000], [0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    _sub(d, "fields")["obs"] = {
        "values": pack_array(np.zeros((2, OBS), np.float32)),
        "lengths": pack_array(np.array(lengths, np.int32)),
    }


def m_placed(d: dict, rng: random.Random, m: Material) -> None:
    if isinstance(d.get("fields"), dict):
        d["fields"].pop("obs", None)
    n = _n(d)
    d["placed"] = {"obs": ["<f4", [rng.choice([n, 1_000_000, n + 1]), OBS]]}


def m_tags(d: dict, rng: random.Random, m: Material) -> None:
    n = _n(d)
    names = rng.choice(
        [
            [f"t:tag{i}" for i in range(100)],
            ["t:reward"],
            ["t:"],
            ["bad"],
            ["t:a:b"],
            ["t:" + "x" * 200],
        ]
    )
    d["nums"] = {k: pack_array(np.zeros(n, np.float64)) for k in names}


def m_strs(d: dict, rng: random.Random, m: Material) -> None:
    n = _n(d)
    d["strs"] = {
        rng.choice(["agent_id", "nope", "t:s"]): [
            [rng.choice(GARBAGE)],
            pack_array(np.zeros(n, np.int32)),
        ]
    }


def m_huge_n(d: dict, rng: random.Random, m: Material) -> None:
    d.update(copy.deepcopy(m.big_cols))
    d["fields"] = {}
    d["placed"] = {"obs": ["<f4", [m.n_big, OBS]], "action": ["<i8", [m.n_big]]}


def m_schema(d: dict, rng: random.Random, m: Material) -> None:
    n = _n(d)
    f = _sub(d, "fields")
    choice = rng.randrange(3)
    if choice == 0:
        f["obs"] = pack_array(np.zeros((n, OBS + 1), np.float32))
    elif choice == 1:
        f["reward"] = pack_array(np.zeros(n, np.float32))  # reserved name
    else:
        f["new{field}"] = pack_array(np.zeros(n, np.float32))


PAYLOAD_OPS: list[Callable[[dict, random.Random, Material], None]] = [
    m_packed,
    m_packed,
    m_packed,
    m_key,
    m_value,
    m_version,
    m_id,
    m_episode,
    m_info,
    m_values,
    m_values,
    m_rows,
    m_ragged,
    m_placed,
    m_tags,
    m_strs,
    m_huge_n,
    m_schema,
    m_codec,
    m_codec,
    m_overflow,
    m_overflow,
    m_refused,
    m_split,
]


class Case:
    """One message: envelope, headers, body; mutated in place."""

    def __init__(self, m: Material, rng: random.Random, i: int, r: redis.Redis) -> None:
        self.m, self.rng, self.r = m, rng, r
        self.batch_id = f"c{i}"
        m.kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        self.ns = m.kind.ns
        self.batch = m.kind.batch(rng, self.batch_id)
        self.copies = 1  # deliveries of the same message (a redelivery: the worker races them)
        self.payload: Any = msgpack.unpackb(self.batch.encode(), raw=False, strict_map_key=False)
        self.claim = rng.random() < 0.2
        self.args: list[Any] = []
        self.kwargs: dict[str, Any] = {}
        self.embed: Any = None
        self.headers: Any = headers()
        self.content_type, self.encoding = MSGPACK, "binary"
        self.data: bytes | None = None  # the body bytes, when set directly
        self.refused = False  # every step refused (m_refused): no later op may undo it

    def build(self) -> tuple[bytes, Any, str, str]:
        if self.data is not None:
            return self.data, self.headers, self.content_type, self.encoding
        return (
            body(self.args, self.kwargs, self.embed),
            self.headers,
            self.content_type,
            self.encoding,
        )


def _encode_payload(c: Case) -> None:
    raw = c.payload if isinstance(c.payload, bytes) else packb(c.payload)
    stage = Keys(c.ns).stage(c.batch_id)
    if c.claim:
        c.r.set(stage, raw, ex=3600)
        c.args = [MESSAGE_VERSION, c.ns, c.batch_id, None, stage]
    else:
        c.args = [MESSAGE_VERSION, c.ns, c.batch_id, raw, None]


def o_payload(c: Case) -> None:
    if isinstance(c.payload, dict):  # not once it is bytes
        op = c.rng.choice(PAYLOAD_OPS)
        # Nor after m_refused: a later op (m_overflow's reward, m_huge_n's columns) would
        # make steps valid again, committed with the refused message's tags.
        if not c.refused:
            op(c.payload, c.rng, c.m)
            c.refused = op is m_refused


def o_fresh(c: Case) -> None:
    """A message whose every step is refused, to a namespace without a schema yet."""
    if isinstance(c.payload, dict):
        c.ns = FRESH
        m_refused(c.payload, c.rng, c.m)


def o_twice(c: Case) -> None:
    c.copies = 2


def o_big_garbage(c: Case) -> None:
    c.payload = b"\xc1" + c.rng.randbytes(c.rng.randrange(20_000, 80_000))


def o_bytes(c: Case) -> None:
    raw = bytearray(packb(c.payload) if not isinstance(c.payload, bytes) else c.payload)
    for _ in range(c.rng.randrange(1, 8)):
        raw[c.rng.randrange(len(raw))] = c.rng.randrange(256)
    c.payload = bytes(raw[: c.rng.randrange(len(raw) // 2, len(raw) + 1)])


def o_args(c: Case) -> None:
    if not isinstance(c.args, list) or len(c.args) != 5:
        return  # already mutated past recognition
    i = c.rng.randrange(7)
    if i == 0:
        c.args[0] = c.rng.choice([0, 2, "1", None, 1.0, True])
    elif i == 1:
        c.args[1] = c.rng.choice([*GARBAGE, "nope-ns", "a:b", "x{y}"])
    elif i == 2:
        c.args[2] = c.rng.choice([*GARBAGE, "a b", "{x}", "x" * 200])
    elif i == 3:
        c.args[3], c.args[4] = c.args[4], c.args[3]
    elif i == 4:
        c.args[3] = None
        c.args[4] = c.rng.choice(
            [
                *c.m.other_keys,
                c.m.keys.config,
                c.m.keys.stage("c0"),
                c.m.keys.dead,
                "ingest",
                "unacked",
                7,
            ]
        )
    elif i == 5:
        c.args = c.args[: c.rng.randrange(5)] + ([1] if c.rng.random() < 0.3 else [])
    else:
        c.kwargs = {c.rng.choice(["payload", "x"]): c.rng.choice(GARBAGE)}


def o_body(c: Case) -> None:
    i = c.rng.randrange(6)
    if i == 0:
        c.data = msgpack.packb(
            c.rng.choice([7, None, {"args": 1}, [1], [[], {}], [[], {}, None, 1], "s"])
        )
    elif i == 1:
        c.embed = {"callbacks": [{"task": "claw.maintenance.refill", "args": []}]}
    elif i == 2:
        c.embed = c.rng.choice(GARBAGE[1:])
    elif i == 3:
        c.args = c.rng.choice(GARBAGE)  # type: ignore[assignment]
    elif i == 4:
        raw = body(c.args, c.kwargs)
        c.data = raw[: c.rng.randrange(len(raw))]
    else:
        c.kwargs = {1: 2}  # type: ignore[dict-item]


def o_envelope(c: Case) -> None:
    i = c.rng.randrange(5)
    if i == 0:
        c.content_type = c.rng.choice(
            [
                "application/json",
                "text/plain",
                "application/x-python-serialize",
                "",
                "application/data",
            ]
        )
    elif i == 1:
        c.encoding = c.rng.choice(["utf-8", "gzip", ""])
    elif i == 2:
        c.headers = c.rng.choice(["str", [1, 2], 5, None])
    else:
        key = c.rng.choice(
            [
                "task",
                "id",
                "timelimit",
                "retries",
                "eta",
                "expires",
                "argsrepr",
                "shadow",
                "stamps",
                "stamped_headers",
                "group_index",
                "root_id",
                "ignore_result",
                "replaced_task_nesting",
            ]
        )
        val = c.rng.choice(
            [
                None,
                5,
                -1,
                "x",
                "soon",
                [1],
                ["a", "b"],
                [1, 1],
                {"a": 1},
                "celery.chain",
                "claw.maintenance.refill",
                "claw.nope",
                "9999-01-01T00:00:00",
                "2000-01-01T00:00:00",
                True,
                1.5,
            ]
        )
        if c.headers is not None and isinstance(c.headers, dict):
            if c.rng.random() < 0.2:
                c.headers.pop(key, None)
            else:
                c.headers[key] = val


LAYER_OPS = [
    (o_payload, 10),
    (o_fresh, 1),
    (o_twice, 2),
    (o_big_garbage, 4),
    (o_bytes, 2),
    (o_args, 4),
    (o_body, 3),
    (o_envelope, 4),
]
PAYLOAD_LAYER = {o_payload, o_fresh, o_big_garbage, o_bytes}


def structured_case(m: Material, rng: random.Random, i: int, r: redis.Redis) -> Case:
    c = Case(m, rng, i, r)
    ops = (
        []
        if rng.random() < 0.08
        else rng.choices(
            [op for op, _ in LAYER_OPS], [w for _, w in LAYER_OPS], k=rng.choice([1, 1, 2, 3])
        )
    )
    if o_fresh in ops:  # alone on the payload: no other op may make a step valid again
        ops = [op for op in ops if op not in PAYLOAD_LAYER or op is o_fresh]
    for op in ops:  # payload first: it is encoded into the args
        if op in PAYLOAD_LAYER:
            op(c)
    _encode_payload(c)
    for op in ops:
        if op not in PAYLOAD_LAYER:
            op(c)
    return c


# ---- hypothesis -------------------------------------------------------------------------
leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=48)
)
values = st.recursive(
    leaf,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
json_leaf = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=12)
json_values = st.recursive(
    json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
frames = values | st.tuples(
    st.sampled_from(["<f4", "<i8", "|b1", "<i4"]) | values,
    st.lists(st.integers(-3, 2**33), max_size=3) | values,
    st.binary(max_size=96),
    st.booleans() | values,
).map(list)
BATCH_KEYS = [
    "v",
    "id",
    "episode",
    "step_index",
    "reward",
    "terminated",
    "truncated",
    "priority",
    "policy_version",
    "strs",
    "nums",
    "fields",
    "next_rows",
    "next_obs",
    "info_rows",
    "info",
    "placed",
]


def hypothesis_storm(m: Material, publish: Callable[[Case], None], r: redis.Redis, n: int) -> None:
    counter = iter(range(10**9))

    def case() -> Case:
        i = next(counter)
        c = Case(m, random.Random(i), 10**6 + i, r)
        return c

    @seed(SEED)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(kind=st.integers(0, 3), data=st.data())
    def storm(kind: int, data: st.DataObject) -> None:
        c = case()
        if kind == 0:  # the batch map: values (or packed-array-like lists) where its parts go
            for key in data.draw(st.lists(st.sampled_from(BATCH_KEYS), min_size=1, max_size=3)):
                c.payload[key] = data.draw(frames if key not in ("v", "id") else values)
            _encode_payload(c)
        elif kind == 1:  # the args
            _encode_payload(c)
            c.args = data.draw(st.lists(values | st.sampled_from(c.args), max_size=6))
        elif kind == 2:  # the whole body
            c.data = packb(data.draw(values))
        else:  # headers (JSON: the Redis transport's envelope)
            _encode_payload(c)
            key = data.draw(
                st.sampled_from(
                    [
                        "task",
                        "id",
                        "timelimit",
                        "retries",
                        "eta",
                        "expires",
                        "stamps",
                        "argsrepr",
                        "group_index",
                    ]
                )
            )
            c.headers[key] = data.draw(json_values)
        publish(c)

    storm()


# ---- the test ---------------------------------------------------------------------------
NAMESPACES = [k.ns for k in KINDS]
COUNTED = [None, *NAMESPACES, FRESH]  # every outcome hash: claw:rejects and each namespace


def _rss(proc: psutil.Process) -> int:
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _cpu(proc: psutil.Process) -> float:
    """CPU seconds of the worker and its pool (the storm's cost, whatever the load)."""
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


def _peaks(proc: psutil.Process) -> dict[int, int]:
    """High-water RSS (VmHWM) of each pool process: what decoding a message ever took."""
    out = {}
    for child in proc.children():
        for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out[child.pid] = int(line.split()[1]) * 1024
    return out


def run_storm(tmp_path: Path, structured: int, hypothesis: int) -> dict[str, Any]:
    with RedisServer() as server:
        url = server.url
        r = server.client()
        env = {
            "CLAW_DEAD_LETTER_BYTES": str(CAP),
            "CLAW_DEAD_LETTER_PREFIX": str(PREFIX),
            "CLAW_MAX_DECOMPRESSED_BYTES": str(BUDGET),
        }
        # Two pool processes: the copies of a redelivered message race each other.
        worker = Worker(url, "ingest", 2, tmp_path / "worker.log", env)
        try:
            return _storm(url, r, worker, structured, hypothesis)
        finally:
            worker.stop()


def _commit_valid(pub: Publisher, r: redis.Redis, tag: str) -> None:
    """A valid message of every kind commits (before the storm: the material is valid)."""
    start = outcomes(r, *NAMESPACES).get("committed", 0)
    for i, kind in enumerate(KINDS):
        b = kind.batch(random.Random(i), f"{tag}{i}")
        pub.publish(body([MESSAGE_VERSION, kind.ns, b.batch_id, b.encode(), None]), headers())
    deadline = time.monotonic() + 60
    while outcomes(r, *NAMESPACES).get("committed", 0) < start + len(KINDS):
        assert time.monotonic() < deadline, outcomes(r, *NAMESPACES)
        time.sleep(0.05)


def check_stored(url: str, kind: Kind) -> int:
    """Every live step of a fuzzed namespace holds values in their documented ranges, and
    every stored field (every frame of every codec) decodes to its schema's shape."""
    store = Store(url, kind.ns)
    schema = store.config(refresh=True).schema
    assert schema is not None and dict(schema.fields) == dict(kind.schema.fields)
    assert not [t for t in schema.tags if t.startswith(REFUSED_TAG)], schema.tags
    cols = store.meta_columns(0, ["id"])
    ids = cols["id"][cols["alive"]]
    got = store.get(ids)
    assert np.isfinite(got["reward"]).all()
    p = got["priority"]
    assert (np.isnan(p) | (np.isfinite(p) & (p >= 0))).all()
    assert (got["step_index"] >= 0).all() and (got["policy_version"] >= 0).all()
    for t, k in schema.tags.items():
        if k == "num":
            v = got[f"tags.{t}"]
            assert (np.isnan(v) | np.isfinite(v)).all(), t
    for name, spec in schema.fields.items():
        v = got[name]
        if spec.ragged:
            assert all(row.dtype == np.dtype(spec.dtype) for row in v)
        else:
            assert v.shape == (len(ids), *spec.shape) and v.dtype == np.dtype(spec.dtype)
    return len(ids)


def _storm(url: str, r: redis.Redis, worker: Worker, structured: int, hyp: int) -> dict:
    others = ["other-a", "other-b"]
    for o in others:  # bystanders with data, a staged claim check and a dead letter
        ing = Ingestor(o, url, flush_interval=None, capacity=64)
        with ing.episode(episode_id="keep") as ep:
            for t in range(20):
                ep.add(np.full(OBS, t, np.float32), np.int64(t), 1.0)
        assert ing.close().committed == 20
        r.set(Keys(o).stage("x"), b"staged", ex=3600)
    for kind in KINDS:
        Store(url, kind.ns).create(capacity=CAPACITY, schema=kind.schema)
    Store(url, FRESH).create(capacity=CAPACITY)
    pub = Publisher(url)
    _commit_valid(pub, r, "warm")
    m = Material(others)
    for i in range(20):  # warm up every path (scripts loaded, connections open)
        publish_case = structured_case(m, random.Random(-1 - i), -1 - i, r)
        pub.publish(*publish_case.build())
    assert wait_for(r, 20 + len(KINDS), *COUNTED) == 20 + len(KINDS)
    proc = psutil.Process(worker.proc.pid)
    rss0, mem0 = _rss(proc), int(r.info("memory")["used_memory"])
    peaks0 = _peaks(proc)
    before = {o: dump_keys(r, o) for o in others}
    done0, sent0 = messages_done(r, *COUNTED), pub.sent

    def publish(c: Case) -> None:
        data, hdrs, ctype, enc = c.build()
        for _ in range(c.copies):
            pub.publish(data, hdrs, content_type=ctype, content_encoding=enc)

    started, cpu0 = time.monotonic(), _cpu(proc)
    rng = random.Random(SEED)
    for i in range(structured):
        publish(structured_case(m, rng, i, r))
    hypothesis_storm(m, publish, r, hyp)
    sent = pub.sent - sent0
    left = done0 + sent
    assert wait_for(r, left, *COUNTED, timeout=60 + sent / 20) == left, "messages vanished"
    took, cpu = time.monotonic() - started, _cpu(proc) - cpu0
    # The worker is alive, no pool process was replaced, and every kind still commits.
    assert worker.proc.poll() is None
    peaks1 = _peaks(proc)
    assert set(peaks1) == set(peaks0), "a pool process died and was replaced"
    _commit_valid(pub, r, "after")
    live = {kind.ns: check_stored(url, kind) for kind in KINDS}
    fresh = Store(url, FRESH)
    assert fresh.config(refresh=True).schema is None and fresh.count() == 0
    while r.llen("ingest") or r.hlen("unacked"):
        time.sleep(0.05)
    # Exactly one outcome per delivery: none vanished, none counted twice.
    assert messages_done(r, *COUNTED) == left + len(KINDS)
    mem1, rss1 = int(r.info("memory")["used_memory"]), _rss(proc)
    stats = {
        "ns": outcomes(r, *NAMESPACES, FRESH),
        "rejects": outcomes(r, None),
        "sent": sent,
        "live": live,
        "took": took,
        "cpu": cpu,
    }
    assert {o: dump_keys(r, o) for o in others} == before, "another namespace changed"
    for key in (*(Keys(ns).dead for ns in [*NAMESPACES, FRESH]), REJECTS):  # every letter says why
        assert all(f[b"reason"] and f[b"code"] for _, f in r.xrange(key))
    dead_cap = CAP * len(COUNTED)  # each namespace's stream and claw:rejects
    assert stats["ns"].get("dead_trimmed", 0) > 0, "the storm should have hit the cap"
    # Done records (one per message with a usable batch id) expire after a day; they are
    # the one part that grows with the message count, so they are bounded per message.
    done = [k for ns in [*NAMESPACES, FRESH] for k in r.scan_iter(match=Keys(ns).done("*"))]
    done_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in done)
    assert done_bytes <= 1024 * sent and all(r.ttl(k) > 0 for k in done[:500])
    # Claim checks this test staged as the producer for messages it then mutated away from
    # them: a producer's own writes (they expire), not the worker's.
    staged = [k for ns in [*NAMESPACES, FRESH] for k in r.scan_iter(match=Keys(ns).stage("*"))]
    staged_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in staged)
    grown = mem1 - mem0 - done_bytes - staged_bytes
    assert grown <= 1.1 * dead_cap, f"Redis grew {mem1 - mem0} bytes ({grown} not done/staged)"
    assert rss1 <= 2 * rss0, f"worker RSS {rss0} -> {rss1}"
    # No message made a pool process inflate what the budget refuses.
    peak = max(peaks1[pid] - peaks0[pid] for pid in peaks0)
    assert peak < BUDGET, f"a pool process's peak RSS grew {peak} bytes"
    doctor = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "doctor"],
        cwd=ROOT,
        env={**os.environ, "CLAW_REDIS_URL": url, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert doctor.returncode == 0 and "no problems found" in doctor.stdout, doctor.stdout[-3000:]
    stats.update(
        mem=mem1 - mem0,
        done_bytes=done_bytes,
        staged_bytes=staged_bytes,
        rss=(rss0, rss1),
        peak=peak,
    )
    pub.close()
    return stats


def _report(stats: dict) -> None:
    print(
        f"\nfuzz: {stats['sent']} deliveries in {stats['took']:.1f} s (worker CPU"
        f" {stats['cpu']:.1f} s); namespaces {stats['ns']};"
        f" rejects {stats['rejects']}; live steps {stats['live']};"
        f" Redis +{stats['mem']} bytes (done records {stats['done_bytes']}, staged by the"
        f" test {stats['staged_bytes']}); worker RSS {stats['rss']}, pool peak"
        f" +{stats['peak']}"
    )


def test_fuzz_ingest_ci(tmp_path):
    _report(run_storm(tmp_path, structured=2000, hypothesis=600))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_ingest_long(tmp_path):
    _report(run_storm(tmp_path, structured=30_000, hypothesis=10_000))
