"""Tests of deploy/: the Slurm script, the Kubernetes manifests and the deployment README."""
