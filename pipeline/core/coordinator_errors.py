"""The coordinator's errors: raised by it and its components (pipeline.core.announcing)."""

from __future__ import annotations


class CoordinatorError(RuntimeError):
    """The run cannot go on (no progress for max_wait_s, non-finite weights)."""


class NonFinitePublication(CoordinatorError):
    """The trainer's weights hold NaN or inf: they were not published."""
