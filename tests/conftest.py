"""Shared test set-up: 4 XLA:CPU devices (for multi-device tests) and the tpu device."""

import os

# Must be set before JAX initialises its CPU client.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TORCHTPU_PLATFORM", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402,F401


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
