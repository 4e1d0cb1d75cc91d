"""A saved buffer's URLs carry no password; loading takes the environment's again."""

from __future__ import annotations

from orchestrator.adapters.urls import with_env_password, without_password


def test_saved_urls_carry_no_password():
    url = "redis://user:s3cret@host:6380/2"
    saved = without_password(url)
    assert "s3cret" not in saved and saved == "redis://user@host:6380/2"
    assert without_password("redis://:s3cret@host/0") == "redis://host/0"
    assert with_env_password(saved, url) == url  # same server: the environment's password
    assert with_env_password(saved, "redis://user:x@other:6380/2") == saved
