"""Benchmark: does h5cmp name the module where an error was planted, from two dumps and from a
localizing re-run, and stay quiet on healthy pairs? Not a timed test.

    python scripts/bench_localize.py [--archs ...|--set held-out] [--variants same,fp64,...]
                                     [--steps 1,4] [--seeds 1,2,3] [--plants 4] [--jobs 2]
                                     [--directions forward,backward] [--keep DIR]

Architectures (``tests/architectures.py``): the *tuning* set the verdict's constants were
tuned on, and a *held-out* set chosen before its results were looked at, reported apart.
Variants (A, B, planted sizes):

    same      A float32,  B float32,                         plant 1e-3
    fp64      A float64,  B float32,                         plant 3e-2 and 1e-3
    bf16      A float32,  B bfloat16 autocast (CPU),         plant 0.1
    fp16      A float32,  B float16 autocast (CPU),          plant 3e-2
    fp16-scaled  as fp16, B's loss scaled by a GradScaler (2^10), plant 3e-2; a case whose
              healthy B's gradients, or those of its re-run on A's values, overflow there
              (a step the GradScaler skips) has no healthy pair: listed apart, not judged
    gpu       A float32 on the CPU, B float32 on CUDA, TF32 off, plant 1e-3 (--variants ...)
    tf32      as gpu, with TF32 matmuls and convolutions,    plant 3e-2
    gpu-bf16  A float32 on the CPU, B bfloat16 autocast on CUDA, plant 0.1
    gpu-fp16  A float32 on the CPU, B float16 autocast on CUDA with a GradScaler (2^10), plant 3e-2

(Across devices dropout is off in both runs: CPU and CUDA generators draw different masks.)

Each case trains ``--steps`` AdamW steps (1: the first step; 4: three steps before, the two
runs' weights drifting apart in mixed precision) and dumps the last. A is dumped with
``params=True``; B healthy, and B with an error planted in the dumped step only by
``dumper.perturb`` in a random module (the root included; forward: its output scaled by 1 +
plant; backward: the gradient arriving at its outputs scaled, an error between modules;
backward-own, with ``--directions``: the gradients it sends back for its inputs scaled, its own
backward wrong), each run free and re-run on A's values (``inject=A``). Where the re-run names
no origin and two dumps do not agree, the user's next step is taken: A, B and the re-run
again with ``ops=`` the modules ``compare.ops_suspects`` names and ``skip_ops=()``.

A plant is *invisible* when it changes its record (the planted module's output or gradient) by
less than half its size (the record does not exist or is ~zero); *below the noise* when the
change is not above the local error the precision itself leaves there (A against the healthy
injected re-run at that record: no method can tell it from rounding); else *visible*. It is
*localized* from two dumps when the first divergence names the planted module or one of its
submodules or ops (or a record of the same tensor), and by injection when the first origin
does (of the re-run with op records where the first re-run names none: counted apart too).
Printed per set, step, variant and direction: both counts side by side (every miss listed with
what was named, and the plant against the healthy pair's figures at its record: the *bound*,
what its inputs' error could hide, and *all it may add*, that and ``SPREAD`` times the rounding
expected of it), the median failing rows per plant, and false alarms on the healthy pairs
(two-dump failing rows; injected origins), and whether an identical rerun is all ``equal``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import random
import shutil
import statistics
import sys
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from architectures import ARCHITECTURES, HELD_OUT, build, cannot_run, run_step  # noqa: E402
from compare import (compare_dumps, localize, ops_suspects, origin_aliases,  # noqa: E402
                     summarize)
from compare import format as fmt  # noqa: E402
from compare.status import FAILING, ORIGIN  # noqa: E402
from compare.verdict import SPREAD  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    """A on the CPU at precision ``a``; B at precision ``b`` on ``device`` (TF32 for its float32
    matmuls, convolutions and RNNs if ``tf32``, else none: :func:`_tf32`); errors of each
    relative size in ``sizes`` planted in B."""

    a: str
    b: str
    sizes: tuple
    device: str = "cpu"
    tf32: bool = False
    loss_scale: Optional[float] = None  # B's loss scaled by a GradScaler starting there


VARIANTS = {
    "same": Variant("float32", "float32", (1e-3,)),
    "fp64": Variant("float64", "float32", (3e-2, 1e-3)),
    "bf16": Variant("float32", "bfloat16", (0.1,)),
    "fp16": Variant("float32", "float16", (3e-2,)),
    # float16 as it trains: its loss scaled by a GradScaler, at a scale these models'
    # gradients do not overflow at (2^16, GradScaler's first, makes the first steps skip
    # their update: the runs' weights then differ by their whole updates)
    "fp16-scaled": Variant("float32", "float16", (3e-2,), loss_scale=2.0 ** 10),
    # on an accelerator (--variants gpu,tf32,gpu-bf16,gpu-fp16): CPU against CUDA
    "gpu": Variant("float32", "float32", (1e-3,), "cuda"),
    "tf32": Variant("float32", "float32", (3e-2,), "cuda", tf32=True),
    "gpu-bf16": Variant("float32", "bfloat16", (0.1,), "cuda"),
    "gpu-fp16": Variant("float32", "float16", (3e-2,), "cuda", loss_scale=2.0 ** 10),
}
CPU_VARIANTS = ("same", "fp64", "bf16", "fp16", "fp16-scaled")
# where a plant goes: forward, the module's output; backward, the gradient arriving at its
# outputs (after its consumers sent it back: an error between modules); backward-own, the
# gradients it sends back for its inputs (its own backward computes wrongly)
DIRECTIONS = {"forward": "output", "backward": "grad_output", "backward-own": "grad_input"}
OPTIMIZER = "adamw"


@contextlib.contextmanager
def _tf32(enabled: bool):
    """TF32 on or off for B's float32 matmuls and cuDNN's convolutions and RNNs alike (cuDNN's
    is on by default: the verdict then allows conv and LSTM outputs TF32's rounding)."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [f.allow_tf32 for f in flags]
    for f in flags:
        f.allow_tf32 = enabled
    try:
        yield
    finally:
        for f, was in zip(flags, before):
            f.allow_tf32 = was


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _error_at(result, module: str, kind: str) -> float:
    rows = result[(result["module"] == module) & (result["kind"] == kind)]
    return float(rows["rel_l2_err"].max()) if len(rows) else 0.0


def _visibility(effect: float, noise: float, size: float) -> str:
    """``invisible``: the plant changes its record by less than half its size; ``noise``: not
    by more than the local error the precision leaves there; else ``visible``."""
    if effect < size / 2:
        return "invisible"
    return "visible" if effect > noise else "noise"


def _named(modules: list[str], planted: str) -> bool:
    """Whether one of ``modules`` is the planted module or inside it."""
    return any(planted == "" or m == planted or fmt.contains(planted, m) for m in modules)


def _overflowed(result, run: str) -> str:
    """Where the gradients of ``run`` (``"B's"``, or B's re-run on A's values, which puts A's
    gradients in at B's loss scale) are not finite where A's are: the first such record,
    which a GradScaler finds, skipping the step; "" where none is."""
    grads = result[result["kind"].isin(list(fmt.BACKWARD_KINDS))]
    nonfinite = grads[(grads["nan_b"] + grads["inf_b"] > grads["nan_a"] + grads["inf_a"])]
    if nonfinite.empty:
        return ""
    r = nonfinite.iloc[0]
    return (f"{run} gradients overflow float16 at B's loss scale, first in {r['module']} "
            f"{r['kind']}[{r['index']}] (a GradScaler skips such a step)")


def _first_origin(table) -> list[str]:
    """The module of the re-run's first origin, and those of later records of its tensor (a
    model's logits are its head's output)."""
    origins = table[table["verdict"] == ORIGIN]
    if origins.empty:
        return []
    first = origins.iloc[0]
    return [first["module"], *origin_aliases(table, first)["module"]]


def run_case(arch: str, variant: str, steps: int, seed: int, plants: int, tmp: Path,
             keep: Optional[Path] = None, directions: tuple = ("forward", "backward")) -> dict:
    """Healthy pairs and ``plants`` plants per size of one (architecture, variant, steps, seed);
    with ``keep``, the dumps of a case with a false alarm, a false origin or a missed visible
    plant are copied there (to study a run of a machine that is gone, e.g. a lent GPU)."""
    _quiet()
    torch.set_num_threads(1)
    v = VARIANTS[variant]
    why = cannot_run(arch, v.a) or cannot_run(arch, v.b, v.device)
    case = f"{arch} {variant} steps={steps} seed={seed}"
    if why:
        return {"unsupported": [f"{case}: {why}"]}
    rng = random.Random(zlib.crc32(case.encode()))
    # CPU and CUDA generators draw different dropout masks: off in both runs across devices
    common = dict(seed=seed, steps=steps, optimizer=OPTIMIZER, plant_last_only=True,
                  dropout=v.device == "cpu")
    root = tmp / f"{arch}-{variant}-{steps}-{seed}"

    def run_b(path: Path, **kwargs) -> Path:
        with _tf32(v.tf32):
            run_step(arch, v.b, path, device=v.device, loss_scale=v.loss_scale, **common,
                     **kwargs)
        return path

    a = root / "a"
    run_step(arch, v.a, a, dumper_options={"params": True}, **common)
    inject = {"dumper_options": {"inject": a}}
    references: dict[tuple, Path] = {}  # A dumped again with ops=, by those modules

    def with_ops(name: str, summary, table, **kwargs) -> Optional[list[str]]:
        """Where the re-run ``table`` names no origin and two dumps do not agree: the origins of
        the three runs again with ops= what it names (None where the user would stop)."""
        suspects = ops_suspects(table)
        if not suspects or (summary.ok and not summary.cannot_tell):
            return None
        options = {"ops": suspects, "skip_ops": ()}
        if tuple(suspects) not in references:
            references[tuple(suspects)] = root / f"a-ops-{len(references)}"
            run_step(arch, v.a, references[tuple(suspects)],
                     dumper_options={"params": True, **options}, **common)
        reference = references[tuple(suspects)]
        free = run_b(root / f"{name}-ops", dumper_options=options, **kwargs)
        rerun = run_b(root / f"{name}-ops-inj", dumper_options={**options, "inject": reference},
                      **kwargs)
        found = localize(reference, free, rerun)
        return list(found.loc[found["verdict"] == ORIGIN, "module"])

    healthy, healthy_inj = run_b(root / "b"), run_b(root / "b-inj", **inject)
    healthy_result, noise_result = compare_dumps(a, healthy), compare_dumps(a, healthy_inj)
    for run, result in (("B's", healthy_result), ("the re-run of B on A's values:", noise_result)):
        overflow = _overflowed(result, run) if v.loss_scale else ""
        if overflow:  # no healthy pair, nothing to localize: a step a GradScaler skips
            return {"overflowed": [f"{case}: {overflow}"]}
    healthy_local = localize(a, healthy, healthy_inj, free_result=healthy_result)
    healthy_ops = with_ops("b", summarize(healthy_result), healthy_local) or []
    hidden = healthy_result.groupby(["module", "kind"])["hidden_rel_error"].max()
    # what the verdict lets a record add without blame: what its inputs' error could hide and
    # SPREAD times the rounding expected of it
    allowed = healthy_result.assign(allowed=np.hypot(
        healthy_result["hidden_rel_error"], SPREAD * healthy_result["expected_rel_error"])
    ).groupby(["module", "kind"])["allowed"].max()
    out = {"healthy": [dict(variant=variant, steps=steps, arch=arch, seed=seed,
                            summary=str(summarize(healthy_result).verdict()),
                            ok=summarize(healthy_result).ok,
                            cannot_tell=summarize(healthy_result).cannot_tell,
                            failing=int(healthy_result["status"].isin(FAILING).sum()),
                            origins=sorted(set(healthy_local[healthy_local["verdict"] == ORIGIN]
                                               ["module"]) | set(healthy_ops)))],
           "plants": [], "unsupported": [], "overflowed": []}
    modules = [p for p, _ in build(arch, v.b, seed)[0].named_modules()]
    for size in v.sizes:
        for k in range(plants):
            direction = directions[k % len(directions)]
            module, where = rng.choice(modules), DIRECTIONS[direction]
            plant = {"plant": {"include": [module], "where": where, "scale": 1 + size}}
            dump = f"{size:g}-{k}"
            free = run_b(root / dump, **plant)
            injected = run_b(root / f"{dump}-inj", **plant, **inject)
            result = compare_dumps(a, free)
            summary = summarize(result)
            first = summary.first
            named = [] if first is None else [first.row["module"],
                                              *first.aliases.get("module", [])]
            table = localize(a, free, injected, free_result=result)
            ops_origins = with_ops(dump, summary, table, **plant)
            effect = _error_at(compare_dumps(healthy_inj, injected), module, where)
            out["plants"].append(dict(
                variant=f"{variant} {size:g}", steps=steps, arch=arch, seed=seed, module=module,
                dump=dump,
                direction=direction,
                visibility=_visibility(effect, _error_at(noise_result, module, where), size),
                two_dump=first is not None and _named(named, module),
                named="-" if first is None else f"{first.row['module'] or '<root>'} "
                                               f"{first.row['kind']}",
                verdict=summary.verdict(), cannot_tell=summary.cannot_tell,
                # how it says so: nothing fails, or a failure elsewhere may begin earlier
                begins_earlier=summary.cannot_tell and first is not None,
                suspected=module in set(summary.undecided.head(5)["module"]),
                bound=float(hidden.get((module, where), float("nan"))), size=size,
                allowed=float(allowed.get((module, where), float("nan"))),
                injected=_named(_first_origin(table) or (ops_origins or [])[:1], module),
                with_ops=ops_origins is not None and _named(ops_origins[:1], module),
                origins=sorted(set(table[table["verdict"] == ORIGIN]["module"])
                               | set((ops_origins or [])[:1]))[:4],
                failing=int(result["status"].isin(FAILING).sum())))
    if keep is not None:
        _keep(root, out, keep / root.name)
    return out


def _keep(root: Path, case: dict, keep: Path) -> None:
    """The healthy pair (A, B, B re-run on A) and the missed plants' dumps of a case with a
    false alarm, a false origin or a missed visible plant."""
    missed = [p["dump"] for p in case["plants"]
              if p["visibility"] == "visible" and not (p["two_dump"] and p["injected"])]
    if missed or any(not h["ok"] or h["origins"] for h in case["healthy"]):
        for name in ("a", "b", *missed):  # each with its re-run, and those with ops=
            for path in (root / name, root / f"{name}-inj", *root.glob(f"{name}-ops*")):
                if path.exists():
                    shutil.copytree(path, keep / path.name, dirs_exist_ok=True)


def rerun_equal(arch: str, steps: int, tmp: Path) -> bool:
    _quiet()
    for name in ("r1", "r2"):
        run_step(arch, "float32", tmp / f"{arch}-{steps}-{name}", steps=steps, optimizer=OPTIMIZER)
    rerun = compare_dumps(tmp / f"{arch}-{steps}-r1", tmp / f"{arch}-{steps}-r2")
    return bool((rerun["status"] == "equal").all())


def _set_of(arch: str) -> str:
    return "held-out" if arch in HELD_OUT else "tuning"


def _percent(hits: int, n: int) -> str:
    return f"{hits:>3}/{n:<3}{(f'{100 * hits / n:.0f}%' if n else '-'):>5}"


def report(outcome: dict) -> None:
    plants = outcome["plants"]
    print(f"{'set':<9}{'step':>5} {'variant':<11}{'direction':<10}{'two-dump':>14}"
          f"{'injected':>14}{'noise':>7}{'invis.':>7}{'median rows':>12}")
    keys = sorted({(_set_of(p["arch"]), p["steps"], p["variant"]) for p in plants},
                  key=lambda k: (k[0] != "held-out", k[1], k[2]))
    for set_, steps, variant in keys:
        for direction in DIRECTIONS:
            rows = [p for p in plants if (_set_of(p["arch"]), p["steps"], p["variant"],
                                          p["direction"]) == (set_, steps, variant, direction)]
            if not rows:  # a direction not planted (--directions)
                continue
            seen = [p for p in rows if p["visibility"] == "visible"]
            noise = sum(p["visibility"] == "noise" for p in rows)
            median = statistics.median([p["failing"] for p in seen]) if seen else float("nan")
            print(f"{set_:<9}{steps:>5} {variant:<11}{direction:<10}"
                  f"{_percent(sum(p['two_dump'] for p in seen), len(seen)):>14}"
                  f"{_percent(sum(p['injected'] for p in seen), len(seen)):>14}"
                  f"{noise:>7}{len(rows) - len(seen) - noise:>7}{median:>12}")
            for p in seen:
                if not p["two_dump"]:
                    honest = ("cannot tell" + (" whether it begins earlier" if
                                               p["begins_earlier"] else "")
                              + (", suspected" if p["suspected"] else "")
                              if p["cannot_tell"] else "NOT cannot tell")
                    print(f"      two-dump miss: {p['arch']} seed {p['seed']} "
                          f"{p['module'] or '<root>'}: named {p['named']}; {honest}; plant "
                          f"{p['size'] / max(p['bound'], 1e-300):.3g}x the bound there, "
                          f"{p['size'] / max(p['allowed'], 1e-300):.3g}x all it may add")
                if not p["injected"]:
                    print(f"      injected miss: {p['arch']} seed {p['seed']} "
                          f"{p['module'] or '<root>'}: origins {p['origins']}")
    for set_ in ("held-out", "tuning"):
        seen = [p for p in plants if p["visibility"] == "visible" and _set_of(p["arch"]) == set_]
        if seen:
            missed = [p for p in seen if not p["two_dump"]]
            print(f"{set_}: two-dump {len(seen) - len(missed)}/{len(seen)}, injected "
                  f"{sum(p['injected'] for p in seen)}/{len(seen)} visible plants localized "
                  f"({sum(p['with_ops'] for p in seen)} by the re-run with ops=); "
                  f"two-dump misses with a cannot-tell verdict "
                  f"{sum(p['cannot_tell'] for p in missed)}/{len(missed)} (where another "
                  f"record fails, saying it may begin earlier: "
                  f"{sum(p['begins_earlier'] for p in missed)}), of which the plant "
                  f"was a suspect {sum(p['suspected'] for p in missed)}; misses of a plant 10x "
                  f"the bound there or more: {sum(p['size'] >= 10 * p['bound'] for p in missed)}, "
                  f"10x all a record may add there (the bound and SPREAD times its rounding): "
                  f"{sum(p['size'] >= 10 * p['allowed'] for p in missed)}")
    print("\nhealthy pairs (two-dump false alarm: any failing row, and how many say they cannot "
          "tell; injected: any origin):")
    healthy = outcome["healthy"]
    for key in sorted({(_set_of(h["arch"]), h["steps"], h["variant"]) for h in healthy},
                      key=lambda k: (k[0] != "held-out", k[1], k[2])):
        rows = [h for h in healthy if (_set_of(h["arch"]), h["steps"], h["variant"]) == key]
        alarms = [f"{h['arch']} seed {h['seed']} ({h['summary'][:120]})" for h in rows
                  if not h["ok"]]
        undecided = sum(h["cannot_tell"] for h in rows)
        false_origins = [f"{h['arch']} seed {h['seed']} {h['origins']}" for h in rows
                         if h["origins"]]
        print(f"  {key[0]:<9} step {key[1]} {key[2]:<5} two-dump {len(alarms)}/{len(rows)} "
              f"(cannot tell {undecided}), injected {len(false_origins)}/{len(rows)}"
              + "".join(f"\n      alarm: {a}" for a in alarms)
              + "".join(f"\n      false origin: {o}" for o in false_origins))
    for line in outcome["unsupported"]:
        print(f"not run (torch cannot run it here): {line}")
    for line in outcome["overflowed"]:
        print(f"no healthy pair: {line}")
    for line in outcome["crashed"]:
        print(f"CRASHED (a bug: a case h5cmp could not run): {line}")
    reruns = outcome["reruns"]
    print(f"identical reruns all equal: {sum(ok for _, ok in reruns)}/{len(reruns)}"
          + "".join(f" ({arch} not)" for arch, ok in reruns if not ok))


def main() -> None:
    _quiet()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=None, help="default: every architecture of --set")
    parser.add_argument("--set", choices=("all", "tuning", "held-out"), default="all")
    parser.add_argument("--variants", default=",".join(CPU_VARIANTS),
                        help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", default="1,4",
                        help="dump the last of this many AdamW steps (comma-separated)")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--plants", type=int, default=4,
                        help="plants per architecture, variant, plant size, steps and seed")
    parser.add_argument("--directions", default="forward,backward",
                        help=f"plants take these in turn, of {', '.join(DIRECTIONS)}")
    parser.add_argument("--jobs", type=int, default=2, help="cases run in this many processes")
    parser.add_argument("--keep", type=Path, default=None,
                        help="copy the dumps of cases with a false alarm or a miss here")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    archs = (args.archs.split(",") if args.archs else
             [a for a in ARCHITECTURES if args.set == "all" or _set_of(a) == args.set])
    steps = [int(s) for s in args.steps.split(",")]
    cases = [(arch, variant, n, seed) for arch in archs for n in steps
             for variant in args.variants.split(",") for seed in map(int, args.seeds.split(","))]
    outcome = {"plants": [], "healthy": [], "unsupported": [], "overflowed": [], "crashed": [],
               "reruns": []}
    with tempfile.TemporaryDirectory(prefix="bench_localize_") as tmp, \
            cf.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_case, *case, args.plants, Path(tmp), args.keep,
                               tuple(args.directions.split(","))): case for case in cases}
        reruns = {pool.submit(rerun_equal, arch, n, Path(tmp)): arch
                  for arch in archs for n in steps}
        for future in cf.as_completed(futures):
            try:
                found = future.result()
            except Exception as exc:  # counted and listed: the other cases still count
                found = {"crashed": [f"{' '.join(map(str, futures[future]))}: "
                                     f"{type(exc).__name__}: {str(exc).splitlines()[0]}"]}
            for key, values in found.items():
                outcome[key] += values
            print(f"  {' '.join(map(str, futures[future]))} done", file=sys.stderr, flush=True)
        outcome["reruns"] = [(reruns[f], f.result()) for f in reruns]
    report(outcome)


if __name__ == "__main__":
    main()
