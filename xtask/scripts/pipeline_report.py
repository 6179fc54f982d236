"""The report of gpu_pipeline_check.sh: per case, the single trainer against the pipeline on
its GPU (and, where it ran, the pipeline with the target on another GPU): losses bitwise,
samples/s, each side's waits; writes OUT/pipeline.json with date, device and commit, prints a
table, and exits 1 when a case fails.
usage: pipeline_report.py WORK OUT BUNDLE CASE..."""
import datetime
import json
import os
import statistics
import subprocess
import sys

# The pipeline may be this much slower and still count as "no lower": the run-to-run spread
# of one configuration on a shared machine.
SPREAD = 0.02
# Steps before the median of samples/s (compilation, allocation, the pipeline filling).
WARMUP_STEPS = 4

work, out, bundle = sys.argv[1:4]
names = sys.argv[4:]


def train(path):
    return [v for v in map(json.loads, open(f"{work}/{path}/metrics.jsonl")) if v["kind"] == "train"]


def rate(lines):
    return statistics.median(v["samples_per_s"] for v in lines[WARMUP_STEPS:])


def against(single, name, topology):
    """The pipeline run `topology` of case `name` against the single trainer's lines."""
    lines = train(f"{name}/{topology}")
    same = sum(a["loss"] == b["loss"] for a, b in zip(single, lines))
    waits = [(v["drafters_waited_s"], v["targets_waited_s"]) for v in lines[WARMUP_STEPS:]]
    ratio = rate(lines) / rate(single)
    return {
        "losses_bitwise_equal": same,
        "samples_per_s": rate(lines),
        "ratio": ratio,
        "drafters_waited_s_per_step": statistics.median(w[0] for w in waits),
        "targets_waited_s_per_step": statistics.median(w[1] for w in waits),
        "ok": same == len(single) == len(lines) and ratio >= 1 - SPREAD,
    }


def case(name):
    single = train(f"{name}/single")
    runs = {t: against(single, name, t) for t in ("pipeline", "apart") if os.path.isdir(f"{work}/{name}/{t}")}
    return {
        "steps": len(single),
        "single_samples_per_s": rate(single),
        "first_loss": single[0]["loss"],
        "last_loss": single[-1]["loss"],
        **runs,
        "ok": "pipeline" in runs and all(r["ok"] for r in runs.values()),
    }


device = subprocess.run(
    ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
).stdout.strip()
cases = {name: case(name) for name in names}
result = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": device,
    "commit": open(f"{bundle}/commit.txt").read().strip(),
    "cases": cases,
}
json.dump(result, open(f"{out}/pipeline.json", "w"), indent=1)
print(f"{'case':<10} {'topology':<9} {'equal':>6} {'single/s':>9} {'pipeline/s':>10} {'ratio':>6} {'drafter waited':>15} {'target waited':>14}")
for name, c in cases.items():
    for topology in ("pipeline", "apart"):
        if topology not in c:
            continue
        r = c[topology]
        print(
            f"{name:<10} {topology:<9} {r['losses_bitwise_equal']:>3}/{c['steps']:<2} {c['single_samples_per_s']:>9.2f} "
            f"{r['samples_per_s']:>10.2f} {r['ratio']:>6.3f} {r['drafters_waited_s_per_step']:>13.3f} s "
            f"{r['targets_waited_s_per_step']:>12.3f} s"
        )
sys.exit(0 if all(r["ok"] for r in cases.values()) else 1)
