"""Known faults the test suite must catch: each one a wrong optimizer, made by one text
replacement in a copy of the tree (`tests/faults/run.py` applies it and runs `tests`).

`old` must occur exactly once in `path` (tests/test_fault_catalog.py checks it against the
current tree, so a change to the library that moves a fault's site fails there first and the
entry is rewritten with the change). `tests`: the pytest node ids expected to fail; the runner
counts the fault caught only if pytest reports failing tests (exit code 1), not if the copy
does not import or collect.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


T = "tests/"
UPDATE = T + "test_update.py"
CONFORM = T + "test_conformance.py"
DIST2 = T + "test_distributed.py::test_parity_world_2"
DIST4 = T + "test_distributed.py::test_parity_world_4_and_hsdp_2x2"
FN1 = T + "test_functional.py::test_world_1"
ORTHO = T + "test_orthogonalize.py"
TRAIN = T + "test_training.py"
CKPT = T + "test_checkpoint.py"
CKPT_V1 = T + "test_checkpoint_fixture.py"
GUARD = T + "test_functional_guard.py"
PREFETCH_DEPTH = T + "test_prefetch.py::test_z3_holds_at_most_depth_plus_one_units"
COEFF = T + "test_coefficients.py"

# Muon's apply, from the stride check to the end of the function (both of its paths)
_APPLY = (
    "    if O.stride() != param.stride():  # (a tall matrix's O is transposed) keep param's layout"
    """
        return (param * decay).sub_(O.mul_(step))
    # O is a fresh temporary in param's layout: the new parameter is written into it.
    new = O.mul_(-step)
    if isinstance(decay, Tensor):
        return new.addcmul_(param, decay)
    return new.add_(param, alpha=decay)"""
)

FAULTS: tuple[Fault, ...] = (
    Fault(
        "AdamW weight decay dropped",
        "dmuon_fn/optim/_update.py",
        "new = param * (1 - lr * weight_decay) - (lr / bc1) * (m / denom)",
        "new = param - (lr / bc1) * (m / denom)",
        (UPDATE, CONFORM),
    ),
    Fault(
        "Muon weight decay applied after the update (to W - lr·s·O)",
        "dmuon_fn/optim/_update.py",
        _APPLY,
        "    return (param - O * step) * decay",
        (UPDATE, CONFORM),
    ),
    Fault(
        "Muon momentum ignored (the default 0.95 used)",
        "dmuon_fn/dedicated/_muon.py",
        "            momentum=momentum,",
        "            momentum=0.95,",
        (CONFORM, DIST2),
    ),
    Fault(
        "functional momentum ignored (the default 0.95 used)",
        "dmuon_fn/optim/_update.py",
        '("lr", "weight_decay", "momentum", "nesterov")',
        '("lr", "weight_decay", "nesterov")',
        (CONFORM, FN1),
    ),
    Fault(
        "Nesterov ignored (always on)",
        "dmuon_fn/dedicated/_muon.py",
        "            nesterov=nesterov,",
        "            nesterov=True,",
        (CONFORM, DIST2),
    ),
    Fault(
        "functional Nesterov ignored (always on)",
        "dmuon_fn/optim/_update.py",
        '("lr", "weight_decay", "momentum", "nesterov")',
        '("lr", "weight_decay", "momentum")',
        (CONFORM, FN1),
    ),
    Fault(
        "AdamW betas ignored (the defaults used)",
        "dmuon_fn/dedicated/_muon.py",
        "adamw_betas=adamw_betas,",
        "adamw_betas=(0.9, 0.999),",
        (CONFORM, DIST2),
    ),
    Fault(
        "AdamW eps ignored (the default used)",
        "dmuon_fn/dedicated/_muon.py",
        "adamw_eps=adamw_eps,",
        "adamw_eps=1e-8,",
        (CONFORM, DIST2),
    ),
    Fault(
        "functional AdamW betas and eps ignored",
        "dmuon_fn/optim/_update.py",
        '("lr", "betas", "eps", "weight_decay")',
        '("lr", "weight_decay")',
        (CONFORM, FN1),
    ),
    Fault(
        "Muon ns_steps ignored (the default 5 used)",
        "dmuon_fn/dedicated/_muon.py",
        "NSConfig(ns_steps, coefficients,",
        "NSConfig(5, coefficients,",
        (CONFORM, DIST2),
    ),
    Fault(
        "lr scale from the short side",
        "dmuon_fn/optim/_update.py",
        "return 0.2 * math.sqrt(max(m, n))",
        "return 0.2 * math.sqrt(min(m, n))",
        (UPDATE, CONFORM),
    ),
    Fault(
        "one Newton-Schulz step fewer",
        "dmuon_fn/ns/_orthogonalize.py",
        "rows = schedule(cfg.coefficients, cfg.steps)",
        "rows = schedule(cfg.coefficients, cfg.steps)[:-1]",
        (UPDATE, ORTHO),
    ),
    Fault(
        "a Gram restart skipped",
        "dmuon_fn/ns/_iteration.py",
        "        if i in restarts:",
        "        if i in restarts and i != min(restarts):",
        (ORTHO,),
    ),
    Fault(
        "Polar Express coefficients of another preset",
        "dmuon_fn/ns/_iteration.py",
        '"polar_express": POLAR_EXPRESS,',
        '"polar_express": YOU,',
        (COEFF,),
    ),
    Fault(
        "dedicated gradients summed instead of averaged over data ranks",
        "dmuon_fn/dedicated/_schedule.py",
        "grad = g.part(flat, i).to(e.param.dtype).div_(div)",
        "grad = g.part(flat, i).to(e.param.dtype)",
        (DIST2,),
    ),
    Fault(
        "functional gradients summed instead of averaged",
        "dmuon_fn/functional/_collect.py",
        "scale = 1.0 / (fn_plan.shard_size * fn_plan.replicate_size)",
        "scale = 1.0",
        (T + "test_functional.py::test_world_2",),
    ),
    Fault(
        "one matrix's update made on a non-owner, and lost",
        "dmuon_fn/dedicated/_grad_guard.py",
        "return e is None or st.is_global_owner(e)",
        "return e is None or st.is_global_owner(e) != (e is st.entries[0])",
        (DIST2,),
    ),
    Fault(
        "HSDP publish lost on the receiving replica",
        "dmuon_fn/dedicated/_state.py",
        "buf = e.param.detach().to(e.dtype)",
        "buf = e.param.detach().to(e.dtype, copy=True)",
        (DIST4,),
    ),
    Fault(
        "functional HSDP publish not taken by the other replica",
        "dmuon_fn/functional/_step.py",
        "params.update((n, o) for n, o in zip(mine, outs, strict=True)"
        " if not p_.is_global_owner(n))",
        "params.update(())",
        (T + "test_functional.py::test_world_4_and_hsdp_2x2",),
    ),
    Fault(
        "non-finite skip leaves AdamW's step count updated",
        "dmuon_fn/dedicated/_muon.py",
        "                guard.write(dst, new, ok)",
        "                guard.write(dst, new, ok if new.dim() else None)",
        (TRAIN + "::test_nonfinite_gradient_skips_the_step_on_every_rank",),
    ),
    Fault(
        "functional non-finite skip keeps the new optimizer state",
        "dmuon_fn/functional/_step.py",
        "opt[n] = type(s)(*(guard.keep(ok, a, b) for a, b in zip(s, opt[n], strict=True)))",
        "opt[n] = s",
        (GUARD + "::test_nonfinite_gradient_skips_the_compiled_step_everywhere",),
    ),
    Fault(
        "checkpoint load drops AdamW's step count",
        "dmuon_fn/_checkpoint.py",
        'sd[f"optim.{n}.{k}"] = v if v.ndim == 0 else _part(e, v)',
        'sd[f"optim.{n}.{k}"] = (v.clone() if load else v) if v.ndim == 0 else _part(e, v)',
        (CKPT, CKPT_V1),
    ),
    Fault(
        "functional checkpoint load drops AdamW's step count",
        "dmuon_fn/_checkpoint.py",
        'sd.update({f"optim.{n}.{k}": part(v) for k, v in items.items()})',
        'sd.update({f"optim.{n}.{k}": v.clone() if load and k == "step" else part(v)'
        " for k, v in items.items()})",
        (CKPT, CKPT_V1),
    ),
    Fault(
        "a plan that gives one matrix two owners",
        "dmuon_fn/dedicated/_state.py",
        "return e.owner_shard == self.view.shard_rank and e.owner_replica =="
        " self.view.replica_rank",
        "return (e.owner_shard == self.view.shard_rank or 'gate_proj' in e.name)"
        " and e.owner_replica == self.view.replica_rank",
        (DIST2,),
    ),
    Fault(
        "max_grad_norm ignored by the object API",
        "dmuon_fn/dedicated/_grad_guard.py",
        "None if self.clipped else cfg.max_grad_norm",
        "None",
        (TRAIN + "::test_max_grad_norm_in_step_equals_explicit_clip",),
    ),
    Fault(
        "gradient accumulation keeps only the last micro-batch",
        "dmuon_fn/dedicated/_schedule.py",
        "e.param.grad += grad",
        "e.param.grad = grad",
        (TRAIN + "::test_accumulation_equals_one_big_batch",),
    ),
    Fault(
        "an lr schedule ignored by the object API (the initial lr used)",
        "dmuon_fn/dedicated/_muon.py",
        "{k: torch.tensor(g[k], dtype=torch.float32) for k in as_tensors}",
        '{k: torch.tensor(g.get("initial_" + k, g[k]), dtype=torch.float32) for k in as_tensors}',
        (FN1,),
    ),
    Fault(
        "Z3 prefetch depth ignored (nothing gathered ahead)",
        "dmuon_fn/dedicated/_schedule.py",
        "        self.depth = depth",
        "        self.depth = 0",
        (PREFETCH_DEPTH,),
    ),
    Fault(
        "Z3's backward re-gathers not prefetched",
        "dmuon_fn/dedicated/_schedule.py",
        "end = len(self.order) if self.step > 0 else -1",
        "end = len(self.order) if self.step > 0 else self.pos",
        (PREFETCH_DEPTH,),
    ),
    Fault(
        "a forward that raises keeps its saved-tensor hooks",
        "dmuon_fn/dedicated/_hooks.py",
        "            saver.leave()  # a no-op unless the last forward raised",
        "            pass",
        (T + "test_compile_blocks.py::test_a_forward_that_raises_leaves_no_trace",),
    ),
    Fault(
        "a step that updates nothing",
        "dmuon_fn/dedicated/_muon.py",
        '            writes = self._update(group["kind"], p, hyper[id(group)], exchange)',
        "            writes = []",
        (TRAIN + "::test_all_zero_gradients_give_a_zero_update",),
    ),
    Fault(
        "the configured Gram restarts ignored (the default used)",
        "dmuon_fn/ns/_orthogonalize.py",
        "if cfg.restarts is None else cfg.restarts)",
        ")",
        (ORTHO,),
    ),
    Fault(
        "the iteration dtype asked for ignored (the device's used)",
        "dmuon_fn/ns/_orthogonalize.py",
        "    it = cfg.dtype or (torch.float64 if",
        "    it = (torch.float64 if",
        (ORTHO,),
    ),
    Fault(
        "ns_step's b and c swapped",
        "custom_ops/ns_step.py",
        "    B = sym_mm(A, A, A, c, b)",
        "    B = sym_mm(A, A, A, b, c)",
        (ORTHO,),
    ),
    Fault(
        "a Polar Express coefficient mistyped (two digits swapped)",
        "dmuon_fn/ns/coefficients.json",
        "[3.9486908534822946, -2.908902115962949, 0.5518191394370137]",
        "[3.9486908534822946, -2.908902151962949, 0.5518191394370137]",
        (COEFF,),
    ),
    Fault(
        "the safety factor applied with the wrong powers",
        "dmuon_fn/ns/_iteration.py",
        "(a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)",
        "(a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**2, c / POLAR_EXPRESS_SAFETY**3)",
        (COEFF,),
    ),
    Fault(
        "a long schedule cycles its rows instead of repeating the last",
        "dmuon_fn/ns/_iteration.py",
        "    return tuple(rows[min(i, len(rows) - 1)] for i in range(steps))",
        "    return tuple(rows[i % len(rows)] for i in range(steps))",
        (COEFF,),
    ),
    Fault(
        "the Gram cost model misses one n×n product per step",
        "dmuon_fn/ns/_cost.py",
        "        total += 0.0 if last else 2 * sym_nn  # R' = P·(P·R)",
        "        total += 0.0 if last else sym_nn  # R' = P·(P·R)",
        (T + "test_summary.py",),
    ),
    Fault(
        "a team member's update scaled by its slice's shape, not the whole matrix's",
        "dmuon_fn/optim/_update.py",
        "        return muon_apply(param, O, **hyper, shape=team.shape), new_state",
        "        return muon_apply(param, O, **hyper), new_state",
        (T + "test_teams.py::test_functional_steps_teams_like_one_process",),
    ),
    Fault(
        "a team's short-side Gram matrix not summed over its members",
        "dmuon_fn/ns/_team.py",
        '            return funcol.all_reduce(part, "sum", group)',
        "            return part",
        (T + "test_teams.py::test_object_api_steps_teams_like_one_process",),
    ),
    Fault(
        "a team's bf16 Gram sum gathering unsummed row blocks",
        "dmuon_fn/ns/_team.py",
        '    block = funcol.reduce_scatter_single(part, "sum", rows, group).to(dtype)',
        "    block = part.narrow(rows, dist.get_rank(group) * h, h).to(dtype)",
        (T + "test_team_ns.py::test_bf16_team_is_as_close_to_the_polar_factor_as_one_rank",),
    ),
    Fault(
        "a team member normalizing its slice by its own max, not the whole matrix's",
        "dmuon_fn/ns/_team.py",
        "    return Y.mul_((mine / amax / (norm + eps)).to(X.dtype)[..., None, None])",
        "    return Y.mul_((1.0 / (norm + eps)).to(X.dtype)[..., None, None])",
        (T + "test_team_ns.py::test_each_member_holds_its_slice_of_the_whole_result_fp32",),
    ),
    Fault(
        "the planner's team sizes: the first sizing scheduled kept, the rest not weighed",
        "dmuon_fn/planning/_slices.py",
        "        if best and bound > best[0]:\n            break",
        "        if best:\n            break",
        (T + "test_slices.py::test_the_team_sizing_is_the_best_of_every_cap",),
    ),
    Fault(
        "a team's collectives left out of the planner's cost",
        "dmuon_fn/planning/_partition.py",
        "        return flops + byte_cost(sh) * share / max(sh) + flops_per_byte * comm",
        "        return flops + byte_cost(sh) * share / max(sh)",
        (T + "test_team_plans.py::test_teams_shorten_the_busiest_rank_at_1024",),
    ),
    Fault(
        "the cost of a batch of matrices counted once",
        "dmuon_fn/ns/_cost.py",
        "    return batch * total",
        "    return total",
        (T + "test_summary.py",),
    ),
    Fault(
        "a seeded init drawing from one generator per module, not per parameter",
        "dmuon_fn/dedicated/_init.py",
        "_call(module, fn, param_seed(seed, prefix + attr), {attr: full}, shape_of, prefix + attr)",
        "_call(module, fn, param_seed(seed, mname), {attr: full}, shape_of, prefix + attr)",
        (T + "test_meta_init.py::test_a_value_is_a_function_of_seed_name_and_shape_alone",),
    ),
    Fault(
        "a meta model's HSDP replicas left with their own values after init",
        "dmuon_fn/dedicated/_state.py",
        "        for e in mine if rep is not None else ():",
        "        for e in ():",
        (T + "test_meta_init.py::test_a_meta_model_trains_as_the_eager_one_on_one_process",),
    ),
    Fault(
        "a whole backward's gradient sums kept in flight until the step",
        "dmuon_fn/dedicated/_schedule.py",
        "        self.reduce_cap = (depth + 1) * max(sizes, default=0)",
        "        self.reduce_cap = float('inf')",
        (T + "test_meta_init.py::test_no_rank_holds_more_than_its_share",),
    ),
    Fault(
        "torch's clip_grad_norm_ counting only the owned gradients on each rank",
        "dmuon_fn/dedicated/_torch_norms.py",
        "                dist.all_reduce(part, op=op, group=group)",
        "                pass",
        (T + "test_torch_surface.py::test_torch_clipping_equals_one_process",),
    ),
    Fault(
        "a full state dict holding the 0-size placeholders",
        "dmuon_fn/dedicated/_state_dict.py",
        "                    state_dict[prefix + attr] = whole_value(st, es)",
        "                    pass",
        (T + "test_torch_surface.py::test_full_state_dict_loads_into_the_plain_model",),
    ),
    Fault(
        "a state dict's pieces sent to the global owner but not to the other replicas",
        "dmuon_fn/dedicated/_state_dict.py",
        "else (lambda e: range(st.replicate_size))",
        "else (lambda e: (e.owner_replica,))",
        (T + "test_torch_surface.py::test_dcp_round_trip_through_torch_s_state_dict_on_any_world",),
    ),
    Fault(
        "torch's distributed optimizer state dict loaded without the dedicated momenta",
        "dmuon_fn/dedicated/_optim_state.py",
        '                load_whole(st, es, v, f"optimizer state {k} of {es[0].names[0]}", put)',
        "                pass",
        (T + "test_torch_surface.py::test_get_state_dict_and_dcp_resume",),
    ),
    Fault(
        "the optimizer's groups left as accelerate's FSDP2 prepare mixed them up",
        "dmuon_fn/dedicated/_groups.py",
        '            if g["params"] is now:',
        "            if True:",
        (T + "test_torch_surface.py::test_zero_grad_kept_grads_hooks_and_param_groups",),
    ),
    Fault(
        "a loaded optimizer state dict's hyperparameters (a scheduler's lr) dropped",
        "dmuon_fn/dedicated/_groups.py",
        "        if groups is not None:\n            self.param_groups = groups",
        "        if False:\n            self.param_groups = groups",
        (T + "test_torch_surface.py::test_zero_grad_kept_grads_hooks_and_param_groups",),
    ),
    Fault(
        "FSDP2's gradient divide factor ignored by the dedicated gradients",
        "dmuon_fn/dedicated/_schedule.py",
        "                    div = scale if e.grad_divide is None else e.grad_divide",
        "                    div = scale",
        (T + "test_fsdp_knobs.py",),
    ),
    Fault(
        "a gathered group's pieces joined in group-rank order, not piece order",
        "dmuon_fn/ns/_team.py",
        "        pieces = zip(team.pieces, team.order, strict=True)",
        "        pieces = zip(team.pieces, sorted(team.order), strict=True)",
        (T + "test_gathered.py",),
    ),
    Fault(
        "gathered pieces placed without counting their HSDP copies",
        "dmuon_fn/planning/_gathered.py",
        "            if c != t:\n",
        "            if False:\n",
        (T + "test_gathered.py",),
    ),
    Fault(
        "a gathered team slice scaled by the slice's shape, not its team's matrix",
        "dmuon_fn/optim/_update.py",
        '    scaled = scaled if inner is None else {"shape": inner.shape}',
        "    scaled = scaled",
        (T + "test_gathered.py",),
    ),
    Fault(
        "a team member's slice gathered along dim 0 whatever its team's cut",
        "dmuon_fn/planning/_gathered.py",
        "            dims[i] = parse_piece(n).dim",
        "            dims[i] = 0",
        (T + "test_gathered.py",),
    ),
    Fault(
        "one expert's row pieces joined along the expert dim, not along its rows",
        "dmuon_fn/planning/_slices.py",
        "    parts = [torch.cat(vs, 1) if o is not None else vs[0] for o, vs in runs]",
        "    parts = [torch.cat(vs, 0) if o is not None else vs[0] for o, vs in runs]",
        (T + "test_gathered.py::test_an_experts_rows_gathered_step_like_one_process",),
    ),
    Fault(
        "a row piece's DCP chunk placed at its expert's offset only, not its rows'",
        "dmuon_fn/planning/_slices.py",
        "        return tuple(s.start or 0 for s in self.index)",
        "        return tuple(s.start or 0 for s in self.index[:1])",
        (T + "test_gathered.py::test_an_experts_rows_functional_checkpoint_loads_on_2_ranks",),
    ),
    Fault(
        "a piece's part of torch's whole state dict taken without its columns",
        "dmuon_fn/dedicated/_state_dict.py",
        "    return (slice(lo - a, hi - a),), (slice(lo - start, hi - start), *index[1:])",
        "    return (slice(lo - a, hi - a),), (slice(lo - start, hi - start),)",
        (T + "test_gathered.py::test_an_experts_rows_gathered_step_like_one_process",),
    ),
)
