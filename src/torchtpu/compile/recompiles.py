"""Why a function was recompiled: dynamo's guard-failure reasons, retrievable by API."""

from __future__ import annotations

def recompile_reasons() -> list[dict[str, str]]:
    """One entry per recompilation: the function (name, file:line) and the failed guard."""
    from torchtpu.runtime.compat import guard_failures

    reasons = []
    for code, failures in list(guard_failures.items()):
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        reasons.extend({"function": where, "reason": str(r)} for r in failures)
    return reasons


def clear_recompile_reasons() -> None:
    from torchtpu.runtime.compat import guard_failures

    guard_failures.clear()
    _counted.clear()


_counted: dict = {}  # code object → guard failures already counted in torchtpu.metrics


def count_new() -> None:
    """Count, in ``torchtpu.metrics``, the recompilations dynamo recorded since the last call.

    Called when dynamo hands the backend a graph: a recompilation's failed guard is recorded by
    then.
    """
    from torchtpu import metrics
    from torchtpu.runtime.compat import guard_failures

    for code, failures in list(guard_failures.items()):
        seen = _counted.get(code, 0)
        for reason in failures[seen:]:
            metrics.count_recompile(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})", str(reason))
        _counted[code] = len(failures)
