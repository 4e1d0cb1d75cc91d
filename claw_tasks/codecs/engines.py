"""Each codec on one row: encode, the decoded size a frame declares (read from its header,
nothing inflated), and a decode bounded by the size the field allows.

zstd frames are standard zstd frames with the content size written (``zstd -d`` reads
them); lz4 frames are lz4 blocks behind a little-endian u32 of the decoded size (python-lz4's
``store_size``); png/jpeg/webp frames are the image files (png through OpenCV, or
zlib alone for the unfiltered rows this codec writes; jpeg and webp through Pillow). All of
them release the GIL while they work, so rows decode in threads side by side.
"""

from __future__ import annotations

import io
import struct
import threading
import zlib
from typing import Any

import cv2
import lz4.block
import numpy as np
import zstandard
from PIL import Image

from claw_tasks.codecs.errors import CodecError, lz4_inflate
from claw_tasks.codecs.spec import Codec, image_layout

try:  # zlib-ng inflates these frames ~2x faster than zlib; the same API and checks
    from zlib_ng import zlib_ng as _zlib
except ImportError:  # pragma: no cover
    _zlib = zlib  # type: ignore[assignment]  # zlib stands in for zlib_ng: the same API

_PIL_FORMAT = {"jpeg": "JPEG", "webp": "WEBP"}
_RGB = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION  # the pixels as stored
# Rows written unfiltered: a reader then only inflates them, ~2x faster than undoing the
# adaptive filters (mostly Paeth) libpng picks by default, and rendered frames of flat
# colour (Atari) come out smaller too (Pong 436 vs 564 bytes); smooth natural images come
# out ~20 % larger (docs/benchmarks.md, "Fill loop with decoding").
_PNG_NO_FILTER = (cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_NONE)
_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IHDR = struct.Struct(">8sI4sIIBBBBB")  # signature, then IHDR: length, type, w, h, depth, ...
_CHUNK = struct.Struct(">I4s")  # a chunk's length and type
_CRC = struct.Struct(">I")
_IEND = b"\0\0\0\0IEND\xaeB`\x82"  # the empty IEND chunk with its CRC
_COLOUR = {"L": 0, "RGB": 2, "RGBA": 6}  # IHDR colour type of each mode


def _inflate(data: Any, size: int) -> Any:
    """A zlib stream of exactly ``size`` bytes inflated (None: it is not one), bounded by
    ``size`` whatever the stream holds."""
    z = _zlib.decompressobj()
    try:
        raw = z.decompress(data, size + 1)
    except _zlib.error:
        return None
    return raw if len(raw) == size and z.eof and not z.unused_data else None


def _raw(row: np.ndarray) -> Any:
    """A row's bytes without a copy (an empty row: b"")."""
    return np.ascontiguousarray(row).data.cast("B") if row.size else b""


class Engine:
    """The row-level operations of one codec (stateless but for cached contexts)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def encode(self, row: np.ndarray) -> bytes:
        raise NotImplementedError

    def declared(self, frame: bytes | memoryview) -> int:
        """Decoded bytes the frame's header declares; CodecError when it has none."""
        raise NotImplementedError

    def decode(self, frame: bytes | memoryview, nbytes: int, shape: tuple[int, ...]) -> Any:
        """The row's bytes (or a uint8 array), exactly ``nbytes`` long: a frame that
        would inflate past it stops there with a CodecError."""
        raise NotImplementedError

    def decode_into(
        self, frame: bytes | memoryview, out: np.ndarray, shape: tuple[int, ...]
    ) -> None:
        """:meth:`decode` into ``out`` (uint8, C-contiguous, of the row's bytes)."""
        out[:] = np.frombuffer(self.decode(frame, out.size, shape), np.uint8)


class Zstd(Engine):
    def __init__(self, codec: Codec) -> None:
        super().__init__(codec)
        self._c = zstandard.ZstdCompressor(level=codec.level, write_content_size=True)
        self._d = zstandard.ZstdDecompressor()

    def encode(self, row: np.ndarray) -> bytes:
        return self._c.compress(_raw(row))

    def declared(self, frame: bytes | memoryview) -> int:
        try:
            size = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise CodecError(f"not a zstd frame: {e}") from None
        if size < 0:
            raise CodecError("zstd frame without its content size")
        return size

    def decode(self, frame: bytes | memoryview, nbytes: int, shape: tuple[int, ...]) -> Any:
        try:
            out = self._d.decompress(frame, max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd frame does not decode: {e}") from None
        if len(out) != nbytes:
            raise CodecError(f"zstd frame decodes to {len(out)} bytes, not {nbytes}")
        return out


class Lz4(Engine):
    def encode(self, row: np.ndarray) -> bytes:
        return lz4.block.compress(_raw(row), store_size=True)

    def declared(self, frame: bytes | memoryview) -> int:
        if len(frame) < 4:
            raise CodecError("lz4 frame shorter than its 4-byte size")
        return int.from_bytes(bytes(frame[:4]), "little")

    def decode(self, frame: bytes | memoryview, nbytes: int, shape: tuple[int, ...]) -> Any:
        if self.declared(frame) != nbytes:
            raise CodecError(f"lz4 frame declares {self.declared(frame)} bytes, not {nbytes}")
        return lz4_inflate(frame, nbytes)


class Png(Engine):
    """Lossless PNG through OpenCV (faster than Pillow here, and it releases the GIL); the
    header is read by hand (signature, IHDR), so a frame is sized before any decoder sees
    it. Colour rows are stored RGB(A), as any PNG reader expects."""

    _MODES = {v: k for k, v in _COLOUR.items()}  # IHDR colour types this codec writes

    def __init__(self, codec: Codec) -> None:
        super().__init__(codec)
        self._layouts: dict[tuple[int, ...], tuple[str, tuple[int, int]]] = {}
        self._plain: dict[tuple[int, ...], tuple[bytes, int, int, int]] = {}

    def encode(self, row: np.ndarray) -> bytes:
        mode, (w, h) = image_layout(row.shape)
        img = np.ascontiguousarray(row).reshape(h, w, -1)
        if mode == "RGB":
            img = img[..., ::-1]
        elif mode == "RGBA":
            img = cv2.cvtColor(img, cv2.COLOR_RGBA2BGRA)
        ok, out = cv2.imencode(
            ".png", img, [*_PNG_NO_FILTER, cv2.IMWRITE_PNG_COMPRESSION, self.codec.level]
        )
        if not ok:
            raise CodecError("png: OpenCV could not encode the row")
        return out.tobytes()

    def header(self, frame: bytes | memoryview) -> tuple[str, tuple[int, int], bool]:
        """(mode, (width, height), plain) from the PNG signature and IHDR chunk; ``plain``:
        compression, filter method and interlace all 0 (what :meth:`encode` writes)."""
        if len(frame) < _IHDR.size:
            raise CodecError("not a png image (no PNG signature and IHDR chunk)")
        sig, _, kind, w, h, depth, colour, *methods = _IHDR.unpack_from(frame)
        if sig != _PNG_SIGNATURE or kind != b"IHDR":
            raise CodecError("not a png image (no PNG signature and IHDR chunk)")
        if depth != 8 or colour not in self._MODES:
            raise CodecError(
                f"png image of bit depth {depth}, colour type {colour} (8-bit "
                "gray, RGB or RGBA only)"
            )
        return self._MODES[colour], (w, h), not any(methods)

    def declared(self, frame: bytes | memoryview) -> int:
        mode, (w, h), _ = self.header(frame)
        return w * h * _CHANNELS[mode]

    def decode(self, frame: bytes | memoryview, nbytes: int, shape: tuple[int, ...]) -> Any:
        out = np.empty(nbytes, np.uint8)
        self.decode_into(frame, out, shape)
        return out

    def decode_into(
        self, frame: bytes | memoryview, out: np.ndarray, shape: tuple[int, ...]
    ) -> None:
        plain = self._plain.get(shape)
        if plain is None:
            plain = self._plain[shape] = self._plain_layout(shape)
        head, height, row, nbytes = plain
        mv = memoryview(frame).cast("B")
        n = len(mv)
        # What encode writes: the signature and this shape's IHDR chunk (its CRC included),
        # one IDAT chunk, IEND. Its IDAT's CRC and zlib stream checked, every row's filter
        # byte 0: the rest of the pixels are those of the row; anything else takes the
        # general path below (which says what is wrong, or decodes it).
        if (
            n > 57
            and out.size == nbytes
            and mv[:33] == head
            and mv[n - 12 :] == _IEND
            and _CHUNK.unpack_from(mv, 33) == (n - 57, b"IDAT")
            and zlib.crc32(mv[37 : n - 16]) == _CRC.unpack_from(mv, n - 16)[0]
        ):
            raw = _inflate(mv[41 : n - 16], height * (row + 1))
            if raw is not None and raw[:: row + 1].count(0) == height:
                out.reshape(height, row)[...] = np.ndarray(
                    (height, row), np.uint8, raw, 1, (row + 1, 1)
                )
                return
        mode, size, plain_methods = self.header(frame)
        want = self._layouts.get(shape)
        if want is None:
            want = self._layouts[shape] = image_layout(shape)
        if (mode, size) != want:
            raise CodecError(
                f"png image is {mode} {size[0]}x{size[1]}, the field holds "
                f"{want[0]} {want[1][0]}x{want[1][1]}"
            )
        if plain_methods and self._unfiltered(frame, out, size[1]):
            return
        # RGB decoded as RGB by libpng itself: flipping BGR afterwards cost as much again.
        flags = _RGB if mode == "RGB" else cv2.IMREAD_UNCHANGED
        img = cv2.imdecode(np.frombuffer(frame, np.uint8), flags)
        if img is None or img.size != out.size or img.dtype != np.uint8:
            raise CodecError("png image does not decode")
        if mode == "RGBA":
            img = cv2.cvtColor(img, cv2.COLOR_BGRA2RGBA)
        out[:] = img.reshape(-1)

    @staticmethod
    def _plain_layout(shape: tuple[int, ...]) -> tuple[bytes, int, int, int]:
        """The first 33 bytes of a frame of ``shape`` as :meth:`encode` writes it
        (signature, IHDR chunk), its height, the bytes of a row, of the image."""
        mode, (w, h) = image_layout(shape)
        ihdr = struct.pack(">4sIIBBBBB", b"IHDR", w, h, 8, _COLOUR[mode], 0, 0, 0)
        head = _PNG_SIGNATURE + _CRC.pack(13) + ihdr + _CRC.pack(zlib.crc32(ihdr))
        row = w * _CHANNELS[mode]
        return head, h, row, h * row

    def _unfiltered(self, frame: bytes | memoryview, out: np.ndarray, height: int) -> bool:
        """Into ``out``, the pixels of a png as :meth:`encode` writes it (every row of
        filter type 0: its pixels as they are, RGB(A) in order) inflated alone, ~5 µs a
        frame less than libpng's per-image setup; each chunk's CRC and the zlib stream
        (its Adler-32, its end) are checked as libpng checks them. False for any other
        png (libpng decodes it, or says why not)."""
        frame = memoryview(frame).cast("B")
        idat: list[memoryview] = []
        pos, size, end = 8, len(frame), False
        while not end and pos + 12 <= size:
            n, kind = _CHUNK.unpack_from(frame, pos)
            stop = pos + 12 + n
            if stop > size:
                return False
            if zlib.crc32(frame[pos + 4 : stop - 4]) != _CRC.unpack_from(frame, stop - 4)[0]:
                return False
            if kind == b"IDAT":
                idat.append(frame[pos + 8 : stop - 4])
            elif kind == b"IEND":
                end = True
            elif kind not in (b"IHDR", b"PLTE") and not kind[0] & 0x20:  # unknown critical
                return False
            pos = stop
        if not end or not idat or not height:
            return False
        row = len(out) // height
        want = height * (row + 1)
        if row * height != len(out):
            return False
        raw = _inflate(idat[0] if len(idat) == 1 else b"".join(idat), want)
        if raw is None or raw[:: row + 1].count(0) != height:  # a filtered row: libpng's
            return False
        # the pixels without each row's filter byte: one strided view (np.copyto cost ~2 µs more)
        out.reshape(height, row)[...] = np.ndarray((height, row), np.uint8, raw, 1, (row + 1, 1))
        return True


class Picture(Engine):
    """jpeg and webp (lossy, with a quality) through Pillow."""

    def encode(self, row: np.ndarray) -> bytes:
        mode, (w, h) = image_layout(row.shape)
        row = np.ascontiguousarray(row)
        img = Image.fromarray(row.reshape(h, w) if mode == "L" else row.reshape(h, w, -1), mode)
        out = io.BytesIO()
        c = self.codec
        if c.name == "jpeg":
            img.save(out, "JPEG", quality=c.param, subsampling=0 if c.param >= 90 else 2)
        else:
            img.save(out, "WEBP", quality=c.param, method=4)
        return out.getvalue()

    def _open(self, frame: bytes | memoryview) -> Image.Image:
        try:
            img = Image.open(io.BytesIO(frame), formats=[_PIL_FORMAT[self.codec.name]])
        except Exception as e:  # Pillow raises several types for a malformed header
            raise CodecError(f"not a {self.codec.name} image: {type(e).__name__}: {e}") from None
        if img.mode not in _CHANNELS:
            raise CodecError(f"{self.codec.name} image of mode {img.mode} (L, RGB or RGBA only)")
        return img

    def declared(self, frame: bytes | memoryview) -> int:
        img = self._open(frame)
        w, h = img.size
        return w * h * _CHANNELS[img.mode]

    def decode(self, frame: bytes | memoryview, nbytes: int, shape: tuple[int, ...]) -> Any:
        img = self._open(frame)
        mode, size = image_layout(shape)
        if img.size != size or img.mode != mode:
            raise CodecError(
                f"{self.codec.name} image is {img.mode} {img.size[0]}x{img.size[1]}, the field "
                f"holds {mode} {size[0]}x{size[1]}"
            )
        try:
            arr = np.asarray(img)
        except Exception as e:  # a truncated or corrupt body
            raise CodecError(f"{self.codec.name} image does not decode: {e}") from None
        return arr.reshape(-1)


_local = threading.local()


def engine_for(codec: Codec) -> Engine:
    """This thread's engine of ``codec`` (cached: zstandard's contexts are not thread safe)."""
    cache = getattr(_local, "engines", None)
    if cache is None:
        cache = _local.engines = {}
    eng = cache.get(codec)
    if eng is None:
        eng = cache[codec] = engine(codec)
    return eng


def engine(codec: Codec) -> Engine:
    if codec.name in ("zstd", "delta"):
        return Zstd(codec)
    if codec.name == "lz4":
        return Lz4(codec)
    if codec.name == "png":
        return Png(codec)
    return Picture(codec)
