"""The code base stays clean under ruff (the version pinned in pyproject.toml's dev extras)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "operator", "worker", "bench", "tests", "scripts"],
                          cwd=REPO, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
