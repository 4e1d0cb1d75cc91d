"""A learner's weights through Redis, for its actors: raw arrays with dtype and shape.

One key per namespace holds the newest ``version`` and its arrays, packed for msgpack by
:mod:`claw_tasks.format.arrays` (never pickle, so never ``torch.save``); actors poll the version,
a small GET, and read the arrays only when it changed. What an actor reads is checked
against its own network (names, dtypes, shapes) before it is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import redis

from claw_tasks.codecs import CodecError
from claw_tasks.format.arrays import pack_array, packb, unpack_array, unpackb
from claw_tasks.store import owned_key


class WeightsError(ValueError):
    """Published weights that do not fit the reader's network."""


def weights_key(namespace: str) -> str:
    """Inside the namespace's keys: removing the namespace removes the weights too."""
    return owned_key(namespace, "demo:weights")


def version_key(namespace: str) -> str:
    return owned_key(namespace, "demo:weights-version")


def publish(r: redis.Redis, namespace: str, version: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Store ``arrays`` as ``version`` (the blob first, then the version readers poll)."""
    blob = packb({"version": version, "arrays": {k: pack_array(v) for k, v in arrays.items()}})
    with r.pipeline(transaction=True) as pipe:
        pipe.set(weights_key(namespace), blob)
        pipe.set(version_key(namespace), version)
        pipe.execute()


def latest_version(r: redis.Redis, namespace: str) -> int | None:
    raw = r.get(version_key(namespace))
    return None if raw is None else int(raw)


def fetch(
    r: redis.Redis, namespace: str, expected: Mapping[str, tuple[str, tuple[int, ...]]]
) -> tuple[int, dict[str, np.ndarray]] | None:
    """The newest version and its arrays, checked against ``expected`` (name -> dtype
    string, shape); None when nothing was published yet."""
    raw = r.get(weights_key(namespace))
    if raw is None:
        return None
    try:
        doc = unpackb(raw)
        version, framed = int(doc["version"]), doc["arrays"]
        arrays = {str(k): unpack_array(v) for k, v in framed.items()}
    except (CodecError, KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"malformed weights at {weights_key(namespace)}: {e}") from None
    if set(arrays) != set(expected):
        raise WeightsError(f"weights hold {sorted(arrays)}, the network has {sorted(expected)}")
    for name, (dtype, shape) in expected.items():
        got = arrays[name]
        if got.dtype.str != np.dtype(dtype).str or tuple(got.shape) != tuple(shape):
            raise WeightsError(
                f"weights {name!r}: {got.dtype.str}{list(got.shape)}, the network has "
                f"{np.dtype(dtype).str}{list(shape)}"
            )
    return version, arrays
