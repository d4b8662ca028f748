"""dmuon_fn: distributed Muon for PyTorch as a torch.compile-native functional library."""

from ._checkpoint import load_checkpoint, load_state, save_checkpoint, save_state
from .comm._counters import CommCounter, CommTimer
from .comm._mesh import CollectiveError
from .dedicated import _fsdp_adapter as _fsdp_adapter
from .dedicated import _optim_state as _optim_state
from .dedicated import _torch_norms as _torch_norms
from .dedicated._dedicate import (
    dedicate_params,
    plan_summary,
    set_requires_gradient_sync,
    wait_gradients,
)
from .dedicated._init import init_weights
from .dedicated._muon import Muon
from .functional._plan import FnPlan, plan
from .functional._step import State, full_params, global_grad_norm, init, update, value_and_grad
from .ns._blocks import Blocks
from .ns._iteration import PRESETS
from .ns._orthogonalize import NSConfig, get_ns_backend, orthogonalize
from .ns._team import orthogonalize_team
from .optim._config import Config
from .optim._qk_clip import ClipHeads, LogitTracker, max_logits, qk_clip, qk_clip_fused
from .optim._update import AdamWState, MuonState, adamw_init, adamw_update, muon_init, muon_update
from .planning._check import PlanMismatchError, check_plan_consistent
from .planning._partition import partition
from .planning._plan import Plan
from .planning._summary import PlanSummary, measure_gemm_flops

_fsdp_adapter.install()  # fully_shard skips dedicated params (see _fsdp_adapter)
_torch_norms.install()  # torch.nn.utils' norms count dedicated gradients once
_optim_state.install()  # torch's distributed optimizer state dict: whole dedicated states

__all__ = [
    "PRESETS",
    "AdamWState",
    "Blocks",
    "ClipHeads",
    "CollectiveError",
    "CommCounter",
    "CommTimer",
    "Config",
    "FnPlan",
    "LogitTracker",
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
    "init_weights",
    "load_checkpoint",
    "load_state",
    "max_logits",
    "measure_gemm_flops",
    "muon_init",
    "muon_update",
    "orthogonalize",
    "orthogonalize_team",
    "partition",
    "plan",
    "plan_summary",
    "qk_clip",
    "qk_clip_fused",
    "save_checkpoint",
    "save_state",
    "set_requires_gradient_sync",
    "update",
    "value_and_grad",
    "wait_gradients",
]
