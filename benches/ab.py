"""The Burn 0.21 / 0.22 A/B table from `scripts/gpu.sh ab`'s bench outputs.

Usage: python3 benches/ab.py DIR (holding ab-{gather,plan,canary}-{021,022}-{round}.txt).
Per row: GPU us per call of each build, the mean of the rounds, and 0.22's change; rows where
0.22 is more than 3% slower are marked.
"""

import glob
import os
import re
import sys


def rows(path):
    """{label: GPU us} of one bench output (markdown rows with a number in the GPU column)."""
    found = {}
    for line in open(path, errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"[0-9.]+", cells[1]):
            continue
        # 0.21 called the deferred gathers "capacity".
        label = cells[0].replace("capacity", "deferred")
        found[label] = float(cells[1])
    return found


def main(folder):
    print("| op, shape, mode | 0.21 GPU us | 0.22 GPU us | 0.22 / 0.21 |")
    print("|---|---:|---:|---:|")
    slower = 0
    for which in ("gather", "plan", "canary"):
        runs = {"021": [], "022": []}
        for version in runs:
            for path in sorted(glob.glob(os.path.join(folder, f"ab-{which}-{version}-*.txt"))):
                runs[version].append(rows(path))
        if not runs["021"] or not runs["022"]:
            continue
        for label in runs["022"][0]:
            old = [r[label] for r in runs["021"] if label in r]
            new = [r[label] for r in runs["022"] if label in r]
            if not old or not new:
                continue
            a, b = sum(old) / len(old), sum(new) / len(new)
            ratio = b / a if a > 0 else float("nan")
            mark = " (slower)" if ratio > 1.03 else ""
            slower += ratio > 1.03
            print(f"| {label} | {a:.2f} | {b:.2f} | {ratio:.3f}{mark} |")
    print(f"rows more than 3% slower on 0.22: {slower}")


if __name__ == "__main__":
    main(sys.argv[1])
