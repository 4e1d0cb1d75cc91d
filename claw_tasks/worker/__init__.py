"""What runs in a Celery worker of the write path: the app (``app``, the ``-A`` target),
the ingest task (``tasks``) and its checks and commit (``ingest``), the message guard that
runs before Celery parses a message (``guard``), dead letters (``deadletter``), the
hardened Redis transport (``transport``), each namespace's state in a process
(``context``, bounded by ``lru``) and the command lines that start Claw's Celery
processes (``command``).
Importing this package builds nothing; importing ``worker.app`` builds the app. May import
every layer below it; the client never imports it."""
