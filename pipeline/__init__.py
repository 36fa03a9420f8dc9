"""looprl pipeline package."""
