"""API keys as the configuration stores them: the SHA-256 of the key, never the key itself
(`asyncinfer hash-key` prints it; the gateway compares digests)."""

from __future__ import annotations

import hashlib


def hash_key(key: str) -> str:
    """The digest the configuration stores for an API key."""
    return hashlib.sha256(key.encode()).hexdigest()
