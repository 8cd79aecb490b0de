"""Shared fixtures: every test runs against a private cache dir (builds, calibration, DB) with a
fixed calibration, so plans are deterministic and nothing touches the user's cache."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# One build cache for the run: pytest-xdist's workers inherit it from the controller, which loads
# this file first, so a kernel one worker built is not built again by the other. A test that runs
# the suite again in a subprocess (test_portable.py) names the cache it reads back. The tuning DB
# stays each process's own: a test that counts rows must not see the other worker's.
# Whoever makes a directory removes it when it exits (the controller outlives its workers).
def _own_temp_dir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_CACHE = os.environ.get("AURAKERNEL_TEST_CACHE_DIR") or _own_temp_dir("aurakernel-tests-")
os.environ["AURAKERNEL_TEST_CACHE_DIR"] = os.environ["AURAKERNEL_CACHE_DIR"] = _CACHE
os.environ["AURAKERNEL_DB"] = str(Path(_own_temp_dir("aurakernel-db-")) / "tuning.sqlite")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# The two xdist workers share two cores, and each one's OpenMP threads (torch's, our kernels') spun
# at every barrier while the other worker held a core: idle threads now sleep instead. Set before
# any worker loads libgomp (it reads the policy once); the suite took 16.7 min with spinning, 12.2
# without. Tests only: a lone process (train, bench) keeps the default, which answers faster.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from aurakernel.hardware import calibration_path  # noqa: E402
from aurakernel.paths import write_text_atomic  # noqa: E402

FIXED_CALIBRATION = {
    "stream_gbps": {"1": 10.0, "2": 18.0},
    "call_overhead_us": 1.0,
    "fork_overhead_us": 2.0,
    "peak_tflops": {"fp32": 0.2, "bf16": 0.5, "fp16": 0.5},
}
write_text_atomic(calibration_path(), json.dumps(FIXED_CALIBRATION))   # workers share it

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "trainer" / "configs" / "tiny.yaml")
AURAKERNEL = [sys.executable, "-m", "aurakernel.cli"]


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "tuning.sqlite")


@pytest.fixture(scope="session")
def host():
    from aurakernel.hardware import host_profile
    return host_profile()


# `make test` runs two pytest-xdist workers with --dist loadgroup. A module's tests stay on one
# worker (its module-scoped fixtures, e.g. the quick bench run or a trained model, are built once),
# except in modules that set SPREAD_TESTS = True: independent, long tests (the emulator's kernel
# cases) that go to whichever worker is free.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if not getattr(item.module, "SPREAD_TESTS", False):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
