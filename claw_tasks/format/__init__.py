"""Pure data: what a step, a batch and an ingest message are, with no Redis.

Array framing for msgpack (``arrays``), the namespace schema (``schema``), what metadata
values mean (``stepmeta``), namespace names (``names``), batch columns (``columns``,
``encoded``), the batch itself (``batch``), the task message and its outcome
(``message``), LLM turns as data (``turns``) and multi-agent joint steps (``joint``).
Imports ``codecs``, ``settings`` and ``durations`` only: both the client and the worker stand on it.
"""
