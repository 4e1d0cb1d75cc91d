"""Claw's write path: a step from the producer's process to its committed row in Redis.

The layers, each importing only those above it in this list (``tests/unit/test_layers.py``
checks it; ``orchestrator`` — the read path — sits on top of all of them):

- ``codecs``     byte encodings of payload fields (lz4, zstd, delta, png) and ``CodecError``
- ``settings``   the one reader of ``CLAW_*``: a typed, cached ``Settings``
- ``durations``  one spelling of durations (``5m``, ``7d``)
- ``format``     pure data: array framing, schema, step metadata, columns, the ingest batch
                 and message contract (no Redis)
- ``where``      the filter language, parsed and evaluated over columns
- ``connection`` URL → Redis client; private redis-servers and clusters for tests and demos
- ``store``      the columnar Redis store: layout, Lua commits, reads, updates, eviction
- ``broker``     the Celery app factory, RabbitMQ options, TLS, the beat schedule
- ``worker``     the ``-A`` target: tasks, ingest, the message guard, dead letters,
                 namespace contexts
- ``client``     the SDK: ``Ingestor``, episodes, sending, checks, backpressure, gym wrapper
"""

__all__ = ["__version__"]

__version__ = "0.2.0"
