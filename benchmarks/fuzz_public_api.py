"""The fuzz suite of ``tests/unit/test_fuzz.py``, longer: thousands of generated cases over every public
entry point, classified as correct / clear / unclear / silent / hang, with the counts per class and
per entry point (the test run stops at a few hundred cases and fails on the last three classes).

    OMP_NUM_THREADS=1 python benchmarks/fuzz_public_api.py --examples 500
    python benchmarks/fuzz_public_api.py --entries compute_mis --examples 2000 --show 10

``--show K`` prints up to K distinct failures per entry point (class, message, input). The run is
derandomised (the same cases every time) unless ``--random`` is given. Exit status 1 when any case
is unclear, silent or hangs.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _load_suite():
    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("mis_fuzz_suite", REPO / "tests" / "unit" / "test_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mis_fuzz_suite"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="cases per entry point (default 500)")
    parser.add_argument("--entries", nargs="*", help="entry points to run (default: all)")
    parser.add_argument("--show", type=int, default=3, help="distinct failures printed per entry point")
    parser.add_argument("--random", action="store_true", help="fresh random cases instead of the derandomised ones")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    suite = _load_suite()
    entries = args.entries or sorted(suite.STRATEGIES)
    unknown = [e for e in entries if e not in suite.STRATEGIES]
    if unknown:
        parser.error(f"unknown entry point(s) {unknown}; valid: {', '.join(sorted(suite.STRATEGIES))}")

    print(f"# megatron-mis fuzz run, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {args.examples} cases per entry point"
          f"{' (random)' if args.random else ' (derandomised)'}")
    totals: collections.Counter[str] = collections.Counter()
    header = f"{'entry point':<30}" + "".join(f"{c:>9}" for c in suite.CLASSES) + f"{'seconds':>9}"
    rows, shown = [], []
    for entry in entries:
        counts: collections.Counter[str] = collections.Counter()
        failures: dict[tuple[str, str], str] = {}

        def on_case(case, outcome, detail, counts=counts, failures=failures):
            counts[outcome] += 1
            if outcome not in suite.GOOD:
                key = (outcome, detail.split("(")[0][:80])
                failures.setdefault(key, f"  [{entry}] {outcome}: {detail[:400]}\n      input: {case.label[:600]}")

        start = time.perf_counter()
        suite.run_entry(entry, args.examples, derandomize=not args.random, on_case=on_case)
        seconds = time.perf_counter() - start
        totals.update(counts)
        rows.append(f"{entry:<30}" + "".join(f"{counts[c]:>9}" for c in suite.CLASSES) + f"{seconds:>9.1f}")
        shown += list(failures.values())[: args.show]
        print(rows[-1], flush=True)
    print()
    print(header)
    print("\n".join(rows))
    print(f"{'total':<30}" + "".join(f"{totals[c]:>9}" for c in suite.CLASSES))
    if shown:
        print("\nFailures (distinct kinds, up to --show per entry point):")
        print("\n".join(shown))
    return 1 if any(totals[c] for c in suite.CLASSES if c not in suite.GOOD) else 0


if __name__ == "__main__":
    sys.exit(main())
