"""The known-fault catalog (tests/faults/catalog.py) still fits the tree: each fault's text
occurs exactly once where it points and its tests exist, so `python -m tests.faults.run` applies
every fault it lists (the runner's results are recorded in tests/faults/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.catalog import FAULTS

ROOT = Path(__file__).resolve().parents[1]


def test_names_are_unique():
    names = [f.name for f in FAULTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_applies_once_and_names_existing_tests(fault):
    text = (ROOT / fault.path).read_text()
    assert text.count(fault.old) == 1, "the fault's site moved: rewrite its entry"
    assert fault.new != fault.old
    assert fault.tests
    for node in fault.tests:
        path, _, func = node.partition("::")
        src = (ROOT / path).read_text()
        assert not func or f"def {func}(" in src, node
