"""The coordinator's core: dispatch, intake and the door, the ledger, staleness, recording, resume, evaluation rounds, metrics, tasks."""
