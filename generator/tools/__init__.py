"""Tools a multi-turn environment may let the model call (docs/REWARDS.md "Tools and remote
rewards"): :func:`generator.tools.calculator.calculate`, safe exact arithmetic."""
