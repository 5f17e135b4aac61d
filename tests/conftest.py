"""Shared test set-up: 4 XLA:CPU devices (for multi-device tests) and the tpu device.

XLA:CPU runs its matmuls single-threaded here. Its multi-threaded Eigen contractions are not
bit-reproducible on every CPU (measured on an AMD EPYC host: a training run resumed from a
checkpoint differed from the uninterrupted one in the last bit at a later step, and matched with
one thread), and the whole-program tests require a resumed run to repeat the uninterrupted one
exactly.
"""

import os

# Must be set before JAX initialises its CPU client (subprocesses the tests start inherit them).
_FLAGS = ("--xla_force_host_platform_device_count=4", "--xla_cpu_multi_thread_eigen=false")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *(
    flag for flag in _FLAGS if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""))]).strip()
os.environ.setdefault("TORCHTPU_PLATFORM", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402,F401


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default, pyproject.toml): a worker per core, at most 4. Each worker holds
    its own JAX runtime of 4 XLA:CPU devices, and the torchrun tests start more processes."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` (the default), tests are spread one by one over the workers, but
    the tests of a file that share a module- or session-scoped fixture (a server, a warm cache, one
    multi-process launch) stay together, so that the fixture runs once."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = info and any(d.scope in ("module", "package", "session") and d.baseid  # not a plugin's
                              for defs in info.name2fixturedefs.values() for d in defs)
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def no_fallback():
    """Run a test with the CPU fallback off, so a missing lowering fails loudly."""
    with torch.tpu.cpu_fallback_enabled(False):
        yield


EAGER_MODES = ["DEFER_NEVER", "DEFER_AND_FUSE"]


@pytest.fixture(params=EAGER_MODES)
def each_eager_mode(request):
    """Run a test once per eager mode (``pytestmark = pytest.mark.usefixtures("each_eager_mode")``)."""
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, request.param)):
        yield request.param


@pytest.fixture(autouse=True)
def _no_index_error_across_tests():
    """An out-of-bounds index is raised at the next synchronisation (ops/checks.py), which may be
    another test's on this worker: each test starts with no pending index check."""
    from torchtpu.ops import checks

    checks.discard_pending()
    yield
