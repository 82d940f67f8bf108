"""pytest-benchmark micro-benchmarks. Run with ``make bench`` (1 and 4 devices).

Each group holds the alternatives to compare; read ratios within a group, measured in
the same run. ``compare.py`` prints the same comparisons as ratios directly."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from common import demo_model  # noqa: E402


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return demo_model(str(tmp_path_factory.mktemp("bench")))
