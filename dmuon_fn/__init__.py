"""dmuon_fn: distributed Muon for PyTorch as a torch.compile-native functional library."""

from . import _fsdp_adapter
from ._backend import get_ns_backend
from ._checkpoint import load_checkpoint, load_state, save_checkpoint, save_state
from ._coefficients import PRESETS
from ._comm import CommCounter, CommTimer
from ._dedicate import (
    dedicate_params,
    plan_summary,
    set_requires_gradient_sync,
    wait_gradients,
)
from ._functional import (
    Config,
    FnPlan,
    State,
    full_params,
    global_grad_norm,
    init,
    plan,
    update,
    value_and_grad,
)
from ._guard import CollectiveError
from ._optim import Muon
from ._orthogonalize import NSConfig, orthogonalize
from ._partition import Plan, partition
from ._plan_check import PlanMismatchError, check_plan_consistent
from ._summary import PlanSummary, measure_gemm_flops
from ._update import (
    AdamWState,
    MuonState,
    adamw_init,
    adamw_update,
    muon_init,
    muon_update,
)

_fsdp_adapter.install()  # fully_shard skips dedicated params (see _fsdp_adapter)

__all__ = [
    "PRESETS",
    "AdamWState",
    "CollectiveError",
    "CommCounter",
    "CommTimer",
    "Config",
    "FnPlan",
    "Muon",
    "MuonState",
    "NSConfig",
    "Plan",
    "PlanMismatchError",
    "PlanSummary",
    "State",
    "adamw_init",
    "adamw_update",
    "check_plan_consistent",
    "dedicate_params",
    "full_params",
    "get_ns_backend",
    "global_grad_norm",
    "init",
    "load_checkpoint",
    "load_state",
    "measure_gemm_flops",
    "muon_init",
    "muon_update",
    "orthogonalize",
    "partition",
    "plan",
    "plan_summary",
    "save_checkpoint",
    "save_state",
    "set_requires_gradient_sync",
    "update",
    "value_and_grad",
    "wait_gradients",
]
