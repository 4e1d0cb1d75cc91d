"""What a saved buffer keeps of its Redis and broker URLs: never a password (it comes from
the environment again on load)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def without_password(url: str | None) -> str | None:
    """``url`` with its password removed (what a saved buffer may keep)."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = (parts.username or "") + "@" + parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc if parts.username else netloc[1:]))


def with_env_password(url: str | None, env_url: str) -> str | None:
    """A saved ``url`` again, with the environment's password when it names the same
    server (the password never travels in a saved buffer)."""
    if url is None or without_password(env_url) != url:
        return url
    return env_url
