"""Benchmark: does the verdict name the module where an error was planted, and stay quiet on
healthy pairs? Not a timed test.

    python scripts/bench_localize.py [--archs llama,gpt2,...] [--plants 4] [--seed 0]

For every architecture of ``tests/architectures.py`` (Hugging Face models from tiny configs,
a torchvision-style ResNet, an LSTM, a deep residual MLP) and every variant

    same      A float32,  B float32,                         plant 1e-3
    fp64      A float64,  B float32,                         plant 3e-2 and 1e-3
    bf16      A float32,  B bfloat16 autocast (CPU),         plant 0.1
    fp16      A float32,  B float16 autocast (CPU),          plant 3e-2
    gpu       A float32 on the CPU, B float32 on CUDA,       plant 1e-3    (--variants ...)
    tf32      as gpu, with TF32 matmuls,                     plant 3e-2
    gpu-bf16  A float32 on the CPU, B bfloat16 autocast on CUDA, plant 0.1

it dumps a training step (the last of --steps) of A, of a healthy B and of B with an error
planted by
``dumper.perturb`` in a random module (forward: its output scaled by 1 + plant; backward: the
gradient arriving at its outputs scaled). A plant is *visible* when it changes the planted
module's output (gradient) by at least half the plant and by more than A and the healthy B
differ there; one that changes it by half the plant but less than that difference is *below
the noise* (it cannot stand out from two dumps alone); it is *localized* when the first
divergence of A vs planted B names the planted module or one of its submodules (or names a
record of the same tensor, e.g. the output of a Linear that a Dropout(p=0) returns). Printed per
variant and direction: localized k/n (misses listed with what was named instead), the median
number of failing rows per plant (quietness), and false alarms on the healthy pairs; and per
architecture whether an identical rerun is all ``equal``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from architectures import ARCHITECTURES, build, run_step  # noqa: E402
from compare import compare_dumps, summarize  # noqa: E402
from compare.status import FAILING  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Variant:
    """A on the CPU at precision ``a``; B at precision ``b`` on ``device`` (with TF32 float32
    matmuls if ``tf32``); errors of each relative size in ``sizes`` planted in B."""

    a: str
    b: str
    sizes: tuple
    device: str = "cpu"
    tf32: bool = False


VARIANTS = {
    "same": Variant("float32", "float32", (1e-3,)),
    "fp64": Variant("float64", "float32", (3e-2, 1e-3)),
    "bf16": Variant("float32", "bfloat16", (0.1,)),
    "fp16": Variant("float32", "float16", (3e-2,)),
    # on an accelerator (--variants gpu,tf32,gpu-bf16): CPU against CUDA
    "gpu": Variant("float32", "float32", (1e-3,), "cuda"),
    "tf32": Variant("float32", "float32", (3e-2,), "cuda", tf32=True),
    "gpu-bf16": Variant("float32", "bfloat16", (0.1,), "cuda"),
}
CPU_VARIANTS = ("same", "fp64", "bf16", "fp16")
DIRECTIONS = {"forward": "output", "backward": "grad_output"}


@contextlib.contextmanager
def _tf32(enabled: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _quiet_transformers() -> None:
    warnings.filterwarnings("ignore")
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _visibility(healthy: Path, planted: Path, reference: Path, module: str, where: str,
                size: float) -> str:
    """``"visible"`` when the plant changes the planted module's record by at least half its
    size and by more than A and the healthy B differ there (the noise it must stand out of),
    ``"noise"`` when it changes it by half its size but not more than that noise, else
    ``"invisible"`` (the record does not exist, or the plant barely changes it)."""
    def error_at(a: Path, b: Path) -> float:
        rows = compare_dumps(a, b)
        rows = rows[(rows["module"] == module) & (rows["kind"] == where)]
        return float(rows["rel_l2_err"].max()) if len(rows) else 0.0
    change = error_at(healthy, planted)
    if change < size / 2:
        return "invisible"
    return "visible" if change > error_at(reference, healthy) else "noise"


def _localized(first, module: str) -> bool:
    """The first divergence, or a record of the same tensor, is in ``module`` or under it."""
    named = [first.row["module"], *first.aliases.get("module", [])]
    return any(module == "" or m == module or m.startswith(module + ".") for m in named)


def run(archs: list[str], variants: list[str], plants: int, seed: int, tmp: Path,
        steps: int = 1) -> dict:
    rng = random.Random(seed)
    outcome = {"plants": [], "healthy": [], "reruns": [], "unsupported": []}
    for arch in archs:
        modules = [p for p, _ in build(arch, "float32")[0].named_modules()]
        run_step(arch, "float32", tmp / f"{arch}-rerun", steps=steps)
        run_step(arch, "float32", tmp / f"{arch}-rerun-b", steps=steps)
        rerun = compare_dumps(tmp / f"{arch}-rerun", tmp / f"{arch}-rerun-b")
        differ = rerun[rerun["status"] != "equal"]
        outcome["reruns"].append((arch, differ.empty))
        for r in differ.head(3).itertuples():
            print(f"  rerun of {arch} differs: {r.module or '<root>'} {r.kind}[{r.index}] "
                  f"{r.status} {r.rel_error:.3g}", file=sys.stderr)
        for variant in variants:
            v = VARIANTS[variant]

            def run_b(path: Path, **kwargs) -> None:
                with _tf32(v.tf32):
                    run_step(arch, v.b, path, device=v.device, steps=steps, **kwargs)
            a, b = tmp / f"{arch}-{v.a}", tmp / f"{arch}-{variant}-b"
            try:
                if not a.exists():
                    run_step(arch, v.a, a, steps=steps)
                run_b(b)
            except RuntimeError as exc:  # e.g. oneDNN's LSTM under float16 autocast on CPU
                outcome["unsupported"].append(f"{arch} {variant}: {str(exc).splitlines()[0]}")
                continue
            healthy = summarize(compare_dumps(a, b))
            outcome["healthy"].append((variant, arch, healthy))
            for size in v.sizes:
                for k in range(plants):
                    direction = ("forward", "backward")[k % 2]
                    module = rng.choice(modules)
                    where = DIRECTIONS[direction]
                    planted = tmp / f"{arch}-{variant}-{size}-{k}"
                    run_b(planted, plant={"include": [module], "where": where, "scale": 1 + size})
                    visibility = _visibility(b, planted, a, module, where, size)
                    result = compare_dumps(a, planted)
                    summary = summarize(result)
                    outcome["plants"].append(dict(
                        variant=f"{variant} {size:g}", arch=arch, module=module,
                        direction=direction, visibility=visibility,
                        hit=summary.first is not None and _localized(summary.first, module),
                        named=None if summary.first is None else
                        f"{summary.first.row['module'] or '<root>'} {summary.first.row['kind']}",
                        failing=int(result["status"].isin(FAILING).sum())))
            print(f"  {arch} {variant} done", file=sys.stderr, flush=True)
    return outcome


def report(outcome: dict) -> None:
    plants = outcome["plants"]
    print(f"{'variant':<12} {'direction':<9} {'localized':>12} {'below noise':>12} "
          f"{'invisible':>9} {'median failing rows':>20}")
    variants = list(dict.fromkeys(p["variant"] for p in plants))
    for variant in variants:
        for direction in DIRECTIONS:
            rows = [p for p in plants if p["variant"] == variant and p["direction"] == direction]
            seen = [p for p in rows if p["visibility"] == "visible"]
            noise = [p for p in rows if p["visibility"] == "noise"]
            hits = sum(p["hit"] for p in seen)
            median = statistics.median([p["failing"] for p in seen]) if seen else float("nan")
            pct = f"{100 * hits / len(seen):.0f}%" if seen else "-"
            print(f"{variant:<12} {direction:<9} {hits:>4}/{len(seen):<3}{pct:>5} "
                  f"{sum(p['hit'] for p in noise):>6}/{len(noise):<5} "
                  f"{len(rows) - len(seen) - len(noise):>9} {median:>20}")
            for p in seen:
                if not p["hit"]:
                    print(f"    missed: {p['arch']} {p['module'] or '<root>'}: named "
                          f"{p['named']}")
    seen = [p for p in plants if p["visibility"] == "visible"]
    noise = [p for p in plants if p["visibility"] == "noise"]
    print(f"all: {sum(p['hit'] for p in seen)}/{len(seen)} visible plants localized; below the "
          f"noise {sum(p['hit'] for p in noise)}/{len(noise)}; "
          f"{len(plants) - len(seen) - len(noise)} invisible")
    print("\nhealthy pairs (false alarm = any failing row):")
    for variant in dict.fromkeys(v for v, _, _ in outcome["healthy"]):
        rows = [(arch, s) for v, arch, s in outcome["healthy"] if v == variant]
        alarms = [f"{arch} ({s.verdict()})" for arch, s in rows if not s.ok]
        print(f"  {variant:<6} {len(alarms)} false alarms in {len(rows)} pairs"
              + (f": {', '.join(alarms)}" if alarms else ""))
    for line in outcome["unsupported"]:
        print(f"not run (torch cannot run it here): {line}")
    reruns = outcome["reruns"]
    print(f"identical reruns all equal: {sum(ok for _, ok in reruns)}/{len(reruns)}"
          + "".join(f" ({arch} not)" for arch, ok in reruns if not ok))


def main() -> None:
    _quiet_transformers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHITECTURES))
    parser.add_argument("--variants", default=",".join(CPU_VARIANTS),
                        help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--plants", type=int, default=4,
                        help="plants per architecture, variant and plant size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1,
                        help="train this many SGD steps (plant in all) and dump the last")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_localize_") as tmp:
        outcome = run(args.archs.split(","), args.variants.split(","), args.plants, args.seed,
                      Path(tmp), args.steps)
    report(outcome)


if __name__ == "__main__":
    main()
