"""tests/api: the RLJob API (models, cross-field validation, CRD, CEL, CLI).

Shared helpers live in api_support.py next to this file (put on sys.path here, because the
suite runs with --import-mode=importlib, where test modules cannot import their siblings).
"""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
