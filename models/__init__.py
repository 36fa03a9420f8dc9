"""looprl models package."""
