"""The engines' private members torchtpu relies on (``torchtpu.integrations.contracts``) exist, with
the parameters torchtpu expects, in the installed release.

Runs in each engine's venv (``tools/integration_tests.sh`` selects ``test_vllm_*`` in vLLM's and
``test_sglang_*`` in SGLang's); skipped where the engine is not installed, as in the default suite.
"""

from __future__ import annotations

import importlib.util

import pytest

from torchtpu.integrations import contracts


def _needs(engine: str):
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed: its contract is checked in its venv by tools/integration_tests.sh")
    if engine == "sglang":
        import os

        os.environ.setdefault("SGLANG_PLATFORM", "tpu")  # before sglang resolves its platform


def _ids(members):
    return [m.id for m in members]


def _check_all(engine: str, member):
    _needs(engine)
    problem = contracts.check(member)
    assert problem is None, f"{problem} ({member.why}); update torchtpu for this {engine} release, then contracts.py"


@pytest.mark.parametrize("member", contracts.VLLM, ids=_ids(contracts.VLLM))
def test_vllm_contract(member):
    _check_all("vllm", member)


@pytest.mark.parametrize("member", contracts.SGLANG, ids=_ids(contracts.SGLANG))
def test_sglang_contract(member):
    _check_all("sglang", member)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_source_contract(engine):
    _needs(engine)
    problems = [p for path, pattern, _ in contracts.SOURCES[engine] if (p := contracts.check_source(path, pattern))]
    assert not problems, problems


def test_vllm_overrides_are_in_the_contract():
    _needs("vllm")
    assert not contracts.unlisted_overrides("vllm")


def test_sglang_overrides_are_in_the_contract():
    _needs("sglang")
    assert not contracts.unlisted_overrides("sglang")
