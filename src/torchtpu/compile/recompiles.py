"""Why a function was recompiled: dynamo's guard-failure reasons, retrievable by API."""

from __future__ import annotations

def recompile_reasons() -> list[dict[str, str]]:
    """One entry per recompilation: the function (name, file:line) and the failed guard."""
    from torch._dynamo.utils import guard_failures

    reasons = []
    for code, failures in list(guard_failures.items()):
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        reasons.extend({"function": where, "reason": str(r)} for r in failures)
    return reasons


def clear_recompile_reasons() -> None:
    from torch._dynamo.utils import guard_failures

    guard_failures.clear()
