"""Tests that need torchtpu's C++ hooks: where the hooks cannot be built, such a test skips and
says why, unless ``TORCHTPU_REQUIRE_NATIVE=1`` (CI sets it) asks for them: then it fails, so a
broken build cannot pass as a skipped test."""

from __future__ import annotations

import pytest

from torchtpu.config import config
from torchtpu.runtime import native


def skip_without_native(reason: str) -> None:
    """Skip the running test for ``reason`` (the hooks are missing), or fail it where they are required."""
    if config.require_native:
        pytest.fail(f"{reason} (TORCHTPU_REQUIRE_NATIVE=1 requires them)")
    pytest.skip(reason)


def native_hooks_needed():
    """A mark: skip without the hooks, unless they are required (then the test runs, and fails)."""
    return pytest.mark.skipif(not native.registered() and not config.require_native,
                              reason=f"torchtpu's C++ hooks are not built here: {native.unavailable_reason()}")
