"""`helm lint --strict` on the default values and on every values file in tests/chart/values/."""
from __future__ import annotations

from pathlib import Path

import pytest
from chart_support import CHART, NAMESPACE, VALUES_FILES, helm


def test_there_are_values_files_to_test() -> None:
    names = {f.stem for f in VALUES_FILES}
    assert {"cluster-wide", "namespaced", "monitoring", "worker-defaults"} <= names


@pytest.mark.parametrize("values_file", [None, *VALUES_FILES], ids=lambda f: f.stem if f else "defaults")
def test_helm_lint_strict(helm_bin: str, values_file: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values_file is not None:
        args += ["--values", str(values_file)]
    proc = helm(helm_bin, *args, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "[WARNING]" not in output and "[ERROR]" not in output, output
