"""looprl learner package."""
