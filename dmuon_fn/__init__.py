"""dmuon_fn: distributed Muon for PyTorch as a torch.compile-native functional library."""

from ._backend import get_ns_backend
from ._coefficients import PRESETS
from ._orthogonalize import NSConfig, orthogonalize
from ._partition import Plan, partition
from ._plan_check import PlanMismatchError, check_plan_consistent
from ._update import (
    AdamWState,
    MuonState,
    adamw_init,
    adamw_update,
    muon_init,
    muon_update,
)

__all__ = [
    "PRESETS",
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
]
