"""Batch wire format: bit-exact round trips and zero-copy decoding."""

import contextlib
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from orchestrator.delivery.wire import (
    ALIGN,
    VERSION,
    Pending,
    WireLayout,
    WireLayouts,
    WireVersionError,
    decode_batch,
    is_batch,
    to_wire,
)
from orchestrator.sampling.groups import Claim

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "<i2",
    ">i2",
    "<u4",
    "<i8",
    "<f2",
    "<f4",
    ">f8",
    "<c8",
    "<c16",
    "S5",
    "<U3",
    "<M8[ns]",
    "<m8[s]",
]


def wire_bytes(*args, **kwargs) -> bytes:
    """A batch as queue bytes (what prefetch pushes when no shared memory is used)."""
    return to_wire(*args, **kwargs).tobytes()


def as_bytes_view(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def assert_bit_exact(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (5, 3), (5, 0), (5, 2, 3, 1)])
def test_round_trip_dtypes_and_shapes(dtype, shape):
    raw = np.random.default_rng(0).integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    arr = np.frombuffer(raw.astype(np.uint8).tobytes(), dtype=dtype).reshape(shape)
    buf = wire_bytes({"x": arr}, ids=np.arange(5) * 10)
    out = decode_batch(buf)
    assert_bit_exact(arr, out["x"])
    assert np.shares_memory(out["x"], as_bytes_view(buf)) or arr.size == 0


def test_a_once_batch_carries_its_claim():
    """What a dropped batch gives back travels in the header; other batches have none."""
    claim = Claim(3, "a1b2c3", ("s|1000.0|0", "s|1001.0|0"))
    out = decode_batch(wire_bytes({"x": np.zeros(2)}, ids=[1, 2], claim=claim))
    assert out.claim == claim and out.claim.mark == "3:a1b2c3"
    assert decode_batch(wire_bytes({"x": np.zeros(2)}, ids=[1, 2])).claim is None


def test_empty_batch_and_no_fields():
    out = decode_batch(wire_bytes({"obs": np.zeros((0, 84, 84, 3), np.uint8)}, ids=[]))
    assert len(out) == 0 and out["obs"].shape == (0, 84, 84, 3)
    assert out.ids.dtype == np.int64 and out.weights.dtype == np.float32
    bare = decode_batch(wire_bytes({}, ids=[1, 2]))
    assert len(bare) == 2 and list(bare) == []  # len() counts rows, not fields


@settings(max_examples=60, deadline=None)
@given(
    arrays=st.dictionaries(
        st.text(min_size=1, max_size=8),
        hnp.arrays(
            dtype=st.one_of(
                hnp.scalar_dtypes(), hnp.byte_string_dtypes(), hnp.unicode_string_dtypes()
            ),
            shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5).map(
                lambda s: (4, *s[1:])
            ),
        ),
        max_size=4,
    ),
    meta=st.dictionaries(st.text(max_size=5), st.integers(-(2**40), 2**40) | st.text(), max_size=3),
)
def test_round_trip_property(arrays, meta):
    ids = np.array([3, 1, 4, 1], np.int64)
    weights = np.array([0.5, 1.0, 2.0, 0.25], np.float32)
    buf = wire_bytes(
        arrays,
        ids=ids,
        weights=weights,
        source_index=[1, 0, 1, 1],
        sources=["a", "b"],
        recipe_version=7,
        meta=meta,
    )
    out = decode_batch(buf)
    assert list(out) == list(arrays)
    for name, arr in arrays.items():
        assert_bit_exact(arr, out[name])
    assert_bit_exact(ids, out.ids)
    assert_bit_exact(weights, out.weights)
    assert out.source_index.tolist() == [1, 0, 1, 1] and out.source_index.dtype == np.int16
    assert out.sources == ("a", "b") and out.recipe_version == 7 and out.meta == meta


def test_decode_is_zero_copy_and_aligned():
    obs = np.random.default_rng(0).integers(0, 256, (8, 84, 84, 3), dtype=np.uint8)
    fields = {"obs": obs, "reward": np.arange(8, dtype=np.float32), "odd": np.ones((8, 3), "u1")}
    buf = bytearray(wire_bytes(fields, ids=np.arange(8)))
    out = decode_batch(buf)
    base = as_bytes_view(buf)
    for arr in [*out.values(), out.ids, out.weights, out.source_index]:
        assert np.shares_memory(arr, base)
        assert (arr.ctypes.data - base.ctypes.data) % ALIGN == 0
    out["reward"][0] = 42.0  # a writable buffer gives writable views of itself
    assert decode_batch(buf)["reward"][0] == 42.0
    assert not decode_batch(bytes(buf))["obs"].flags.writeable


def test_wire_chunks_concatenate_to_the_encoding():
    strided = np.arange(60, dtype=np.int32).reshape(6, 10)[:, ::3]
    wire = to_wire({"s": strided, "t": np.eye(6)}, ids=range(6), meta={"k": [1, 2]})
    blob = b"".join(bytes(c) for c in wire.chunks())
    assert blob == wire.tobytes() and len(blob) == wire.nbytes and is_batch(blob)
    out = decode_batch(blob)
    assert_bit_exact(strided, out["s"])
    assert out.meta == {"k": [1, 2]} and out.weights.tolist() == [1.0] * 6


def test_pending_fields_are_laid_out_and_written_later():
    x = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    y = np.arange(6 * 7, dtype=np.uint8).reshape(6, 7)  # not a multiple of ALIGN: padded
    want = to_wire({"x": x, "y": y, "z": np.eye(6)}, ids=range(6), meta={"k": 1}).tobytes()

    def laid():
        return to_wire(
            {"x": Pending(np.float32, (6, 5)), "y": y, "z": Pending(np.float64, (6, 6))},
            ids=range(6),
            meta={"k": 1},
        )

    wire = laid()
    with pytest.raises(ValueError, match=r"pending fields not written yet: \['x', 'z'\]"):
        wire.tobytes()
    buf = bytearray(wire.nbytes + 64)  # a destination may be longer (a segment)
    views = wire.write_into(buf)
    assert sorted(views) == ["x", "z"] and views["x"].shape == (6, 5)
    views["x"][:] = x
    views["z"][:] = np.eye(6)
    assert bytes(buf[: wire.nbytes]) == want
    wire = laid()
    wire.place({"x": x, "z": np.eye(6)})
    assert wire.tobytes() == want
    with pytest.raises(ValueError, match="laid out as"):
        laid().place({"x": x.astype(np.float64)})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fields": {"x": np.zeros(3)}, "ids": [1, 2]}, "leading dimension"),
        ({"fields": {"x": np.array([None] * 2)}, "ids": [1, 2]}, "object"),
        ({"fields": {}, "ids": [1.5, 2.0]}, "integer"),
        ({"fields": {}, "ids": np.array([1, 2], np.uint64)}, "uint64"),
        ({"fields": {}, "ids": [1, 2], "weights": [1.0]}, "weights"),
        ({"fields": {}, "ids": [1, 2], "source_index": [0, 1]}, "out of range"),
        ({"fields": {}, "ids": [1, 2], "meta": {"x": object()}}, "msgpack"),
    ],
)
def test_encode_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wire_bytes(**kwargs)


def test_decode_rejects_garbage_and_truncation():
    buf = wire_bytes({"x": np.arange(100)}, ids=range(100))
    with pytest.raises(ValueError, match="magic"):
        decode_batch(b"PKL!" + buf[4:])
    with pytest.raises(ValueError, match="truncated"):
        decode_batch(buf[:-64])
    with pytest.raises(ValueError, match="short"):
        decode_batch(b"CL")
    for header in (7, [1, 2], "x", {"size": 0}):
        head = msgpack.packb(header)
        with pytest.raises(ValueError, match="corrupt"):
            decode_batch(struct.pack("<4sIII", b"CLAW", VERSION, len(head), 0) + head)
    with pytest.raises(ValueError, match="truncated"):
        decode_batch(struct.pack("<4sIII", b"CLAW", VERSION, 1000, 0) + b"\x80")
    with pytest.raises(ValueError, match="truncated"):
        decode_batch(buf[:10])
    _, _, n, tail = struct.unpack_from("<4sIII", buf)
    with pytest.raises(ValueError, match="truncated"):  # the tail's length past the end
        decode_batch(struct.pack("<4sIII", b"CLAW", VERSION, n, tail + 1) + buf[16:])


def test_decode_refuses_shapes_that_are_not_counts():
    """A header's shapes are untrusted: sizes are counted exactly (2**62 x 4 does not wrap to
    0 elements) and must be non-negative integers."""
    buf = wire_bytes({"x": np.arange(4)}, ids=range(4))
    magic, version, n, _ = struct.unpack_from("<4sIII", buf)
    header = msgpack.unpackb(buf[16 : 16 + n])
    dtype, _, off = header["ids"]
    for shape in ([2**62, 4], [2**64 - 1], [1.5], ["4"], [-1], [True]):
        head = msgpack.packb({**header, "ids": [dtype, shape, off]})
        raw = struct.pack("<4sIII", magic, version, len(head), 0) + head + bytes(4096)
        with pytest.raises(ValueError, match=r"corrupt batch|truncated"):
            decode_batch(raw)
    for size in (-1, 1.5, 8):  # every array must lie within the layout's size
        head = msgpack.packb({**header, "size": size})
        raw = struct.pack("<4sIII", magic, version, len(head), 0) + head + bytes(4096)
        with pytest.raises(ValueError, match=r"corrupt batch"):
            decode_batch(raw)


def test_a_layout_is_parsed_once_and_the_parsed_ones_are_bounded(monkeypatch):
    """Batches of one recipe version share their layout: a reader parses it on first sight
    and keeps at most ``kept`` (the most recently parsed); what changes per batch (seed,
    meta, claim) travels in the tail."""
    parsed = []
    parse = WireLayout.parse.__func__

    def counting(cls, raw):
        parsed.append(raw)
        return parse(cls, raw)

    monkeypatch.setattr(WireLayout, "parse", classmethod(counting))
    layouts = WireLayouts(kept=2)
    x = np.arange(8, dtype=np.float32)
    for k in range(3):
        out = decode_batch(
            wire_bytes({"x": x + k}, ids=np.arange(8), seed=k, meta={"k": [k] * 8}), layouts
        )
        assert out["x"][0] == k and out.seed == k and out.meta == {"k": [k] * 8}
    assert len(parsed) == 1 and len(layouts) == 1
    for v in (2, 3, 1):  # recipe versions: three layouts, two kept
        decode_batch(wire_bytes({"x": x}, ids=np.arange(8), recipe_version=v), layouts)
    assert len(parsed) == 4 and len(layouts) == 2
    decode_batch(wire_bytes({"x": x}, ids=np.arange(8), recipe_version=1), layouts)
    assert len(parsed) == 4  # kept
    decode_batch(wire_bytes({"x": x}, ids=np.arange(8), recipe_version=2), layouts)
    assert len(parsed) == 5  # the oldest went first
    decode_batch(wire_bytes({"x": x}, ids=np.arange(8)), None)  # none kept: parsed
    assert len(parsed) == 6


def relaid(buf: bytes, tail: object = None, **changes: object) -> bytes:
    """``buf`` with its layout's keys ``changes`` replaced (and its tail ``tail``), the
    array bodies kept at the same offsets from the data start."""
    _, _, n, t = struct.unpack_from("<4sIII", buf)
    header = {**msgpack.unpackb(buf[16 : 16 + n]), **changes}
    head = msgpack.packb(header)
    end = msgpack.packb(tail) if tail is not None else b""
    bodies = buf[-(-(16 + n) // ALIGN) * ALIGN : len(buf) - t]
    pad = bytes(-(-(16 + len(head)) // ALIGN) * ALIGN - 16 - len(head))
    return struct.pack("<4sIII", b"CLAW", VERSION, len(head), len(end)) + head + pad + bodies + end


def test_decode_checks_every_layout_and_tail_it_reads():
    """A queue item is untrusted: dtypes outside the wire's grammar (object, structured,
    subarray, literals numpy would evaluate), arrays out of order, overlapping, misaligned
    or not one row a step, row arrays in other dtypes, and a tail of the wrong types are
    each one ValueError naming what is wrong; nothing else is raised."""
    buf = wire_bytes({"x": np.zeros((8, 2), np.float32), "r": np.arange(8)}, ids=np.arange(8))
    assert decode_batch(relaid(buf), None)["x"].shape == (8, 2)
    bad = {  # the offsets are those of wire_bytes' layout of these fields
        "|O": {"fields": [["x", "|O", [8], 0]]},
        "(2,)<f4": {"fields": [["x", "(2,)<f4", [8], 0]]},
        "[['a', '<f4']]": {"fields": [["x", [["a", "<f4"]], [8], 0]]},
        "',4'": {"fields": [["x", ",4", [8], 0]]},
        "overlapping": {"fields": [["x", "<f4", [8, 2], 0], ["r", "<i8", [8], 0]]},
        "overlapping ": {"ids": ["<i8", [8], 0]},
        "overlapping  ": {"fields": [["x", "<f4", [8, 2], 1]]},  # misaligned
        "'x' is not 8 rows": {"fields": [["x", "<f4", [3], 0]]},
        "shape []": {"fields": [["x", "<f4", [], 0]]},
        "'weights' is not 8 rows": {"weights": ["<f4", [4], 192]},
        "ids is float64": {"ids": ["<f8", [8], 128]},
        "named twice": {"fields": [["ids", "<f4", [8, 2], 0]]},
        "sources 'abc'": {"sources": "abc"},
        "recipe version '1'": {"recipe_version": "1"},
        "digest [1]": {"recipe_digest": [1]},
        "not a list of arrays": {"fields": {"x": 1}},
        "a row array is None": {"ids": None},
    }
    for message, changes in bad.items():
        with pytest.raises(ValueError, match=r"corrupt batch") as got:
            decode_batch(relaid(buf, **changes), None)
        assert message.strip() in str(got.value) and "\n" not in str(got.value)
    tails = {"meta of list": {"meta": [1]}, "seed 'x'": {"seed": "x"}, "claim [1]": {"claim": [1]}}
    for message, tail in {**tails, "claim [1, 't', [2]]": {"claim": [1, "t", [2]]}}.items():
        with pytest.raises(ValueError, match="corrupt batch tail") as got:
            decode_batch(relaid(buf, tail), None)
        assert message in str(got.value)
    rnd = np.random.default_rng(0)  # random damage: a ValueError or a batch, never a crash
    for _ in range(2000):
        b = np.frombuffer(buf, np.uint8).copy()
        b[rnd.integers(len(b), size=3)] = rnd.integers(256, size=3)
        with contextlib.suppress(ValueError):
            decode_batch(b[: rnd.integers(len(b) + 1)].tobytes(), None)


def test_kept_layouts_are_bounded_by_bytes_and_keyed_by_the_whole_layout():
    """The kept layouts hold at most ``max_bytes`` (the oldest go first; one bigger than
    that alone is never kept), and a batch naming another's recipe version and digest is
    read with the layout of its own bytes."""
    layouts = WireLayouts(kept=64, max_bytes=3000)
    x = np.arange(8, dtype=np.float32)
    for v in range(10):
        decode_batch(wire_bytes({"x": x}, ids=np.arange(8), recipe_version=v), layouts)
        assert layouts.nbytes <= 3000
    assert 0 < len(layouts) < 10
    wide = {f"f{i}": x for i in range(20)}
    decode_batch(wire_bytes(wide, ids=np.arange(8)), layouts)
    assert layouts.nbytes <= 3000 and len(layouts) > 0  # too big to keep: parsed alone
    one = wire_bytes({"x": x}, ids=np.arange(8), recipe_version=3, recipe_digest="d")
    other = wire_bytes(
        {"x": np.ones((8, 4), np.uint8)}, ids=np.arange(8), recipe_version=3, recipe_digest="d"
    )
    assert decode_batch(one, layouts)["x"].dtype == np.float32
    got = decode_batch(other, layouts)["x"]
    assert got.dtype == np.uint8 and got.shape == (8, 4) and got.tolist() == [[1] * 4] * 8


def with_version(buf: bytes, version: int) -> bytes:
    """``buf`` with the format version after the magic replaced (layout: magic, u32 version)."""
    return buf[:4] + struct.pack("<I", version) + buf[8:]


@pytest.mark.parametrize(
    ("version", "fix"),
    [
        (VERSION + 1, "newer Claw: upgrade Claw where this reader runs"),
        (VERSION - 1, "older Claw: upgrade and restart the prefetch workers"),
    ],
)
def test_unknown_version_is_refused_naming_both_versions_and_the_fix(version, fix):
    buf = wire_bytes({"x": np.arange(100)}, ids=range(100))
    assert decode_batch(with_version(buf, VERSION))["x"].sum() == 4950
    with pytest.raises(WireVersionError) as err:
        decode_batch(with_version(buf, version))
    msg = str(err.value)
    assert f"version {version}," in msg and f"reads version {VERSION}" in msg and fix in msg
    # Refused before anything else is read: whatever follows the version is never parsed.
    with pytest.raises(WireVersionError):
        decode_batch(with_version(b"CLAW" + bytes(4) + b"\xc1" * 64, version))
