"""The suite's environment, set when pytest imports this file: before any test module imports
dmuon_fn or torch, and before the ranks' fork server (tests/_dist.py) starts and copies it.

- Every `DMUON_*` variable of the caller is removed (a `DMUON_NS_KERNEL` exported in the shell
  must not change what the tests check). Tests that need one set it themselves (monkeypatch).
- Every cache the tests fill is a fresh directory for this session, removed at its end:
  `DMUON_CACHE_DIR` (custom_ops' kernel caches), `TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`,
  `XDG_CACHE_HOME` (torch's hub and other ~/.cache defaults), `MPLCONFIGDIR` (matplotlib's
  ~/.config/matplotlib) and hypothesis's storage, example database included. Nothing lands in
  $HOME, the working tree (no .hypothesis/) or inductor's shared default, and no cache left by
  an earlier run can hide a cold-cache fault. The directory is made under $TMPDIR; pytest's
  header names it. This holds under CI's own fresh caches too.
- DMUON_TEST_KEEP_CACHES=1 keeps the caller's caches instead (DMUON_CACHE_DIR included, and
  inductor's, triton's and XDG's, set or default): a warm inductor cache for a quick rerun. The
  hypothesis storage stays in the session's directory either way.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

KEEP_CACHES = os.environ.get("DMUON_TEST_KEEP_CACHES", "") not in ("", "0")

_kept = {"DMUON_CACHE_DIR": os.environ.get("DMUON_CACHE_DIR")} if KEEP_CACHES else {}
for _name in [n for n in os.environ if n.startswith("DMUON_")]:
    del os.environ[_name]
os.environ.update({k: v for k, v in _kept.items() if v is not None})

SESSION_DIR = Path(tempfile.mkdtemp(prefix="dmuon-tests-"))
_OWNER = os.getpid()


@atexit.register  # registered before torch is imported, so it runs after torch's exit hooks
def _remove_session_dir() -> None:
    if os.getpid() == _OWNER:  # not in a forked child that exits through atexit
        shutil.rmtree(SESSION_DIR, ignore_errors=True)


if not KEEP_CACHES:
    for _name, _sub in [
        ("DMUON_CACHE_DIR", "dmuon"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("TRITON_CACHE_DIR", "triton"),
        ("XDG_CACHE_HOME", "xdg"),
        ("MPLCONFIGDIR", "matplotlib"),  # the main job's plot (tests/test_examples.py)
    ]:
        os.environ[_name] = str(SESSION_DIR / _sub)

# Hypothesis: its storage (read from the variable by subprocesses too) and the example database.
os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = str(SESSION_DIR / "hypothesis")

from hypothesis import settings  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

set_hypothesis_home_dir(SESSION_DIR / "hypothesis")
settings.register_profile(
    "dmuon-tests",
    database=DirectoryBasedExampleDatabase(SESSION_DIR / "hypothesis" / "examples"),
)
settings.load_profile("dmuon-tests")


def pytest_report_header(config) -> str:
    caches = "the caller's" if KEEP_CACHES else "fresh"
    return f"dmuon_fn tests: session directory {SESSION_DIR} ({caches} caches, DMUON_* cleared)"
