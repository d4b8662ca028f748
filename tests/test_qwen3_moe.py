"""A real client: transformers' Qwen3-MoE (fused 3-D experts, as transformers 5 stores them),
built from a small config, every parameter dedicated (Muon on matrices, experts per block, AdamW
on the rest), trains on 2 and 4 CPU ranks with the losses of one process; each expert's gate and
up blocks get their own orthogonal update."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import full_params

transformers = pytest.importorskip("transformers")

INTER, STEPS, LR, BATCH, SEQ = 32, 3, 0.02, 4, 16
BLOCKS = {"*.experts.gate_up_proj": f"batch1,rows={INTER}+{INTER}"}


def _model():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float()


def _run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    dmuon.dedicate_params(model, mesh, pure=True, blocks=BLOCKS)
    plan = model._dmuon_state.plan
    specs = {n: str(plan.blocks_of(n)) for n in plan.names if "experts" in n}
    opt = dmuon.Muon(model, lr=LR, weight_decay=0.0, ns_dtype=torch.float32)
    per, losses, first = BATCH // world, [], None
    for step in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        mine = ids[rank * per : (rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
        if step == 0:
            opt.wait_publish()
            first = full_params(model, cast=False)
    opt.wait_publish()
    return {"losses": losses, "specs": specs, "first": first, "owners": _owners(plan)}


def _owners(plan) -> dict[str, int]:
    """The owner slot of every expert tensor, or of each of its pieces where the plan cuts it."""
    return {n: plan.slot(n) for n in plan.names if "experts" in n}


@pytest.mark.slow
def test_qwen3_moe_trains_like_one_process_and_orthogonalizes_each_expert_block():
    (one,) = run_ranks(_run, 1)
    assert one["specs"]["model.layers.0.mlp.experts.gate_up_proj"] == f"batch1,rows={INTER}+{INTER}"
    assert one["specs"]["model.layers.0.mlp.experts.down_proj"] == "batch1"
    for world in (2, 4):
        results = run_ranks(_run, world)
        for r in results:
            for a, b in zip(r["losses"], one["losses"], strict=True):
                assert abs(a - b) <= 1e-4 * abs(b), (world, r["losses"], one["losses"])
        # every rank planned the same owners (of the expert tensors or their pieces)
        assert len({tuple(sorted(r["owners"].items())) for r in results}) == 1
    # the first step from zero momentum: each expert's gate and up update is lr·scale·O on its
    # own, O orthogonal: its nonzero singular values near 1 (Polar Express's band)
    W0 = dict(_model().named_parameters())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    U = (one["first"][name] - W0[name].detach()) / -LR
    for e in range(U.shape[0]):
        for block in (U[e, :INTER], U[e, INTER:]):
            scale = 0.2 * max(block.shape) ** 0.5
            s = torch.linalg.svdvals(block.double() / scale)
            live = s[s > 1e-3]  # a block's rank is at most the tokens routed to its expert
            assert len(live) >= 8 and 0.5 < live.min() and live.max() < 1.3, (e, s)
        whole = torch.linalg.svdvals(U[e].double() / (0.2 * 64**0.5))
        assert whole.max() > 1.3  # not one orthogonal (64, 64) matrix: two stacked ones
