"""Durable file helpers shared by every writer (stream segments, checkpoints, weights)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory: so that its new or renamed entries last)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
