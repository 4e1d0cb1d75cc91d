"""Login for the inspector: one user whose password is kept only as a scrypt hash, and
server-side sessions (a random cookie token, a CSRF token per session)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from claw_tasks.settings import Settings, get_settings

SESSION_TTL_S = 12 * 3600
_N, _R, _P = 2**14, 8, 1  # scrypt cost: ~50 ms, 16 MiB per check


def hash_password(password: str, salt: bytes | None = None) -> str:
    """``scrypt$<salt hex>$<hash hex>``: what the password file may hold instead of it."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_N, r=_R, p=_P, dklen=32)
    return f"scrypt${salt.hex()}${digest.hex()}"


def verify_password(password: str, hashed: str) -> bool:
    try:
        scheme, salt, digest = hashed.split("$")
        if scheme != "scrypt":
            return False
        got = hashlib.scrypt(
            password.encode(), salt=bytes.fromhex(salt), n=_N, r=_R, p=_P, dklen=32
        )
    except ValueError:
        return False
    return hmac.compare_digest(got.hex(), digest)


@dataclass(frozen=True)
class Credentials:
    user: str
    password_hash: str

    def check(self, user: str, password: str) -> bool:
        ok_user = hmac.compare_digest(user.encode(), self.user.encode())
        return verify_password(password, self.password_hash) and ok_user


def load_credentials(
    password_file: str | Path | None = None, settings: Settings | None = None
) -> tuple[Credentials, str | None]:
    """The login from ``CLAW_WEB_USER`` (default ``claw``) and ``CLAW_WEB_PASSWORD``, or a
    password file (``--password-file`` / ``CLAW_WEB_PASSWORD_FILE``: the password, or a
    ``scrypt$…`` line from :func:`hash_password`). With neither, a random password is made;
    it is returned (second item) so the caller prints it once. Only the hash is kept."""
    settings = settings or get_settings()
    user = settings.web_user
    path = password_file or settings.web_password_file
    if path:
        text = Path(path).read_text().strip()
        if not text:
            raise ValueError(f"password file {path} is empty: write a password or a scrypt$ hash")
        hashed = text if text.startswith("scrypt$") else hash_password(text)
        return Credentials(user, hashed), None
    if settings.web_password:
        return Credentials(user, hash_password(settings.web_password)), None
    generated = secrets.token_urlsafe(18)
    return Credentials(user, hash_password(generated)), generated


@dataclass
class Session:
    user: str
    csrf: str
    expires: float


class Sessions:
    """Live sessions by cookie token (in memory: a restart logs everyone out). Kept by the
    token's sha256, so finding one compares digests, never the secret itself."""

    def __init__(self, ttl: float = SESSION_TTL_S) -> None:
        self.ttl = ttl
        self._items: dict[bytes, Session] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(token: str) -> bytes:
        return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()

    def new(self, user: str) -> tuple[str, Session]:
        token = secrets.token_urlsafe(32)
        session = Session(user, secrets.token_urlsafe(32), time.time() + self.ttl)
        with self._lock:
            now = time.time()
            for t in [t for t, s in self._items.items() if s.expires < now]:
                del self._items[t]
            self._items[self._key(token)] = session
        return token, session

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        key = self._key(token)
        with self._lock:
            session = self._items.get(key)
            if session is None or session.expires < time.time():
                self._items.pop(key, None)
                return None
            return session

    def end(self, token: str | None) -> None:
        with self._lock:
            self._items.pop(self._key(token or ""), None)
