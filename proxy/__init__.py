"""webhook-dedup-proxy: a sidecar reverse proxy that makes each webhook event reach the app once."""

from __future__ import annotations

__version__ = "0.4.0.dev0"  # the one place it is set: pyproject.toml reads it from here
