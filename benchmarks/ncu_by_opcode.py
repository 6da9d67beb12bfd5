"""Nsight Compute's per-instruction counters of one kernel, summed per opcode (CPU only).

Reads the CSV that ``benchmarks/ncu_source.sh`` writes (``sass_<kernel>.csv``: the source page of the
report, one row per SASS instruction) and prints, per opcode, the instructions executed, shared-memory
wavefronts and global tag requests per unit of work, and each opcode's share of the stall samples
(all, and by reason). ``--units``: what to divide the counts by, e.g. the warp-chunks of 32 elements
of the apply pass (354.8 M elements / 32 for GPT-2 medium).

    python benchmarks/ncu_by_opcode.py sass_small_fc_lopt_apply.csv --units 11087500 --label "fast, GPT-2 medium"
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

COUNTS = ("Instructions Executed", "L1 Wavefronts Shared", "L1 Tag Requests Global")
STALLS = ("stall_long_sb", "stall_short_sb", "stall_mio", "stall_wait", "stall_math", "stall_not_selected",
          "stall_selected", "stall_dispatch", "stall_branch_resolving", "stall_barrier", "stall_lg")
SAMPLES = "Warp Stall Sampling (All Samples)"
OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def value(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def by_opcode(path: str) -> tuple[dict, collections.Counter]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, row in enumerate(rows) if "Source" in row and "Address" in row)
    column = {name: i for i, name in enumerate(rows[header])}
    per_opcode: dict = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for row in rows[header + 1:]:
        match = OPCODE.match(row[column["Source"]].strip())
        if not match:
            continue
        for name in (*COUNTS, SAMPLES, *STALLS):
            if name in column:
                amount = value(row[column[name]])
                per_opcode[match.group(1)][name] += amount
                totals[name] += amount
    return per_opcode, totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="sass_<kernel>.csv from benchmarks/ncu_source.sh")
    parser.add_argument("--units", type=float, default=1.0, help="divide the counts by this many units of work")
    parser.add_argument("--label", default="", help="a line saying what was profiled")
    args = parser.parse_args()
    per_opcode, totals = by_opcode(args.csv)
    samples = totals[SAMPLES] or 1.0
    print(f"# {args.label}: counts per unit ({args.units:g} units); stalls in % of all samples")
    print("# totals: " + ", ".join(f"{name} {totals[name] / args.units:.1f}" for name in COUNTS)
          + "; " + ", ".join(f"{name[6:]} {100 * totals[name] / samples:.1f}%" for name in STALLS if totals[name]))
    print(f"{'opcode':40s} {'inst':>7s} {'shWF':>7s} {'tagG':>7s} {'stall%':>7s} {'longsb':>7s} {'shortsb':>7s} "
          f"{'wait':>6s} {'notsel':>6s}")
    for opcode, c in sorted(per_opcode.items(), key=lambda item: -item[1][SAMPLES]):
        if c["Instructions Executed"] / args.units < 0.5:
            continue
        print(f"{opcode:40s} {c[COUNTS[0]] / args.units:7.1f} {c[COUNTS[1]] / args.units:7.1f} "
              f"{c[COUNTS[2]] / args.units:7.1f} {100 * c[SAMPLES] / samples:7.2f} "
              f"{100 * c['stall_long_sb'] / samples:7.1f} {100 * c['stall_short_sb'] / samples:7.1f} "
              f"{100 * c['stall_wait'] / samples:6.1f} {100 * c['stall_not_selected'] / samples:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
