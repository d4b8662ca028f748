"""Real clients built on the meta device: transformers' LlamaForCausalLM and Qwen3MoeForCausalLM
(fused 3-D experts) from small configs, in torchtitan's order (meta -> dedicate_params ->
fully_shard per decoder layer -> to_empty -> `init_weights` with the model's own
`_init_weights`, which also recomputes the rotary buffers), trained 5 steps on 4 gloo ranks
against plain PyTorch on one process: the same model built on the CPU, the same seeded init and
batches, in float64 (see tests/test_meta_init.py for the tolerance)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, full_params, muon_fp32, reference

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB, INTER, SEED = 5, 4, 16, 64, 32, 5
TOL = 1e-5
BLOCKS = {"*.experts.gate_up_proj": f"batch1,rows={INTER}+{INTER}"}


def _config(kind: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            intermediate_size=64, **common
        )
    cfg = transformers.Qwen3MoeConfig(
        intermediate_size=64,
        moe_intermediate_size=INTER,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",  # a loop over experts: float64 too (the reference)
        **common,
    )
    return transformers.Qwen3MoeForCausalLM, cfg


def _build(kind: str) -> torch.nn.Module:
    cls, cfg = _config(kind)
    return cls(cfg).float()


def _init(model) -> None:
    dmuon.init_weights(model, model._init_weights, seed=SEED)


def is_muon(name: str, p: torch.Tensor) -> bool:
    """The decoder layers' matrices (experts included), not the router."""
    return p.ndim >= 2 and ".layers." in name and not name.endswith("mlp.gate.weight")


def _ids(step: int, rank: int | None = None) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    per = BATCH // 4
    return ids if rank is None else ids[rank * per : (rank + 1) * per]


def _train(rank: int, world: int, kind: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = _build(kind)
    dmuon.dedicate_params(model, mesh, is_muon, blocks=BLOCKS if kind == "qwen3_moe" else None)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    _init(model)
    initial = full_params(model)
    opt = muon_fp32(model)
    for step in range(STEPS):
        opt.zero_grad()
        ids = _ids(step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return dict(initial=initial, params=full_params(model))


def _both(rank: int, world: int) -> dict:
    return {kind: _train(rank, world, kind) for kind in ("llama", "qwen3_moe")}


def _expert_views(name: str):
    if name.endswith("experts.gate_up_proj"):
        return lambda t: [b for x in t for b in (x[:INTER], x[INTER:])]
    if name.endswith("experts.down_proj"):
        return lambda t: list(t.unbind(0))
    return None


@pytest.mark.slow
def test_hf_llama_and_qwen3_moe_built_on_meta_train_as_one_process():
    results = run_ranks(_both, 4)
    for kind in ("llama", "qwen3_moe"):
        eager = _build(kind)
        _init(eager)
        start = {n: p.detach().clone() for n, p in eager.named_parameters()}
        muon = {n for n, p in eager.named_parameters() if is_muon(n, p)}
        blocks = {n: v for n in muon if (v := _expert_views(n)) is not None}

        def loss(m, step, r):
            ids = _ids(step, r)
            return m(input_ids=ids, labels=ids).loss

        ref = reference("", 4, STEPS, muon, HP, model=eager.double(), loss=loss, blocks=blocks)
        moved = [n for n in muon if not torch.allclose(ref[n].float(), start[n], rtol=0, atol=1e-3)]
        assert len(moved) == len(muon), sorted(muon - set(moved))  # training changed them
        for rank, r in enumerate(x[kind] for x in results):
            for n, want in start.items():  # seeded init: the same bits as one process
                assert torch.equal(r["initial"][n], want), (kind, rank, n)
            for n, want in ref.items():
                err = ((r["params"][n].double() - want).norm() / want.norm()).item()
                assert err <= TOL, (kind, rank, n, err)
