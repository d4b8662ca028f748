"""Imports flow examples → dmuon_fn → custom_ops → torch; the public surface is pinned."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon_fn

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_custom_ops_imports_only_torch():
    assert not _imports("custom_ops") & {"dmuon_fn", "examples", "tests"}


def test_dmuon_fn_does_not_import_examples_or_tests():
    assert not _imports("dmuon_fn") & {"examples", "tests"}


def test_public_api_is_pinned():
    assert sorted(dmuon_fn.__all__) == sorted(
        [
            "PRESETS",
            "CommCounter",
            "Config",
            "FnPlan",
            "State",
            "full_params",
            "init",
            "plan",
            "update",
            "value_and_grad",
            "Muon",
            "dedicate_params",
            "AdamWState",
            "MuonState",
            "NSConfig",
            "Plan",
            "PlanMismatchError",
            "adamw_init",
            "adamw_update",
            "check_plan_consistent",
            "get_ns_backend",
            "muon_init",
            "muon_update",
            "orthogonalize",
            "partition",
            "save_checkpoint",
            "load_checkpoint",
            "save_state",
            "load_state",
            "CollectiveError",
            "global_grad_norm",
        ]
    )
    for name in dmuon_fn.__all__:
        assert hasattr(dmuon_fn, name)
