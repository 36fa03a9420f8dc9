"""deploy/k8s/ against the Kubernetes OpenAPI schema, offline (kubernetes-validate bundles the
schemas): every object of every file validates strictly (unknown fields refused) at the oldest
and the newest Kubernetes version the package knows, and a broken copy of each kind fails, so
the check is not vacuous."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate as kv  # the dev extra (scripts/setup.sh installs it)
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OLDEST, NEWEST = "1.25.0", kv.latest_version()


def objects() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def test_the_manifests_hold_what_a_cluster_needs() -> None:
    kinds = sorted(d["kind"] for _, d in objects())
    assert kinds == ["Deployment", "Secret", "Secret", "Service", "StatefulSet"], kinds
    (learner,) = [d for _, d in objects() if d["kind"] == "StatefulSet"]
    (c,) = learner["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["exec"]["command"]  # ready once endpoints.json is written


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_object_validates_strictly(version: str) -> None:
    for name, doc in objects():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:  # name the object and the failing path
            pytest.fail(f"{name} at Kubernetes {version}: {e.message} (at {list(e.path)})")


def _breaks(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies of ``doc`` a cluster would refuse: an unknown field, a wrong type."""
    unknown, wrong = copy.deepcopy(doc), copy.deepcopy(doc)
    if doc["kind"] == "Secret":
        unknown["stringDataa"] = unknown.pop("stringData", {})
        wrong["type"] = 7
    elif doc["kind"] == "Service":
        unknown["spec"]["portz"] = unknown["spec"].pop("ports")
        wrong["spec"]["ports"][0]["port"] = "twenty-nine thousand"
    else:
        pod = unknown["spec"]["template"]["spec"]
        pod["containers"][0]["imagee"] = pod["containers"][0].pop("image")
        wrong["spec"]["replicas"] = "one"
    return [unknown, wrong]


def test_a_broken_copy_of_each_object_is_refused() -> None:
    for name, doc in objects():
        for bad in _breaks(doc):
            with pytest.raises(kv.ValidationError):
                kv.validate(bad, NEWEST, strict=True)
                pytest.fail(f"{name}: a broken copy validated")
