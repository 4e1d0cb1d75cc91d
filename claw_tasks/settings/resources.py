"""Per-process resources: workers' caches, the shared sampling index, the trainer's
read-ahead, and who encodes compressed fields on how many threads."""

from __future__ import annotations

from .variable import Variable, at_least_one, compress_at, count, flag

RESOURCES: tuple[Variable, ...] = (
    Variable(
        "CLAW_NAMESPACE_CACHE_SIZE",
        "namespace_cache_size",
        count,
        64,
        "namespaces a process keeps a context for: its `Store`, sampling session, plans, "
        "retrieval sessions (up to 8 indexes' vectors each), vector writers (least recently "
        "used go first; `CLAW_WORKER_CACHE_BYTES` bounds their bytes)",
    ),
    Variable(
        "CLAW_WORKER_CACHE_BYTES",
        "worker_cache_bytes",
        count,
        768 << 20,
        "bytes of namespace contexts (indexes, vectors, plans) a process keeps; past it the "
        "least recently used contexts are let go, the one in use always kept "
        "(docs/reliability.md, Worker memory)",
        shown="`805306368` (768 MiB)",
    ),
    Variable(
        "CLAW_NEAREST_MAX_K",
        "nearest_max_k",
        at_least_one,
        1024,
        "neighbours a `nearest` query may ask for per state (`k` of the API, `claw nearest "
        "--k` and a recipe's `nearest.k`); a larger `k` is refused",
    ),
    Variable(
        "CLAW_PLAN_CACHE_SIZE",
        "plan_cache_size",
        count,
        256,
        "recipes' augmentation plans a prefetch worker keeps per namespace, so up to this x "
        "`CLAW_NAMESPACE_CACHE_SIZE` in all (least recently used go first)",
    ),
    Variable(
        "CLAW_SHARED_INDEX",
        "shared_index",
        flag,
        True,
        "prefetch processes of a host share one sampling index per namespace in `/dev/shm`; "
        "`0`: each builds its own (docs/architecture.md, Sampling index)",
    ),
    Variable(
        "CLAW_READAHEAD",
        "readahead",
        count,
        0,
        "batches of each recipe a `BatchClient` keeps popped and decoded in the trainer's "
        "process, so `pop` is a local dequeue (`0`: none; the replay-buffer adapters size "
        "their own)",
    ),
    Variable(
        "CLAW_READAHEAD_PROCESS",
        "readahead_process",
        flag,
        True,
        "the replay-buffer adapters read ahead from a child process (its pops, refill "
        "requests and lineage writes never take the trainer's GIL; `0`: from a thread)",
    ),
    Variable(
        "CLAW_INDEX_PAYLOAD_BYTES",
        "index_payload_bytes",
        count,
        64,
        "raw fixed-shape fields of at most this many bytes a row are kept in the sampling "
        "index as well, so a batch of them reads no payload from Redis (`0`: none)",
    ),
    Variable(
        "CLAW_COMPRESS_AT",
        "compress_at",
        compress_at,
        "producer",
        "who encodes compressed fields: the `Ingestor` (`producer`: less to send) or the "
        "ingest workers (`worker`: spares busy producer CPUs)",
    ),
    Variable(
        "CLAW_CODEC_THREADS",
        "codec_threads",
        at_least_one,
        1,
        "threads a process encodes or decodes one batch's compressed frames in",
    ),
)
