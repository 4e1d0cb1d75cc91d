"""Helpers the tests share (data builders, hostile producers, servers they start); no test
modules here."""
