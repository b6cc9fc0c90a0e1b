"""Test-session settings shared by every test (and inherited by the ranks the harness spawns)."""

from __future__ import annotations

import os
import tempfile

# Cost-model profiles are cached per user by default; tests must not read or leave a cache behind.
os.environ.setdefault("THEMIS_CACHE_DIR", tempfile.mkdtemp(prefix="themis-test-cache-"))
