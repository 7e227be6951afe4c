"""Puts the in-repo library on sys.path, so jobs run from a plain checkout (e.g. a Ray job's
working_dir) as well as from an installed package."""

import sys
from pathlib import Path

_root = Path(__file__).resolve().parents[1]
for _p in (str(_root / "platform"), str(_root)):  # the library, and serving/
    if _p not in sys.path:
        sys.path.insert(0, _p)
