"""The run config: ``RunConfig`` and its loader (`run.py`: it composes every component's config
as it is, and checks the rules that span sections), the pipeline's own sections (`sections.py`:
task, rollout, staleness, intake, generators, ...) and its output sections (`outputs.py`:
publish, checkpoint, record, metrics)."""
