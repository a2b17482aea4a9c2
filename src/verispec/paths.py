"""Where verispec keeps downloaded and converted models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$VERISPEC_CACHE``, else ``$XDG_CACHE_HOME/verispec``, else ``~/.cache/verispec``."""
    if env := os.environ.get("VERISPEC_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "verispec"
