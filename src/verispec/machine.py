"""The CPU under the process, as /proc/cpuinfo names it (records, and keys for measured costs)."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path


def _cpuinfo_field(name: str) -> str | None:
    """The first value of ``name`` in /proc/cpuinfo; None where there is none (or no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_flags_digest() -> str:
    """A short digest of the CPU's feature flags ("" where they cannot be read)."""
    flags = _cpuinfo_field("flags")
    return hashlib.sha256(flags.encode()).hexdigest()[:16] if flags else ""


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size in bytes as Linux reports it (0 when it cannot be read)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [0]
    for folder in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (folder / "size").read_text().strip().upper()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)
