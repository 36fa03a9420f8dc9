"""The one error type that leaves proto/ when a message cannot be accepted."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A wire message is malformed, oversized, of an incompatible version or invalid.

    The message always says what was wrong and what was expected. Receivers catch it,
    count the rejection, reply with an error record where they can, and keep serving.
    """
