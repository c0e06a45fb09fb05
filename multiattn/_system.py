"""What the operating system says about the machine (framework-free)."""

from __future__ import annotations

import os

__all__ = ["available_memory"]


def available_memory() -> int | None:
    """Bytes the operating system reports available (``MemAvailable`` of
    ``/proc/meminfo``; else free pages by ``sysconf``); None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
