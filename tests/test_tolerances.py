"""Each parity tolerance is at most a tenth of the smallest effect it must detect, measured.

A parity test compares a run of the library with `tests._models.reference`. The wrong optimizers
it must tell apart from the right one are the reference with one thing changed
(`tests._models.WRONG`: a hyperparameter ignored, i.e. the library default used instead of HP;
weight decay
applied after the update; the lr scale from the short side; one Newton-Schulz step fewer;
gradients summed over data ranks instead of averaged). For each test's own model, world, steps
and lr schedule this measures every such effect, max over parameters of
‖wrong − right‖ / ‖right‖, and checks TOL ≤ effect / 10. `python -m tests.test_tolerances`
prints the table recorded in proofs/tolerances.md.

Effects measured this way are those of the fault on the reference (fp32 Newton-Schulz, one
process); the library's own fault copies (tests/faults) apply the same changes to the library.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests import (
    test_checkpoint,
    test_conformance,
    test_distributed,
    test_functional,
    test_prefetch,
    test_tensor_parallel,
    test_training,
)
from tests._models import HP, WRONG, is_proj, make, reference, split_wrong
from tests._tolerance import rel_err

SUMMED = "gradients summed over ranks"
STEPS = 5


def _named(name, world, muon, steps=STEPS, schedule=lambda s: 1.0):
    return lambda hp, **wrong: reference(name, world, steps, muon, hp, schedule, **wrong)


def _muon(name, pure):
    return {n for n, p in make(name).named_parameters() if (p.ndim >= 2 if pure else is_proj(n, p))}


def _decay(s):
    return 1.0 / (s + 1)


# (test and setting, its tolerance, world, reference(hp, **knobs) of that test)
CASES = [
    ("test_distributed mlp W=2", test_distributed.TOL, 2, _named("mlp", 2, _muon("mlp", False))),
    ("test_distributed mlp W=4", test_distributed.TOL, 4, _named("mlp", 4, _muon("mlp", False))),
    (
        "test_distributed transformer pure W=2",
        test_distributed.TOL,
        2,
        _named("transformer", 2, _muon("transformer", True)),
    ),
    (
        "test_distributed transformer pure W=4",
        test_distributed.TOL,
        4,
        _named("transformer", 4, _muon("transformer", True)),
    ),
    (
        "test_functional mlp W=2, lr/(step+1)",
        test_functional.TOL,
        2,
        _named("mlp", 2, _muon("mlp", True), schedule=_decay),
    ),
    (
        "test_functional transformer W=4, lr/(step+1)",
        test_functional.TOL,
        4,
        _named("transformer", 4, _muon("transformer", True), schedule=_decay),
    ),
    ("test_conformance mlp", test_conformance.TOL, 1, _named("mlp", 1, _muon("mlp", True))),
    (
        "test_conformance transformer",
        test_conformance.TOL,
        1,
        _named("transformer", 1, _muon("transformer", True)),
    ),
    ("test_prefetch chain W=2", test_prefetch.TOL, 2, test_prefetch._reference_of(2)),
    (
        "test_tensor_parallel",
        test_tensor_parallel.TOL,
        1,
        test_tensor_parallel._reference_of(False),
    ),
    (
        "test_tensor_parallel pure",
        test_tensor_parallel.TOL,
        1,
        test_tensor_parallel._reference_of(True),
    ),
    (
        "test_training more ranks than matrices W=4",
        test_training.TOL,
        4,
        _named("mlp", 4, test_training.TWO, steps=3),
    ),
    (
        "test_checkpoint mlp W=2, two steps after a resume",
        test_checkpoint.CLOSE,
        2,
        _named("mlp", 2, _muon("mlp", False), steps=2),
    ),
]
QUICK = {"test_conformance mlp", "test_conformance transformer"}
# What a test is not there to detect: the checkpoint tests check what a resume restores (the
# state exactly, then the hyperparameters by two more steps); the update's own arithmetic is
# the other tests' subject.
NOT_ITS_SUBJECT = {
    "test_checkpoint mlp W=2, two steps after a resume": {
        "weight decay after the update",
        "lr scale from the short side",
        SUMMED,
    }
}


def effects(world: int, ref: Callable[..., dict]) -> dict[str, float]:
    """Each fault's effect on `ref`'s result: max over parameters of the relative change."""
    right = ref(HP)
    runs = {name: split_wrong(change) for name, change in WRONG.items()}
    if world > 1:  # (one process: nothing to sum)
        runs[SUMMED] = (HP, dict(grad_scale=float(world)))
    out = {}
    for name, (hp, knobs) in runs.items():
        wrong = ref(hp, **knobs)
        out[name] = max(rel_err(wrong[n], w) for n, w in right.items())
    return out


def _subject(what: str, eff: dict[str, float]) -> dict[str, float]:
    """The effects `what` is there to detect."""
    return {k: v for k, v in eff.items() if k not in NOT_ITS_SUBJECT.get(what, ())}


@pytest.mark.parametrize(
    ("what", "tol", "world", "ref"),
    [pytest.param(*c, id=c[0], marks=() if c[0] in QUICK else pytest.mark.slow) for c in CASES],
)
def test_tolerance_is_at_most_a_tenth_of_each_effect(what, tol, world, ref):
    torch.manual_seed(0)
    small = {k: v for k, v in _subject(what, effects(world, ref)).items() if v < 10 * tol}
    assert not small, (what, tol, small)


def _table() -> str:
    lines = [
        "| test | TOL | smallest effect | its fault | effect / TOL |",
        "|---|---|---|---|---|",
    ]
    every = {what: effects(world, ref) for what, _, world, ref in CASES}
    for what, tol, _, _ in CASES:
        mine = _subject(what, every[what])
        k = min(mine, key=mine.get)
        lines.append(f"| {what} | {tol:.0e} | {mine[k]:.1e} | {k} | {mine[k] / tol:.0f} |")
    names = [*WRONG, SUMMED]
    lines += ["", "| test | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for what, eff in every.items():
        cells = [f"{eff[n]:.1e}" if n in eff else "-" for n in names]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(_table())
