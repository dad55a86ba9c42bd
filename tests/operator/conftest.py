"""tests/operator: builders, reconcile, the API-server harness and the real operator over HTTP.

Helpers live next to this file (opschema.py, apiserver.py, cluster.py) and are put on sys.path
here, because the suite runs with --import-mode=importlib.
"""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
