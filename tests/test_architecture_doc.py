"""docs/architecture.md stays true: every module it names exists, and every module of the package is on the map."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"


def test_every_module_the_map_names_exists():
    named = set(re.findall(r"`(eagle3/[\w/]+\.py)`", DOC.read_text()))
    assert named, "the map names no module"
    assert sorted(p for p in named if not (REPO / p).is_file()) == []


def test_every_module_of_the_package_is_on_the_map():
    named = set(re.findall(r"`(eagle3/[\w/]+\.py)`", DOC.read_text()))
    modules = {str(p.relative_to(REPO)) for p in (REPO / "eagle3").rglob("*.py")
               if p.name != "__init__.py" or p.parent.name == "regenerate"}
    assert sorted(modules - named) == []
