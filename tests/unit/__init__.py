"""Tests of the code alone, laid out like the packages: no redis-server, no worker, no
browser, no network (tests/unit/conftest.py refuses them)."""
