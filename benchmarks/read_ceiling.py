"""The device's read ceiling (``common.read_bandwidth``: the best read-only streaming rate), one
line for logs that quote figures against it: ``gpu_run.sh serve`` heads its results with it, so
a served step's bytes per token are set against the ceiling of the same run.

    python -m benchmarks.read_ceiling
"""

from __future__ import annotations

from benchmarks.common import read_bandwidth


def main() -> None:
    print(f"=== read ceiling {read_bandwidth()['read'] / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
