"""Apply each known fault (tests/faults/catalog.py) to a copy of the tree, run its tests there,
and print whether the suite caught it.

    python -m tests.faults.run                 every fault
    python -m tests.faults.run -k publish      faults whose name contains "publish"
    python -m tests.faults.run --clean         first run every fault's tests on the unpatched
                                               copy (they must pass, or nothing is shown)
    python -m tests.faults.run --record FILE   also write the table as Markdown

A fault is caught when pytest exits 1 (tests ran and some failed). Exit 0 is a miss; any other
exit code (the copy did not import, collection failed) or a timeout is reported as an error and
counts as not caught. The copy is the working tree's tracked and unignored files; the library is
imported from it (checked), and the suite's conftest gives it fresh caches. Exits 1 if any
fault is not caught.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.faults.catalog import FAULTS, Fault

ROOT = Path(__file__).resolve().parents[2]


def _files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def copy_tree(dst: Path) -> None:
    for f in _files():
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)


def apply(fault: Fault, tree: Path) -> None:
    path = tree / fault.path
    text = path.read_text()
    count = text.count(fault.old)
    if count != 1:
        raise ValueError(f"{fault.name}: {fault.path} has {count} copies of its text, not one")
    path.write_text(text.replace(fault.old, fault.new))


def _env(tree: Path, scratch: Path) -> dict[str, str]:
    """The caller's environment with the copy first on the path and `scratch` as TMPDIR: the
    suite's conftest makes its fresh caches there and clears DMUON_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMUON_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TMPDIR"] = str(scratch)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@functools.cache
def _check_import(tree: Path) -> None:
    """The copy at `tree` imports its own library, not an installed one (once per path: every
    fault's copy is made at the same one)."""
    with tempfile.TemporaryDirectory() as scratch:
        where = subprocess.run(
            [sys.executable, "-c", "import dmuon_fn, custom_ops; print(dmuon_fn.__file__)"],
            cwd=tree,
            env=_env(tree, Path(scratch)),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the copy imports dmuon_fn from {where}, not from {tree}")


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """(verdict, seconds, last lines of output) for `tests` run in `tree`."""
    with tempfile.TemporaryDirectory() as scratch:
        env = _env(tree, Path(scratch))
        _check_import(tree)
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return "error (timeout)", time.monotonic() - t0, ""
        dt = time.monotonic() - t0
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        verdict = {0: "MISSED", 1: "caught"}.get(p.returncode, f"error (exit {p.returncode})")
        return verdict, dt, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only faults whose name contains this")
    ap.add_argument("--clean", action="store_true", help="check the tests pass unpatched first")
    ap.add_argument("--record", type=Path, help="write the table as Markdown here")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per fault")
    args = ap.parse_args(argv)
    faults = [f for f in FAULTS if args.k.lower() in f.name.lower()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "clean")
        base.mkdir()
        copy_tree(base)
        if args.clean:
            tests = tuple(dict.fromkeys(t for f in faults for t in f.tests))
            verdict, dt, tail = run_tests(base, tests, args.timeout)
            print(f"unpatched: {'pass' if verdict == 'MISSED' else verdict} in {dt:.0f} s")
            if verdict != "MISSED":
                print(tail)
                return 1
        for f in faults:
            tree = Path(tmp, "fault")
            shutil.copytree(base, tree)
            apply(f, tree)
            verdict, dt, tail = run_tests(tree, f.tests, args.timeout)
            shutil.rmtree(tree)
            rows.append((f, verdict, dt))
            print(f"{verdict:>16}  {dt:6.0f} s  {f.name}", flush=True)
            if verdict != "caught":
                print("    " + tail.replace("\n", "\n    "))
    caught = sum(v == "caught" for _, v, _ in rows)
    print(f"{caught} of {len(rows)} faults caught, {len(rows) - caught} not caught")
    if args.record:
        lines = ["| fault | file | tests run | verdict | s |", "|---|---|---|---|---|"]
        for f, v, dt in rows:
            by = ", ".join(f"`{t.removeprefix('tests/')}`" for t in f.tests)
            lines.append(f"| {f.name} | `{f.path}` | {by} | {v} | {dt:.0f} |")
        lines.append(f"\n{caught} of {len(rows)} caught.")
        args.record.write_text("\n".join(lines) + "\n")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
