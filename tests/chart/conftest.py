"""tests/chart: the Helm chart (lint, render, validate, RBAC derived from the operator's code).

Helpers live next to this file (chart_support.py, rbac_needs.py) and are put on sys.path here,
because the suite runs with --import-mode=importlib. helm comes from the `helm_bin` fixture of
tests/conftest.py (a missing helm fails, never skips).
"""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
