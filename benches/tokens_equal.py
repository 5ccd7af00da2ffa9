"""Each `scripts/gpu.sh decode-builds` run's tokens against a baseline build's in the same folder.

Usage: python3 benches/tokens_equal.py BASELINE  (the runs' folder: $OUT, else /tmp/kvplan-gpu)
Prints, run by run, how many requests' tokens equal the baseline's and where each first differs.
"""
import glob
import json
import os
import sys


def tokens(path):
    return [json.loads(line)["tokens"] for line in open(path) if line.strip()]


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


folder = os.environ.get("OUT", "/tmp/kvplan-gpu")
baseline = sys.argv[1]
for path in sorted(glob.glob(f"{folder}/builds-*.jsonl")):
    build, spec, batch = os.path.basename(path)[len("builds-"):-len(".jsonl")].rsplit("-", 2)
    reference = f"{folder}/builds-{baseline}-{spec}-{batch}.jsonl"
    if build == baseline or not os.path.exists(reference):
        continue
    ours, theirs = tokens(path), tokens(reference)
    equal = sum(a == b for a, b in zip(ours, theirs))
    parts = [first_difference(a, b) for a, b in zip(ours, theirs)]
    print(f"{build}-{spec}-{batch} vs {baseline}: equal {equal}/{len(theirs)}, first difference {parts}")
