"""Run conformance entries and print their results, without touching results.json or the report.

    python tools/check_entries.py eager_float32 'special\\.bessel_.*'
    python tools/check_entries.py backward_float32 gather --traceback

For working on an op: the sweep (``tools/op_coverage.py``) records results; this only shows them.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "conformance"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", help="a mode of the harness, e.g. eager_float32, module_backward")
    parser.add_argument("entries", help="regular expression an entry name must match in full")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback of a failure")
    args = parser.parse_args()
    import harness

    names = [n for n in harness.entries_for(args.mode) if re.fullmatch(args.entries, n)]
    if not names:
        parser.error(f"no entry of {args.mode} matches {args.entries!r}")
    failed = 0
    for name in names:
        result = harness.run_entry(name, args.mode)
        failed += result.status in ("fail", "cpu-fallback")
        print(f"{result.status:12} {name}  {result.error}")
        if args.traceback and result.status != "pass":
            print(harness.format_traceback(name, args.mode))
    print(f"{len(names) - failed}/{len(names)} not failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
