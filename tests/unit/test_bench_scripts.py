"""Every benchmark and job script can find what it imports when run as the README runs it
(`python bench/X.py`, `python jobs/X.py`: the script's own folder is first on sys.path), without a
PYTHONPATH set by hand. Checked from the source, without importing the heavy modules themselves."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("jobs/*.py")])
# scripts that run in another tool's own venv (made by the bench that calls them) and the packages it brings
OWN_VENV = {"vllm_run.py": {"vllm"}, "speculators_check.py": {"speculators"}}


def _imports(path: Path) -> set[str]:
    """The absolute module names a script imports at module level (top-level statements only)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.add(node.module)
    return names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_script_finds_its_module_level_imports(script, monkeypatch):
    # as `python SCRIPT` runs it: its folder first, and not the working directory `python -m pytest` adds
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    monkeypatch.setattr(sys, "path", [str(script.parent), *elsewhere])
    top = {name.split(".")[0] for name in _imports(script)} - OWN_VENV.get(script.name, set())
    missing = [name for name in sorted(top) if importlib.util.find_spec(name) is None]
    assert not missing, f"{script.relative_to(ROOT)} imports {missing}, which running it cannot find"
