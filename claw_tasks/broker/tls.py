"""TLS for a ``rediss://`` broker: the Celery options from the URL's query."""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qs, urlsplit

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def broker_options(url: str) -> dict[str, Any]:
    """Celery settings for the broker at ``url``: for ``rediss://``, the TLS options
    from the URL's query (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
    ``ssl_cert_reqs`` — the same query redis-py reads for the data store). Certificates are
    verified unless ``ssl_cert_reqs=none``."""
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return {}
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    reqs = query.get("ssl_cert_reqs", "required").lower().removeprefix("cert_")
    if reqs not in _CERT_REQS:
        raise ValueError(
            f"ssl_cert_reqs={reqs!r} in the broker URL: use required, optional or none"
        )
    tls: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[reqs]}
    for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if key in query:
            tls[key] = query[key]
    return {"broker_use_ssl": tls}
