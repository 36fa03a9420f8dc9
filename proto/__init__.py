"""looprl proto package."""
