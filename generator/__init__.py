"""looprl generator package."""
