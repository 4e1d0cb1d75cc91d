"""Settings helpers: URLs are printed without their password."""

from __future__ import annotations


def test_urls_are_printed_without_their_password() -> None:
    from claw_tasks.settings import redact_url

    assert redact_url("redis://:s3cret@10.0.0.1:6380/2") == "redis://:***@10.0.0.1:6380/2"
    assert redact_url("amqp://claw:s3cret@rabbit/vh") == "amqp://claw:***@rabbit/vh"
    assert redact_url("rediss://u:p%40ss@[::1]:6379/0") == "rediss://u:***@[::1]:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
