"""False-alarm sweep: healthy pairs dumped with every op recorded (``ops="*"``), judged by the
verdict. Not a timed test.

    python scripts/sweep_ops.py [--archs ...|--set held-out] [--precisions bfloat16,float16]
                                [--seeds 3] [--steps 1] [--jobs 2]

Per architecture (``tests/architectures.py``; Hugging Face models switched to eager attention,
so that a softmax is an op of its own), A float32 against B under each autocast precision, the
same weights and batch, both dumped with ``params=True`` (so that what needs B's weights, as
a bias gradient's recomputation, is judged too), no error planted: every failing row is a
false alarm. Printed per
pair: the verdict's first line and the failing rows (a pair that agrees "as far as two dumps
can tell" bounds what could hide; one that "may diverge" has an outlier it cannot judge). At
the end: the totals, every false alarm, and per class (an op's name) and kind the recomputed
records and the largest ratio of ``recomputed_rel_err`` to its ``recomputed_allowance`` (what
rounding explains): how close a healthy call comes to being called miscomputed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import architectures  # noqa: E402
from architectures import ARCHITECTURES, HELD_OUT, cannot_run, run_step  # noqa: E402
from compare import compare_dumps, summarize  # noqa: E402
from compare.status import FAILING  # noqa: E402


def _eager(build):
    """``build`` with a Hugging Face model's attention switched to eager code."""
    def built(*args, **kwargs):
        model, batch = build(*args, **kwargs)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "eager"
        return model, batch
    return built


def run_pair(arch: str, precision: str, seed: int, steps: int, tmp: Path) -> dict:
    """One healthy pair's verdict, failing rows and per-op margins."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    architectures.build = _eager(architectures.build)
    why = cannot_run(arch, precision)
    if why:
        return {"pair": f"{arch} {precision}", "skipped": why}
    root = tmp / f"{arch}-{precision}-{seed}-{steps}"
    common = dict(seed=seed, steps=steps, optimizer="adamw")
    run_step(arch, "float32", root / "a", dumper_options={"ops": "*", "params": True}, **common)
    run_step(arch, precision, root / "b", dumper_options={"ops": "*", "params": True}, **common)
    result = compare_dumps(root / "a", root / "b")
    summary = summarize(result)
    failing = result[result["status"].isin(list(FAILING))]
    recomputed = result[result["recomputed_rel_err"].notna()]
    ops = recomputed.assign(ratio=recomputed["recomputed_rel_err"] / recomputed[
        "recomputed_allowance"]).groupby(["cls", "kind"])["ratio"].agg(["count", "max"])
    return {"pair": f"{arch} {precision} seed={seed} steps={steps}",
            "verdict": summary.verdict().splitlines()[0], "cannot_tell": summary.cannot_tell,
            "outliers": summary.cannot_tell and not summary.outliers.empty,
            "failing": [f"{r.module} {r.kind}[{r['index']}]: {r.reason}"
                        for _, r in failing.iterrows()],
            "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="", help="default: every architecture of --set")
    parser.add_argument("--set", choices=("all", "tuning", "held-out"), default="all")
    parser.add_argument("--precisions", default="bfloat16,float16")
    parser.add_argument("--seeds", default="3")
    parser.add_argument("--steps", default="1", help="dump the last of this many AdamW steps")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    archs = args.archs.split(",") if args.archs else [
        a for a in ARCHITECTURES if args.set == "all" or (a in HELD_OUT) == (args.set == "held-out")]
    cases = [(a, p, int(s), int(k)) for a in archs for p in args.precisions.split(",")
             for s in args.seeds.split(",") for k in args.steps.split(",")]
    alarms, undecided, outliers, worst = [], 0, 0, {}
    with tempfile.TemporaryDirectory() as tmp, cf.ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_pair, *case, Path(tmp)) for case in cases]
        for future in futures:
            out = future.result()
            if "skipped" in out:
                print(f"{out['pair']}: skipped ({out['skipped']})", flush=True)
                continue
            print(f"{out['pair']}: {out['verdict']}", flush=True)
            for line in out["failing"]:
                print(f"    FALSE ALARM {line}")
            alarms += [f"{out['pair']}: {line}" for line in out["failing"]]
            undecided += out["cannot_tell"]
            outliers += out["outliers"]
            for key, row in out["ops"].iterrows():
                count, largest = worst.get(key, (0, 0.0))
                worst[key] = (count + int(row["count"]), max(largest, float(row["max"])))
    print(f"\n{len(cases)} pairs: {len(alarms)} false alarms, {undecided} 'cannot tell' "
          f"({outliers} with an outlier: 'may diverge')")
    print("largest recomputed_rel_err of a healthy record over its recomputed_allowance:")
    for (op, kind), (count, largest) in sorted(worst.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:24s} {kind:10s} {count:6d} records  {largest:5.2f}")
    for line in alarms:
        print(f"FALSE ALARM {line}")


if __name__ == "__main__":
    main()
