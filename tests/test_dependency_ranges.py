"""``pyproject.toml``'s version ranges are promises: each is bounded above, and the releases this
process runs with are inside them (CI installs the newest each range allows, so its run tests the
upper end; ``tools/torch_compat.sh VERSION`` with ``JAX=...`` tests the older ones)."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEPENDENCIES = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
# the libraries whose internals torchtpu reaches (private APIs, plugin points): an unbounded range
# would promise releases nobody has run
BOUNDED = ("torch", "jax")


@pytest.mark.parametrize("name", BOUNDED)
def test_range_has_an_upper_bound(name):
    (req,) = [r for r in DEPENDENCIES if r.name == name]
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier), (
        f"pyproject.toml: {req} has no upper bound; add the first release not yet tested")


@pytest.mark.parametrize("req", DEPENDENCIES, ids=lambda r: r.name)
def test_installed_release_is_in_range(req):
    installed = Version(md.version(req.name))
    assert req.specifier.contains(installed, prereleases=True), (
        f"{req.name} {installed} is outside pyproject.toml's {req}")


@pytest.mark.parametrize("page", ["docs/compatibility.md", "README.md"])
def test_compatibility_names_the_tested_jax_releases(page):
    """The Compatibility section of docs/compatibility.md (the table) and of the README (its
    pointer to the table) names the jax releases the range was run with."""
    text = (ROOT / page).read_text()
    section = text.split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    (req,) = [r for r in DEPENDENCIES if r.name == "jax"]
    named = {Version(v) for v in __import__("re").findall(r"jax (\d+\.\d+\.\d+)", section)}
    assert named and all(req.specifier.contains(v) for v in named), (page, named, str(req))
    assert Version(md.version("jax")) in named, f"the jax CI runs is not named in {page}"
    if page == "docs/compatibility.md":  # the table's page also names the lower bound it was run on
        lowest = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert lowest and lowest[0] in named, f"{page} does not name jax {lowest}, the lower bound, as run"


def test_the_cpu_compile_flags_cover_exactly_the_jax_range():
    """``runtime/state.py`` sets XLA:CPU flags only for the jaxlib releases it knows have them (XLA
    aborts on an unknown flag): widening pyproject's jax range must revisit that range too."""
    from torchtpu.runtime import state

    (req,) = [r for r in DEPENDENCIES if r.name == "jax"]
    low, high = state._FLAGS_KNOWN
    assert {(s.operator, s.version) for s in req.specifier} == {
        (">=", ".".join(map(str, low))), ("<", ".".join(map(str, high)))}, (
        f"pyproject.toml's {req} against runtime/state.py's _FLAGS_KNOWN {state._FLAGS_KNOWN}: check that "
        "every jaxlib in the new range knows CPU_COMPILE_FLAGS, then update _FLAGS_KNOWN")
