"""Tests never skip for a missing module of this project: a module that moved or broke must make
its tests fail, not skip them (``pytest.importorskip`` is for third-party packages only)."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
OWN = ("moe_plugins", "prepare_finalize", "all2all", "tests")
SKIP = re.compile(r"importorskip\(\s*['\"]([\w.]+)['\"]")


def test_no_test_importorskips_a_module_of_this_project():
    found = [f"{path.relative_to(TESTS)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}"
             for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__).resolve()
             for text in [path.read_text()] for m in SKIP.finditer(text)
             if m.group(1).split(".")[0] in OWN]
    assert not found, "import these instead (a moved module must fail, not skip): " + \
        "; ".join(found)
