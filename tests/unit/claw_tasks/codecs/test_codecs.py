"""Payload codecs on their own: every codec and dtype round-trips (bit for bit where
lossless), text forms parse, codecs refuse fields they cannot hold, and a frame that
lies about its size or does not decode is named before anything inflates it."""

from __future__ import annotations

import io
import zlib

import cv2
import numpy as np
import pytest
import zstandard
from PIL import Image

from claw_tasks.codecs import Codec, CodecError, decode, encode, frame_problem
from claw_tasks.format.schema import FieldSpec, Schema, SchemaError

DTYPES = ["|u1", "|i1", "<u2", "<i4", ">i4", "<i8", "<f2", "<f4", "<f8", ">f8", "<c8", "|b1"]


def _rows(dtype: str, shape: tuple[int, ...], n: int = 6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, *shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    raw[: n // 2] //= 16  # some rows compress well, some not at all
    out = raw.view(dtype).reshape(n, *shape)
    return (out != 0) if dtype == "|b1" else out  # bool: only 0 and 1 are bools


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["zstd", "zstd:19", "lz4", "delta", "delta:4"])
def test_lossless_codecs_round_trip_every_dtype_bit_exact(codec, dtype):
    c = Codec.of(codec)
    for shape in [(), (5,), (3, 7)]:
        rows = _rows(dtype, shape)
        got = decode(c, list(encode(c, rows)), dtype, shape)
        assert got.dtype == np.dtype(dtype) and got.shape == rows.shape
        assert got.tobytes() == rows.tobytes()  # bit for bit: NaN payloads, -0.0 too


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_ragged_rows_round_trip(codec):
    c = Codec.of(codec)
    rows = [np.arange(k * 3, dtype="<i4").reshape(k, 3) for k in (0, 1, 5, 1000)]
    got = decode(c, list(encode(c, rows, threads=2)), "<i4", (None, 3))
    assert [g.shape for g in got] == [(0, 3), (1, 3), (5, 3), (1000, 3)]
    for a, b in zip(rows, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "shape", [(84, 84, 3), (84, 84), (84, 84, 1), (4, 84, 84), (8, 8, 4), (17,)]
)
@pytest.mark.parametrize("codec", ["png", "png:1", "png:9"])
def test_png_is_lossless_for_uint8_images_and_stacks(codec, shape):
    rows = _rows("|u1", shape, n=40)
    frames = encode(Codec.of(codec), rows, threads=2)  # two threads: rows split between them
    got = decode(Codec.of(codec), list(frames), "|u1", shape, threads=2)
    assert got.tobytes() == rows.tobytes()
    # a standard PNG: any image library reads it
    Image.open(io.BytesIO(frames[0])).verify()


@pytest.mark.parametrize(
    ("shape", "mode"), [((9, 7, 3), "RGB"), ((9, 7, 4), "RGBA"), ((9, 7), "L")]
)
def test_png_written_by_another_library_decodes_exactly(shape, mode):
    """A producer's own PNG (Pillow: its filters, its chunks) reads back as its pixels."""
    rows = _rows("|u1", shape, n=4)
    frames = []
    for row in rows:
        out = io.BytesIO()
        Image.fromarray(row, mode).save(out, "PNG", optimize=True)
        frames.append(out.getvalue())
    got = decode(Codec.of("png"), frames, "|u1", shape)
    assert got.tobytes() == rows.tobytes()


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(png):
        n = int.from_bytes(png[pos : pos + 4], "big")
        out.append((png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]))
        pos += 12 + n
    return out


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(
        len(d).to_bytes(4, "big") + k + d + zlib.crc32(k + d).to_bytes(4, "big") for k, d in chunks
    )
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.mark.parametrize("shape", [(12, 10, 3), (12, 10, 4), (12, 10)])
def test_unfiltered_png_inflated_by_zlib_is_what_libpng_reads(shape):
    """Unfiltered rows (what ``encode`` writes) skip libpng; anything else is libpng's:
    filtered rows, IDAT split in several chunks, extra chunks, a wrong CRC (refused)."""
    rows = _rows("|u1", shape, n=3)
    png = Codec.of("png")
    mine = [bytes(f) for f in encode(png, rows)]
    assert decode(png, mine, "|u1", shape).tobytes() == rows.tobytes()
    head, data = _chunks(mine[0])[0], _chunks(mine[0])[1][1]
    split = _png(
        [head, (b"tEXt", b"a\0b"), (b"IDAT", data[:5]), (b"IDAT", data[5:]), (b"IEND", b"")]
    )
    assert decode(png, [split], "|u1", shape).tobytes() == rows[0].tobytes()
    bad = bytearray(mine[0])
    bad[-20] ^= 1  # inside IDAT: its CRC no longer matches
    with pytest.raises(CodecError):
        decode(png, [bytes(bad)], "|u1", shape)
    # a zlib stream cut short or with its Adler-32 wrong, under valid chunk CRCs: refused
    for body in (data[:-6], data[:-1] + bytes([data[-1] ^ 1])):
        with pytest.raises(CodecError):
            decode(png, [_png([head, (b"IDAT", body), (b"IEND", b"")])], "|u1", shape)
    if len(shape) == 2:  # adaptive filters (OpenCV's default): libpng undoes them
        ok, f = cv2.imencode(".png", rows[1])
        assert ok and decode(png, [f.tobytes()], "|u1", shape).tobytes() == rows[1].tobytes()


@pytest.mark.parametrize("codec", ["png", "zstd"])
def test_empty_frames_read_as_zeros_among_decoded_ones(codec):
    """A batch's rows are written in place: an empty or None frame's row is zeros."""
    rows = _rows("|u1", (12, 10, 3), n=4)
    c = Codec.of(codec)
    frames: list = [bytes(f) for f in encode(c, rows)]
    frames[1], frames[3] = b"", None
    got = decode(c, frames, "|u1", (12, 10, 3))
    assert not got[1].any() and not got[3].any()
    assert got[[0, 2]].tobytes() == rows[[0, 2]].tobytes()


def test_png_of_another_size_is_refused():
    """A frame as ``encode`` writes it but of another image size or mode: not the field's."""
    png = Codec.of("png")
    for shape in ((10, 12, 3), (12, 10)):
        frame = bytes(encode(png, _rows("|u1", shape, n=1))[0])
        with pytest.raises(CodecError, match="the field holds RGB 10x12"):
            decode(png, [frame], "|u1", (12, 10, 3))


@pytest.mark.parametrize(
    ("codec", "shape"), [("jpeg:95", (32, 32, 3)), ("jpeg:90", (32, 32)), ("webp:90", (32, 32, 3))]
)
def test_lossy_codecs_are_close_not_exact(codec, shape):
    y, x = np.mgrid[:32, :32]
    img = ((x * 8 + y * 4) % 256).astype(np.uint8)
    rows = np.stack([img if len(shape) == 2 else np.stack([img, img // 2, 255 - img], -1)] * 3)
    got = decode(Codec.of(codec), list(encode(Codec.of(codec), rows)), "|u1", shape)
    err = np.abs(got.astype(int) - rows).mean()
    assert 0 < err < 8


def test_text_forms_and_refusals():
    assert Codec.of("zstd") == Codec("zstd") and str(Codec.of("ZSTD:9")) == "zstd:9"
    assert Codec.of(None) is None and Codec.of("none") is None
    assert Codec.of("delta").key_every == 16 and Codec.of("delta:4").key_every == 4
    for bad, match in [
        ("jpeg", "lossy: give its quality"),
        ("gzip", "known codecs"),
        ("zstd:30", "outside"),
        ("lz4:3", "takes no parameter"),
        ("png:x", "not an integer"),
        ("delta:1", "outside"),
    ]:
        with pytest.raises(CodecError, match=match):
            Codec.of(bad)
    for spec, match in [
        (FieldSpec("<f4", (8, 8), "png"), "uint8 images, not float32"),
        (FieldSpec("|u1", (None, 8), "png"), "needs a fixed shape"),
        (FieldSpec("|u1", (8, 8, 4), "jpeg:90"), "no alpha"),
        (FieldSpec("|u1", (8, 8), "webp:80"), "RGB"),
        (FieldSpec("<i4", (None,), "delta"), "fixed shape"),
    ]:
        with pytest.raises(SchemaError, match=match):
            Schema(fields={"obs": spec}).check_self()
    with pytest.raises(SchemaError, match="known codecs"):
        FieldSpec("|u1", (3,), "brotli")


def test_schema_persists_codecs_and_raw_rows_fit_them():
    schema = Schema(
        fields={"obs": FieldSpec("|u1", (84, 84, 3), "png"), "action": FieldSpec("<i8", ())}
    )
    again = Schema.from_dict(schema.to_dict())
    assert again == schema and again.codecs == {"obs": Codec("png")}
    assert "codec" not in again.to_dict()["fields"]["action"]
    raw = Schema(fields={"obs": FieldSpec("|u1", (84, 84, 3)), "action": FieldSpec("<i8", ())})
    assert schema.merged(raw) == schema  # raw rows: the worker encodes them
    other = Schema(fields={**raw.fields, "obs": FieldSpec("|u1", (84, 84, 3), "zstd")})
    with pytest.raises(SchemaError, match=r"uint8\[84, 84, 3\] \(zstd\), schema says .*\(png\)"):
        schema.merged(other)


def _zstd_without_size(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


def test_hostile_frames_are_named_before_they_inflate():
    shape, dt = (84, 84, 3), "|u1"
    row = 84 * 84 * 3
    zero = np.zeros(shape, np.uint8)
    zstd = Codec.of("zstd")
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 26))  # 64 MiB of zeros in ~2 KiB
    cases = {
        "declares 67108864 decoded bytes": (zstd, bomb),
        "without its content size": (zstd, _zstd_without_size(zero.tobytes())),
        "not a zstd frame": (zstd, b"\x00" * 32),
        "does not decode": (zstd, encode(zstd, zero[None])[0].tobytes()[:-6]),
    }
    lz4c = Codec.of("lz4")
    good_lz4 = encode(lz4c, zero[None])[0].tobytes()
    cases["lz4 frame: lz4 frame declares"] = (lz4c, (1 << 30).to_bytes(4, "little") + good_lz4[4:])
    cases["shorter than its 4-byte size"] = (lz4c, b"\x01")
    cases["lz4 frame does not decode"] = (lz4c, good_lz4[:4] + b"\xff" * 40)
    png = Codec.of("png")
    big = io.BytesIO()
    Image.new("L", (9000, 9000)).save(big, "PNG")  # an 81 MB image in ~80 KB
    cases["declares 81000000 decoded bytes"] = (png, big.getvalue())
    good_png = encode(png, zero[None])[0].tobytes()
    cases["png frame: png image does not decode"] = (png, good_png[:60])
    cases["not a png image"] = (png, b"GIF89a" + bytes(40))
    delta = Codec.of("delta")
    cases["delta frame without its 9-byte header"] = (delta, b"K")
    cases["needs its key frame"] = (delta, b"D" + bytes(8) + encode(zstd, zero[None])[0].tobytes())
    for want, (codec, frame) in cases.items():
        problem = frame_problem(codec, frame, dt, shape, 1 << 24)
        assert problem is not None and want.split(": ")[-1] in problem, (want, problem)
    assert frame_problem(zstd, encode(zstd, zero[None])[0], dt, shape, 1 << 24) is None
    assert row == 21168
    # ragged: a whole number of items, at most max_bytes
    rag = Codec.of("zstd")
    odd = zstandard.ZstdCompressor().compress(bytes(10))
    assert "multiple of 12" in frame_problem(rag, odd, "<i4", (None, 3), 1 << 20)
    assert "at most 1024" in frame_problem(rag, bomb, "<i4", (None, 3), 1024)
    # and the decoder itself stops at the field's size, whatever the header said
    with pytest.raises(CodecError):
        decode(zstd, [bomb], dt, shape)
