"""Command-line entry points (`looprl <command>`, dispatched by pipeline.cli) and what only they use: the launcher, the learner and replay mains, the console."""
