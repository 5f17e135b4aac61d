"""Ending what a test started, all of it.

torchrun starts each worker in a session of its own, so killing the launcher's process group
leaves the workers running (and holding the output pipe the test reads). ``kill_tree`` finds
every descendant first, through ``/proc``, then kills them all.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), found through /proc."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": state, ppid, ...
        parent_of[int(entry.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parent_of.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of ``pid``, wherever its session."""
    below = descendants(pid)
    for kill, target in [(os.killpg, pid), *((os.kill, p) for p in below)]:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
