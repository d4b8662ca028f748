"""torchtitan 0.3.0 as a real client (docs/integrations/torchtitan.md): its llama3 debug model,
shrunk, built on the meta device; `dedicate_params` on the decoder layers' matrices; torchtitan's
own `parallelize_llama` (selective activation checkpointing, per-block compile, then
`apply_fsdp_to_decoder`, which sets FSDP2's gradient divide factor to 1: the loss is divided by
the global token count instead); `Muon` inside an `OptimizersContainer`; its LR scheduler
builder, its `clip_grad_norm_` and its `CheckpointManager`. 5 steps on 2 gloo ranks against the
same model and dmuon_fn setup in a plain loop (`fully_shard` per block, mean loss, torch's
`clip_grad_norm_` and `LambdaLR`), and a fresh model and optimizer resumed from torchtitan's
step-3 checkpoint.

CPU stand-ins, each for a GPU-only piece the dense model never runs on CPU: FlexAttention (the
debug model's) has no CPU backward in torch 2.13 and varlen attention is CUDA's, so the layers
use torchtitan's own `ScaledDotProductAttention` (causal, one document per row: what the
block-causal mask gives); `torchtitan.models` imports the MinimalAsyncEP kernels (MoE expert
parallelism, triton) at import, so without triton that module is a stub that raises if called;
torchtitan's device type is "cuda" without a GPU, so its mesh is built on "cpu"; and gloo has no
PREMUL_SUM, FSDP2's reduce op for a divide factor, so FSDP2 reduces by sums."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, _hyper, full_params, muon_fp32

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")  # torchtitan's own imports (pip install spmd_types==0.2.3 tyro)
pytest.importorskip("tyro")

_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _gpu_only(*args, **kwargs):
    raise RuntimeError("MinimalAsyncEP's kernels need triton and a GPU")


if importlib.util.find_spec("triton") is None and _EP_KERNELS not in sys.modules:
    _stub = types.ModuleType(_EP_KERNELS)
    for _name in (
        "copy_full_counts_to_peers_kernel",
        "copy_rows_to_peers_kernel",
        "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel",
        "fill_dispatch_metadata_kernel",
        "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel",
        "topk_scores_grad_kernel",
    ):
        setattr(_stub, _name, _gpu_only)
    sys.modules[_EP_KERNELS] = _stub

import torchtitan.distributed.parallel_dims as titan_dims  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import (  # noqa: E402
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.protocols.module import Module as TitanModule  # noqa: E402

STEPS, SAVE_AT, BATCH, SEQ, VOCAB, DIM, HEADS, LAYERS, SEED = 5, 3, 4, 16, 128, 64, 4, 2, 3
MAX_NORM = 0.5  # below every step's gradient norm: the clip acts
WARMUP, DECAY_RATIO = 2, 0.4  # torchtitan's warmup-stable-decay, linear
TOL = 1e-5


def _config() -> llama3.Llama3Model.Config:
    """torchtitan's llama3 `debugmodel` (llama3/__init__.py `_debugmodel`: fused qkv, SwiGLU,
    RMSNorm, complex RoPE, its initializers), 2 layers of dim 64, vocab 128, SDPA inside."""
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:  # (FlexAttention: no backward on CPU)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
        layers=layers,
    )


def is_muon(name: str, p: torch.Tensor) -> bool:
    """The decoder layers' matrices (wqkv, wo, w1, w2, w3); embeddings, head, norms on FSDP2."""
    return p.ndim == 2 and name.startswith("layers.")


def init_fn(module, buffer_device: torch.device | None = None) -> None:
    """torchtitan's own per-module init (its `param_init` tables, the RoPE cache), for
    `dmuon.init_weights`: the same values on any world size."""
    if isinstance(module, TitanModule):
        module._init_self_parameters()
        module._init_self_buffers(buffer_device=buffer_device)


def parallelize_dedicated(model, *, parallel_dims, **kwargs):
    """What a torchtitan user passes as `ModelSpec.parallelize_fn`: dedicate the matrices on the
    FSDP mesh, have the Trainer's `model.init_weights(buffer_device=)` (after `to_empty`) call
    `dmuon.init_weights`, then torchtitan's own `parallelize_llama`."""
    dmuon.dedicate_params(model, parallel_dims.get_mesh("fsdp"), is_muon)

    def init_weights(buffer_device: torch.device | None = None) -> None:
        fn = functools.partial(init_fn, buffer_device=buffer_device)
        dmuon.init_weights(model, fn, seed=SEED)

    model.init_weights = init_weights
    return llama3.parallelize_llama(model, parallel_dims=parallel_dims, **kwargs)


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of step `step`'s (BATCH, SEQ + 1) tokens: counting from a random start
    (the next token is learnable, so the loss falls within 5 steps)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    ids = (start + torch.arange(SEQ + 1)) % VOCAB
    per = BATCH // world
    return ids[rank * per : (rank + 1) * per]


def _lr_factor(step: int) -> float:
    """torchtitan's linear warmup-stable-decay for STEPS steps, written out (the plain loop's)."""
    decay = round(STEPS * DECAY_RATIO)
    stable = STEPS + 1 - WARMUP - decay
    if step < WARMUP:
        return (step + 1) / WARMUP
    if step < WARMUP + stable:
        return 1.0
    return 1.0 - (step + 1 - WARMUP - stable) / decay


def _dedicated_meta_model(mesh) -> llama3.Llama3Model:
    with torch.device("meta"):
        model = _config().build()
    dmuon.dedicate_params(model, mesh, is_muon)
    return model


def _params(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole value, by the plain model's name (without activation
    checkpointing's and compile's wrappers)."""
    out = {}
    for n, v in full_params(model).items():
        out[n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")] = v
    return out


class MuonContainer(OptimizersContainer):
    """What a torchtitan user writes for `Trainer.Config(optimizer=MuonContainer.Config(...))`:
    one `dmuon.Muon` per model part, its state through torch's distributed optimizer state dict,
    flattened (the `state.{fqn}.{name}` keys of torchtitan's own flat dict), so each dedicated
    parameter's state is whole and DCP saves it once."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        muon: dict = dataclasses.field(default_factory=dict)
        """`dmuon.Muon`'s keyword arguments."""

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, config: Config, *, model_parts: list) -> None:
        self.model_parts = model_parts
        self.optimizers = [dmuon.Muon(m, **config.muon) for m in model_parts]
        self._post_init([p for m in model_parts for p in m.parameters()])

    def state_dict(self) -> dict:
        out = {}
        for m, o in zip(self.model_parts, self.optimizers, strict=True):
            out.update(get_optimizer_state_dict(m, o, options=self.options))
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        for m, o in zip(self.model_parts, self.optimizers, strict=True):
            set_optimizer_state_dict(m, o, state_dict, options=self.options)


# muon_fp32's: HP and fp32 standard Newton-Schulz
MUON = dict(_hyper(), ns_steps=HP["ns_steps"], ns_method="standard", ns_dtype=torch.float32)


class _Step:
    """The trainer state torchtitan checkpoints beside the model (`states={"train_state": ...}`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def _titan(rank: int, world: int, folder: str, resume: bool, backend: str | None = None) -> dict:
    """The torchtitan run, as its Trainer sets it up: the model spec's `parallelize_fn`
    (`parallelize_dedicated`; blocks compiled with `backend`), `MuonContainer`, torchtitan's LR
    schedule, clip and checkpoint (in `folder`, every SAVE_AT steps); `resume`: a fresh model
    and optimizer from step SAVE_AT. torchtitan's SPMD backend "partial_dtensor": FSDP2 on
    its "fsdp" mesh, DTensors for tensor parallelism only."""
    titan_dims.device_type = "cpu"  # (torchtitan's without a GPU: "cuda")
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    spec = dataclasses.replace(
        llama3.model_registry("debugmodel"), model=_config(), parallelize_fn=parallelize_dedicated
    )
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(  # as the Trainer calls it
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=backend is not None, backend=backend or "inductor"),
        ac_config=SelectiveAC.Config(),  # the debug model's
        dump_folder=folder,
    )
    for m in model.modules():  # (gloo has no PREMUL_SUM)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    optimizers = MuonContainer.Config(muon=MUON).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=WARMUP, decay_ratio=DECAY_RATIO, decay_type="linear"
    ).build(optimizers=optimizers, training_steps=STEPS)
    train_state = _Step()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=SAVE_AT, last_save_model_only=False
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    if resume:
        assert checkpointer.load(step=SAVE_AT)
    start = train_state.step
    losses, norms = {}, {}
    for step in range(start, STEPS):
        optimizers.zero_grad()
        ids = _batch(step, rank, world)
        tokens, labels = ids[:, :-1], ids[:, 1:]
        global_tokens = torch.tensor(labels.numel())
        dist.all_reduce(global_tokens)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
        (loss / global_tokens).backward()  # torchtitan's: FSDP2 sums, the loss is the mean's
        norms[step] = dist_utils.clip_grad_norm_(
            list(model.parameters()), MAX_NORM, foreach=True
        ).item()
        optimizers.step()
        schedulers.step()
        train_state.step = step + 1
        losses[step] = (loss / labels.numel()).item()
        checkpointer.save(train_state.step, last_step=train_state.step == STEPS)
    checkpointer.close()
    return dict(start=start, losses=losses, norms=norms, params=_params(model))


def _plain(rank: int, world: int) -> dict:
    """The same model and dmuon_fn setup in a plain loop: `fully_shard` per block and root, mean
    loss, torch's `clip_grad_norm_`, `LambdaLR`."""
    model = _dedicated_meta_model(init_device_mesh("cpu", (world,)))
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    dmuon.init_weights(model, init_fn, seed=SEED)
    initial = _params(model)
    opt = muon_fp32(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    losses, norms = {}, {}
    for step in range(STEPS):
        opt.zero_grad()
        ids = _batch(step, rank, world)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        norms[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        opt.step()
        sched.step()
        losses[step] = loss.item()
    return dict(losses=losses, norms=norms, params=_params(model), initial=initial)


def _runs(rank: int, world: int, folder: str) -> dict:
    return dict(
        plain=_plain(rank, world),
        titan=_titan(rank, world, folder, resume=False),
        resumed=_titan(rank, world, folder, resume=True),
        compiled=_titan(rank, world, f"{folder}/compiled", resume=False, backend="aot_eager"),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("titan")
    return folder, run_ranks(_runs, 2, str(folder))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["titan", "compiled"])
def test_torchtitan_trains_as_the_plain_loop(runs, run):
    """Losses and gradient norms within 1e-5 of the plain loop's at every step (measured: equal,
    eager and with aot_eager blocks), the same final values; the training moved every matrix."""
    for rank, r in enumerate(runs[1]):
        plain, got = r["plain"], r[run]
        assert plain["losses"][STEPS - 1] < plain["losses"][0] - 0.3, plain["losses"]
        for step in range(STEPS):
            assert _rel(got["losses"][step], plain["losses"][step]) <= TOL, (run, rank, step)
            assert _rel(got["norms"][step], plain["norms"][step]) <= TOL, (run, rank, step)
            assert plain["norms"][step] > MAX_NORM  # the clip acted
        for n, want in plain["params"].items():
            assert (got["params"][n] - want).norm() <= TOL * want.norm(), (run, rank, n)
            if is_muon(n, want):
                moved = (want - plain["initial"][n]).norm() / plain["initial"][n].norm()
                assert moved > 1e-2, (rank, n, moved)


@pytest.mark.slow
def test_torchtitan_checkpoint_resumes_bit_exactly(runs):
    """A fresh model and optimizer loaded from the step-3 checkpoint: steps 4 and 5 give the
    uninterrupted run's losses, norms and final values bit for bit; in the checkpoint, each
    dedicated matrix and its momentum are whole, under the plain model's keys."""
    folder, results = runs
    md = dcp.FileSystemReader(str(Path(folder, "checkpoint", f"step-{SAVE_AT}"))).read_metadata()
    with torch.device("meta"):
        plain = _config().build()
    for n, v in plain.state_dict().items():  # (fused wqkv saved as torchtitan's wq, wk, wv)
        assert md.state_dict_metadata[n].size == v.shape, n
    for n, p in plain.named_parameters():
        if is_muon(n, p):
            momentum = md.state_dict_metadata[f"optimizer.state.{n}.momentum_buffer"]
            assert momentum.size == p.shape, n
    for rank, r in enumerate(results):
        titan, resumed = r["titan"], r["resumed"]
        assert resumed["start"] == SAVE_AT
        for step in range(SAVE_AT, STEPS):
            assert resumed["losses"][step] == titan["losses"][step], (rank, step)
            assert resumed["norms"][step] == titan["norms"][step], (rank, step)
        for n, want in titan["params"].items():
            assert torch.equal(resumed["params"][n], want), (rank, n)
