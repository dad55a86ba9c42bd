"""The RLJob CRD ships as a template so that upgrades update it, identical to the generated one."""
from __future__ import annotations

import yaml
from chart_support import CHART, REPO, by_kind, one, render

GENERATED = REPO / "crds" / "rljob.dev_rljobs.yaml"
CHART_COPY = CHART / "files" / "crd.yaml"


def test_chart_copy_is_identical_to_the_generated_crd() -> None:
    assert CHART_COPY.read_bytes() == GENERATED.read_bytes(), (
        "charts/rljob-operator/files/crd.yaml differs from crds/rljob.dev_rljobs.yaml: "
        "cp crds/rljob.dev_rljobs.yaml charts/rljob-operator/files/crd.yaml")


def test_rendered_crd_equals_the_generated_one(helm_bin: str) -> None:
    generated = yaml.safe_load(GENERATED.read_text())
    rendered = one(render(helm_bin), "CustomResourceDefinition")
    assert rendered["spec"] == generated["spec"]
    assert (rendered["apiVersion"], rendered["kind"]) == (generated["apiVersion"], generated["kind"])
    assert rendered["metadata"]["name"] == generated["metadata"]["name"]
    meta = rendered["metadata"]
    for key, value in (generated["metadata"].get("labels") or {}).items():
        assert meta["labels"][key] == value, f"label {key} of the generated CRD lost"
    for key, value in (generated["metadata"].get("annotations") or {}).items():
        assert meta["annotations"][key] == value
    assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_crd_is_not_in_the_crds_folder_which_helm_never_upgrades() -> None:
    assert not (CHART / "crds").exists()


def test_crd_toggle(helm_bin: str) -> None:
    assert not by_kind(render(helm_bin, set_values=["crds.install=false"]), "CustomResourceDefinition")
