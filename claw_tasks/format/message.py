"""The ingest task message: its arguments, their version, and the checks a worker makes
before it touches Redis (the sender is not trusted)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from claw_tasks.codecs import CodecError
from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.format.batch import check_batch_id
from claw_tasks.format.names import check_namespace
from claw_tasks.settings import IngestLimits

TASK = "claw_tasks.ingest"
MESSAGE_VERSION = 1  # args: [version, namespace, batch_id, payload, stage_key]


class Rejected(Exception):
    """A message (or its batch) is refused as a whole: dead-lettered under ``code`` with
    ``reason``. ``namespace``/``batch_id`` are set once they were found valid."""

    def __init__(
        self, code: str, reason: str, namespace: str | None = None, batch_id: str | None = None
    ) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason
        self.namespace, self.batch_id = namespace, batch_id
        self.steps = 0  # steps refused, once the batch decoded


@dataclass(frozen=True)
class IngestArgs:
    namespace: str
    batch_id: str
    payload: bytes | None  # inline batch, or
    stage_key: str | None  # the claim check: this batch's staging key in its namespace

    def to_args(self) -> list[Any]:
        return [MESSAGE_VERSION, self.namespace, self.batch_id, self.payload, self.stage_key]


def parse_args(args: Any, kwargs: Any, limits: IngestLimits) -> IngestArgs:
    """Checked arguments of an ingest message; Rejected names what is wrong. A claim check
    may only name the sender namespace's own staging key for this batch id."""
    if not isinstance(args, list | tuple) or not args:
        raise Rejected("args", f"ingest args are {type(args).__name__}, expected a list")
    version = args[0]
    if type(version) is not int or version != MESSAGE_VERSION:
        raise Rejected(
            "version",
            f"ingest message format version {version!r:.40} is not one this worker reads "
            f"({MESSAGE_VERSION}): upgrade the worker or the client",
        )
    if len(args) != 5 or kwargs:
        raise Rejected(
            "args", f"ingest takes 5 positional args, got {len(args)} and {len(kwargs or {})} kw"
        )
    _, namespace, batch_id, payload, stage_key = args
    try:
        if not isinstance(namespace, str):
            raise ValueError(f"namespace is {type(namespace).__name__}")
        check_namespace(namespace)
    except ValueError as e:
        raise Rejected("args", f"namespace {namespace!r:.80}: {e}") from None
    try:
        check_batch_id(batch_id)
    except CodecError as e:
        raise Rejected("args", str(e), namespace) from None
    if (payload is None) == (stage_key is None):
        raise Rejected("args", "exactly one of payload and stage_key must be given", namespace)
    if payload is not None:
        if not isinstance(payload, bytes):
            raise Rejected("args", f"payload is {type(payload).__name__}, not bytes", namespace)
        if len(payload) > limits.message_bytes:
            raise Rejected(
                "size",
                f"payload of {len(payload)} bytes > limit {limits.message_bytes} "
                "(CLAW_MAX_MESSAGE_BYTES)",
                namespace,
                batch_id,
            )
    return IngestArgs(namespace, batch_id, payload, stage_key)


@dataclass
class IngestOutcome:
    """What became of one batch (also stored under the batch's ``done`` key)."""

    batch_id: str
    committed: int = 0
    replayed: int = 0
    expired: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return packb(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> IngestOutcome:
        return cls(**unpackb(data))
