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
            "CommTimer",
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
            "orthogonalize_team",
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
            "set_requires_gradient_sync",
            "wait_gradients",
            "PlanSummary",
            "plan_summary",
            "measure_gemm_flops",
            # parameters made of several matrices, and QK-clip
            "Blocks",
            "ClipHeads",
            "LogitTracker",
            "max_logits",
            "qk_clip",
            "qk_clip_fused",
            # models built on the meta device
            "init_weights",
        ]
    )
    for name in dmuon_fn.__all__:
        assert hasattr(dmuon_fn, name)


def _module_graph(package: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports relatively}, TYPE_CHECKING imports included
    (`from . import x` names module x; `from .m import x` names m, and m.x if that is one)."""
    graph = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        pkg = parts[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg[: len(pkg) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                names = {f"{target}.{a.name}" for a in node.names}
                deps |= names | ({target} if node.module else set())
        graph[mod] = deps - {mod}
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a path, or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack, m, d]
            if d not in state and (found := visit(d, [*stack, m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def test_no_import_cycles():
    for package in ("dmuon_fn", "custom_ops"):
        cycle = _cycle(_module_graph(package))
        assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# dmuon_fn's layers, bottom to top: a module may import its own layer and the ones below it
LAYERS = (
    "comm",
    "ns",
    "planning",
    "optim",
    "tp",
    "dedicated",
    "functional",
    "_checkpoint",
    "__init__",
)


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "__init__")


def test_layers_import_downward():
    graph = _module_graph("dmuon_fn")
    assert {m.split(".")[1] for m in graph if "." in m} == set(LAYERS) - {"__init__"}
    upward = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)
    )
    assert not upward, "imports against the layer order: " + "; ".join(upward)
