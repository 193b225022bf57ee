"""Setup for the benchmark tests.

``bench/`` is not an installed package (``[tool.setuptools.packages.find]`` leaves it
out, as it is not shipped), so the repository root is put on ``sys.path`` here for
``import bench``; scripts run it as ``python -m bench.…`` from the root instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
