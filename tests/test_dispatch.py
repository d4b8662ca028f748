"""The CPU dispatch is decided from the machine (dmuon_fn/ns/_dispatch.py, proofs/dispatch.md).

Both worlds on one machine: the decisions are pure functions of the flags and the measured
times, so a CPU with and without native bf16 is simulated by the flags and times given to them;
`ONEDNN_MAX_CPU_ISA=AVX2` makes this machine's bf16 GEMMs really slow (emulated), and the real
measurement then picks float32. The cache is recomputed whenever it is stale or corrupt, and a
job's ranks all run rank 0's choice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import custom_ops
import dmuon_fn
from custom_ops._kernels.cpu import _cpu_blocks
from dmuon_fn.ns import _calibrate, _dispatch
from dmuon_fn.ns._calibrate import (
    CpuDispatch,
    choose_aspect,
    choose_dtype,
    choose_short,
    choose_strips,
)
from dmuon_fn.ns._cost import GRAM_MIN_SHORT, ns_flops
from dmuon_fn.planning._partition import FLOPS_PER_BYTE
from tests._dist import run_ranks

AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
FIXED = CpuDispatch(torch.float32, 3.0, ((362, 2), (724, 4)), "no native bf16 matmul: AVX2")


@contextlib.contextmanager
def installed(d: CpuDispatch | None):
    """Run with `d` as the process's dispatch (None: undecided), restoring what was there."""
    before, strips = _dispatch._current, custom_ops.cpu_strips()
    _dispatch.install(d)
    try:
        yield
    finally:
        _dispatch.install(before)
        custom_ops.set_cpu_strips(strips)


# ------------------------------------------------------------------ the pure decisions


def test_dtype_needs_a_clear_bf16_win():
    assert choose_dtype(10.0, 4.0)  # native bf16: ~2.5x
    assert not choose_dtype(10.0, 9.0)  # faster, but not enough to pay for the rounding
    assert not choose_dtype(20e-3, 2.2)  # emulated bf16 (AVX2): ~100x slower


TIMES = st.floats(1e-4, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(TIMES, TIMES, TIMES, TIMES), min_size=3, max_size=3))
def test_strip_table_follows_each_size_winner(rows):
    times = {
        n: dict(zip((1, 2, 4, 8), r, strict=True))
        for n, r in zip((256, 512, 1024), rows, strict=True)
    }
    table = choose_strips(times)
    assert custom_ops.check_cpu_strips(table) == table
    before = custom_ops.cpu_strips()
    custom_ops.set_cpu_strips(table)
    try:
        for n, t in times.items():
            blocks = _cpu_blocks(n)
            # what runs at a measured size is its measured winner, or one GEMM when no strip
            # count saved 5% there
            best = min(t, key=lambda b: (t[b], b))
            want = best if best > 1 and t[best] <= 0.95 * t[1] else 1
            assert blocks == want, (times, table)
        assert _cpu_blocks(100) == 1
    finally:
        custom_ops.set_cpu_strips(before)


def test_strip_table_from_typical_times():
    times = {
        256: {1: 0.18, 2: 0.175, 4: 0.24, 8: 0.44},  # 2 strips save < 5%: one GEMM
        512: {1: 0.70, 2: 0.59, 4: 0.65, 8: 0.83},
        1024: {1: 5.4, 2: 4.6, 4: 4.0, 8: 4.1},
    }
    assert choose_strips(times) == ((362, 2), (724, 4))
    assert choose_strips({n: {1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0} for n in (256, 512)}) == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(TIMES, TIMES), min_size=4, max_size=4))
def test_gram_from_the_smallest_aspect_it_wins_from_there_on(rows):
    aspects = (1.5, 2.0, 3.0, 4.0)
    times = dict(zip(aspects, rows, strict=True))
    a = choose_aspect(times)
    assert a == math.inf or a in aspects
    wins = [x for x in aspects if times[x][1] < times[x][0]]
    assert all(x in wins for x in aspects if x >= a)
    below = [x for x in aspects if x < a]
    assert not below or below[-1] not in wins


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(TIMES, TIMES), min_size=4, max_size=4))
def test_gram_from_the_smallest_short_side_it_wins_from_there_on(rows):
    shorts = (64, 128, 256, 512)
    times = dict(zip(shorts, rows, strict=True))
    least = choose_short(times)
    assert least >= GRAM_MIN_SHORT and isinstance(least, int)
    wins = [n for n in shorts if times[n][1] < times[n][0]]
    if shorts[-1] not in wins:  # never won at the largest: the aspect rule decides alone
        assert least == GRAM_MIN_SHORT
        return
    assert all(n in wins for n in shorts if n >= least)  # Gram won wherever it now runs
    lost = [n for n in shorts if n not in wins]
    assert not lost or least > lost[-1]  # and runs at no probed size it lost


# ------------------------------------------------------------------ both worlds, simulated


def _fake_measurements(monkeypatch, t_fp32: float, t_bf16: float) -> list:
    timed = []
    monkeypatch.setattr(_calibrate, "_gemm_times", lambda: timed.append("gemm") or (t_fp32, t_bf16))
    monkeypatch.setattr(_calibrate, "_strip_times", lambda dt: {512: {1: 1.0, 2: 0.5}})
    monkeypatch.setattr(_calibrate, "_method_times", lambda dt: {2.0: (1.0, 2.0), 4.0: (2.0, 1.0)})
    shorts = {64: (1.0, 2.0), 128: (1.0, 1.5), 256: (2.0, 1.0)}
    monkeypatch.setattr(_calibrate, "_short_times", lambda dt, widest: {**shorts, 512: widest})
    return timed


def test_a_cpu_without_native_bf16_iterates_in_fp32_unmeasured(monkeypatch):
    timed = _fake_measurements(monkeypatch, 1.0, 0.1)  # a bf16 timing would say "bf16"
    with installed(None):
        d = _calibrate.measure(AVX2)
        assert d.dtype == torch.float32 and timed == []
        assert d.why.startswith("no native bf16 matmul")
        assert (d.gram_min_aspect, d.strips) == (4.0, ((362, 2),))
        assert d.gram_min_short == round(math.sqrt(128 * 256))  # between the last loss and win


def test_a_cpu_with_native_bf16_is_measured(monkeypatch):
    with installed(None):
        _fake_measurements(monkeypatch, 10.0, 4.0)
        assert _calibrate.measure(AVX512_BF16).dtype == torch.bfloat16
        _fake_measurements(monkeypatch, 10.0, 500.0)  # flags say bf16, the GEMM disagrees
        d = _calibrate.measure(AVX512_BF16)
        assert d.dtype == torch.float32 and "50x slower" in d.why
        _fake_measurements(monkeypatch, 10.0, 4.0)  # no flags to read (not Linux): measured
        assert _calibrate.measure(frozenset()).dtype == torch.bfloat16


def test_flags_decide_native_bf16():
    assert _calibrate.native_bf16(AVX2) is False
    assert _calibrate.native_bf16(AVX512_BF16) is True
    assert _calibrate.native_bf16(frozenset({"fp", "asimd", "bf16"})) is True  # Arm FEAT_BF16
    assert _calibrate.native_bf16(frozenset()) is None


_REAL = """
from dmuon_fn.ns import _calibrate
d = _calibrate.measure()
print(d.dtype, "|", d.why)
"""


@pytest.mark.slow
def test_emulated_bf16_really_measures_slow_and_picks_fp32(tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off AVX-512 BF16: on a machine that has it, bf16
    GEMMs fall back to emulation (~100x slower, measured in BENCHMARKS.md) and the measured
    choice is fp32; on a machine without it, the flags decide fp32 directly."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "DMUON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _REAL], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    dtype, why = out.stdout.strip().split(" | ")
    assert dtype == "torch.float32", out.stdout
    if _calibrate.native_bf16(_calibrate.cpu_flags()):
        assert "slower than fp32" in why, why
    else:
        assert why.startswith("no native bf16 matmul"), why


# ------------------------------------------------------------------ what the choice changes


def test_orthogonalize_and_backend_run_the_installed_choice(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    g = torch.Generator().manual_seed(0)
    wide, narrow = torch.randn(64, 256, generator=g), torch.randn(64, 128, generator=g)
    with installed(FIXED):
        assert dmuon_fn.get_ns_backend("cpu") == (
            "Gram NS (long/short >= 3, short >= 32; else standard NS) · kernel=cpu_syrk (CPU, "
            "blocked lower-triangle GEMM strips: 2 from 362 rows, 4 from 724 rows, else one "
            "GEMM) · iterate in float32 (no native bf16 matmul: AVX2)"
        )
        # aspect 4 >= 3: Gram in fp32; aspect 2: standard in fp32, bit for bit
        want = dmuon_fn.orthogonalize(wide, method="gram", dtype=torch.float32)
        assert torch.equal(dmuon_fn.orthogonalize(wide), want)
        want = dmuon_fn.orthogonalize(narrow, method="standard", dtype=torch.float32)
        assert torch.equal(dmuon_fn.orthogonalize(narrow), want)
    with installed(CpuDispatch(torch.bfloat16, math.inf, (), "measured")):
        line = dmuon_fn.get_ns_backend("cpu")
        assert line.startswith("Standard NS (Gram NS measured slower here at every aspect")
        assert "one GEMM at every size" in line and "iterate in bfloat16 (measured)" in line
        want = dmuon_fn.orthogonalize(wide, method="standard", dtype=torch.bfloat16)
        assert torch.equal(dmuon_fn.orthogonalize(wide), want)
    # Gram from 96 rows: the 64-row wide matrix runs standard NS, its 128-row sibling Gram
    with installed(replace(FIXED, gram_min_short=96)):
        assert "Gram NS (long/short >= 3, short >= 96; else standard NS)" in (
            dmuon_fn.get_ns_backend("cpu")
        )
        want = dmuon_fn.orthogonalize(wide, method="standard", dtype=torch.float32)
        assert torch.equal(dmuon_fn.orthogonalize(wide), want)
        tall = torch.randn(512, 128, generator=g)
        want = dmuon_fn.orthogonalize(tall, method="gram", dtype=torch.float32)
        assert torch.equal(dmuon_fn.orthogonalize(tall), want)


def test_compiled_orthogonalize_decides_at_trace_time_without_a_break(monkeypatch):
    """First use inside torch.compile(fullgraph=True): the dispatch is resolved while tracing
    (a constant of the graph), with no graph break, and the graph runs what eager runs. A new
    choice installed later (as `agree` installs rank 0's) recompiles instead of running the old
    one."""
    monkeypatch.setattr(_dispatch, "_load_or_measure", lambda: FIXED)
    G = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    cnt = CompileCounterWithBackend("aot_eager")
    with installed(None):
        compiled = torch.compile(dmuon_fn.orthogonalize, fullgraph=True, backend=cnt)
        out = compiled(G)
        assert _dispatch._current is FIXED
        want = dmuon_fn.orthogonalize(G, method="gram", dtype=torch.float32)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        compiled(G)
        assert cnt.frame_count == 1
        _dispatch.install(CpuDispatch(torch.bfloat16, 8.0, (), "rank 0's"))
        want = dmuon_fn.orthogonalize(G, method="standard", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(G), want, rtol=0, atol=1e-6)
        assert cnt.frame_count == 2


def test_partition_costs_follow_the_ratio():
    shapes = {"a": (64, 128), "b": (64, 512)}
    p15 = dmuon_fn.partition(shapes, 2, gram_min_aspect=1.5)
    p3 = dmuon_fn.partition(shapes, 2, gram_min_aspect=3.0)
    # by hand (tests/test_summary.py::reference_ns), n = 64, m = 128, n²m = 524,288,
    # n³ = 262,144: standard 15·n²m + 5·n³, Gram (restarts 2, 4) 9·n²m + 11·n³
    std, gram = 9_175_040, 7_602_176
    assert ns_flops((64, 128), method="standard") == std
    assert ns_flops((64, 128), method="gram") == gram
    byte_term = FLOPS_PER_BYTE * 64 * 128 * 4
    assert p15.costs[0] == gram + byte_term and p3.costs[0] == std + byte_term
    # aspect 8: Gram under both, 9·64²·512 + 11·64³ = 18,874,368 + 2,883,584
    assert p15.costs[1] == p3.costs[1] == 21_757_952 + FLOPS_PER_BYTE * 64 * 512 * 4
    with pytest.raises(ValueError, match="gram_min_aspect"):
        dmuon_fn.partition(shapes, 2, gram_min_aspect=0.5)


def test_partition_costs_follow_the_short_side():
    """Gram NS from a measured short side: a 64-row matrix below it is charged the standard
    form at every ratio; at or above it, as the ratio says."""
    shapes = {"a": (64, 128), "b": (64, 512)}
    std_b = 15 * 64 * 64 * 512 + 5 * 64**3  # standard NS of (64, 512), as ns_flops counts it
    byte = [FLOPS_PER_BYTE * 64 * n * 4 for n in (128, 512)]
    above = dmuon_fn.partition(shapes, 2, gram_min_aspect=1.5, gram_min_short=128)
    assert list(above.costs) == [9_175_040 + byte[0], std_b + byte[1]]
    assert ns_flops((64, 512), min_short=128) == std_b
    at = dmuon_fn.partition(shapes, 2, gram_min_aspect=1.5, gram_min_short=64)
    assert at.costs == dmuon_fn.partition(shapes, 2, gram_min_aspect=1.5).costs
    with pytest.raises(ValueError, match="gram_min_short"):
        dmuon_fn.partition(shapes, 2, gram_min_short=0)


# ------------------------------------------------------------------ the cache


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure():
        calls.append(1)
        return FIXED

    monkeypatch.setattr(_dispatch, "measure", fake_measure)
    return tmp_path, calls


def test_cache_is_written_once_and_reused(fresh_cache):
    root, calls = fresh_cache
    first = _dispatch._load_or_measure()
    assert (first, len(calls)) == (FIXED, 1)
    (path,) = (root / "dispatch").glob("*.json")
    again = _dispatch._load_or_measure()
    assert len(calls) == 1 and again.source == "cache"
    fields = ("dtype", "gram_min_aspect", "gram_min_short", "strips", "why")
    assert [getattr(again, f) for f in fields] == [getattr(FIXED, f) for f in fields]
    assert json.loads(path.read_text())["identity"] == _dispatch.identity()


@pytest.mark.parametrize(
    "spoil",
    [
        lambda r: "{not json",
        lambda r: json.dumps({**r, "identity": {**r["identity"], "torch": "2.0.0"}}),  # stale
        lambda r: json.dumps({**r, "identity": {**r["identity"], "threads": 64}}),
        lambda r: json.dumps({**r, "identity": {**r["identity"], "format": 0}}),
        lambda r: json.dumps({**r, "dispatch": {**r["dispatch"], "dtype": "float16"}}),
        lambda r: json.dumps({**r, "dispatch": {**r["dispatch"], "gram_min_aspect": 0.5}}),
        lambda r: json.dumps({**r, "dispatch": {**r["dispatch"], "gram_min_short": 16}}),
        lambda r: json.dumps({**r, "dispatch": {**r["dispatch"], "gram_min_short": 64.5}}),
        lambda r: json.dumps({**r, "dispatch": {**r["dispatch"], "strips": [[512, 2], [256, 4]]}}),
        lambda r: json.dumps({**r, "dispatch": {**r["dispatch"], "why": ""}}),
        lambda r: json.dumps({"identity": r["identity"]}),
        lambda r: "[]",
    ],
)
def test_a_stale_or_corrupt_cache_is_measured_again(fresh_cache, spoil):
    root, calls = fresh_cache
    _dispatch._load_or_measure()
    (path,) = (root / "dispatch").glob("*.json")
    path.write_text(spoil(json.loads(path.read_text())))
    assert _dispatch._load_or_measure() == FIXED and len(calls) == 2
    assert _dispatch._read(path, _dispatch.identity()).source == "cache", "rewritten"


def test_an_unwritable_cache_measures_in_memory(fresh_cache, monkeypatch):
    root, calls = fresh_cache
    (root / "blocker").write_text("")
    monkeypatch.setenv("DMUON_CACHE_DIR", str(root / "blocker"))  # a file, not a directory
    assert _dispatch._load_or_measure() == FIXED and len(calls) == 1


# ------------------------------------------------------------------ one choice per job


def _agree(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests._models import make

    # every rank measured something else (as timing noise would make it)
    local = CpuDispatch(
        torch.float32 if rank else torch.bfloat16, 1.5 + rank, ((256 * (rank + 1), 2),), f"r{rank}"
    )
    _dispatch.install(local)
    mesh = init_device_mesh("cpu", (world,))
    model = make("mlp")
    dmuon_fn.dedicate_params(model, mesh, pure=True)
    st = model._dmuon_state
    out = {
        "dispatch": _dispatch.cpu_dispatch().to_json(),
        "strips": custom_ops.cpu_strips(),
        "plan": st.plan.digest(),
        "want_plan": dmuon_fn.partition(
            dict(zip(st.plan.names, st.plan.shapes, strict=True)),
            world,
            elementwise=[n for n, m in zip(st.plan.names, st.plan.matrix, strict=True) if not m],
            gram_min_aspect=1.5,
        ).digest(),
    }
    dmuon_fn.Muon(model)  # the setup check passes: every rank runs rank 0's choice
    if rank == 1:  # one rank changes its choice afterwards: the next setup check says so
        _dispatch.install(local)
    try:
        dmuon_fn.Muon(model)
        out["mismatch"] = None
    except dmuon_fn.PlanMismatchError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.slow
def test_ranks_run_rank_zeros_choice():
    r0, r1 = run_ranks(_agree, 2)
    assert (
        r0["dispatch"]
        == r1["dispatch"]
        == {
            "dtype": "bfloat16",
            "gram_min_aspect": 1.5,
            "gram_min_short": 32,
            "strips": [[256, 2]],
            "why": "r0",
        }
    )
    assert r0["strips"] == r1["strips"] == ((256, 2),)
    assert r0["plan"] == r1["plan"] == r0["want_plan"]
    for r in (r0, r1):
        assert "disagree on NS dispatch" in r["mismatch"], r["mismatch"]
