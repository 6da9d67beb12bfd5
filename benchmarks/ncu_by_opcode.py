"""Nsight Compute's per-instruction counters of one kernel, summed per opcode (CPU only).

Reads the CSV that ``benchmarks/ncu_source.sh`` writes (``sass_<kernel>.csv``: the source page of the
report, one row per SASS instruction) and prints, per opcode, the instructions executed, shared-memory
wavefronts and global tag requests per unit of work, and each opcode's share of the stall samples
(all, and by reason). ``--units``: what to divide the counts by, e.g. the warp-chunks of 32 elements
of the apply pass (354.8 M elements / 32 for GPT-2 medium). ``--top N`` also lists the N instructions
with the most stall samples, at their offsets in the kernel: where a warp waits, e.g. the first use of a
loaded value that the next loads are issued after.

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


def instruction_rows(path: str) -> tuple[dict, list]:
    """The CSV's column indices and its rows of SASS instructions (those with an address)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, row in enumerate(rows) if "Source" in row and "Address" in row)
    column = {name: i for i, name in enumerate(rows[header])}
    return column, [row for row in rows[header + 1:]
                    if len(row) == len(rows[header]) and row[column["Address"]].startswith("0x")]


def by_opcode(path: str) -> tuple[dict, collections.Counter]:
    column, rows = instruction_rows(path)
    per_opcode: dict = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for row in rows:
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
    parser.add_argument("--top", type=int, default=0, help="also list the N instructions with the most stall samples")
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
    if args.top:
        print_top_stalls(args.csv, args.top, args.units)
    return 0


def print_top_stalls(path: str, count: int, units: float) -> None:
    """The ``count`` instructions with the most stall samples: offset from the kernel's first
    instruction, share of all samples, the two largest reasons, executions per unit, the instruction."""
    column, rows = instruction_rows(path)
    first = int(rows[0][column["Address"]], 16)
    samples = sum(value(row[column[SAMPLES]]) for row in rows) or 1.0
    reasons = [name for name in STALLS if name in column]
    print(f"\n# the {count} instructions with the most stall samples")
    for row in sorted(rows, key=lambda row: -value(row[column[SAMPLES]]))[:count]:
        top = sorted(reasons, key=lambda name: -value(row[column[name]]))[:2]
        why = ", ".join(f"{name[6:]} {100 * value(row[column[name]]) / samples:.1f}%" for name in top)
        print(f"{int(row[column['Address']], 16) - first:#07x} {100 * value(row[column[SAMPLES]]) / samples:6.2f}% "
              f"({why}) x{value(row[column['Instructions Executed']]) / units:.2f}  {row[column['Source']].strip()}")


if __name__ == "__main__":
    raise SystemExit(main())
