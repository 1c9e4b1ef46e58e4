"""Demo: dump four training steps of a small CNN in several runs and compare them with h5cmp.

    python scripts/demo.py [--out demo_out]

1. float32 vs bfloat16 autocast, step 2: every tensor differs by far more than float32
   rounding (bfloat16 keeps 8 bits), within what bfloat16 rounding explains; the weights
   already differ (steps 0-1 trained in different precisions).
2. The same pair with a bug (a 10% error planted in the GELU's output with dumper.perturb):
   h5cmp names the GELU, forward, against the bfloat16 rounding it measured.
3. float32 vs float32 with one "kernel change" (GELU swapped for its tanh approximation): at
   step 0 the GELU is named although the change is far below bfloat16 rounding; at step 2
   the weights are (the runs diverged at an earlier step).
4. A bug in bfloat16 at a later step (step 3, a 6% error in the gradient the GELU sends
   back, planted in that step only): the weights have drifted apart and the gradients carry
   ~10% bfloat16 error, so the two-dump verdict says it cannot tell, with the bound and the
   suspects; re-running B on A's values (inputs, weights, incoming gradients:
   HookerAndDumper(..., inject=A)) names the GELU's backward.
Pictures, the call graph and an HTML report land in the output folder.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from compare.cli import main as h5cmp
from dumper import HookerAndDumper, perturb

STEPS = 4
# case 4: planted at the last step only
LATE_BUG = {"include": "head.2", "scale": 1.06, "where": "grad_input"}


class SmallCNN(nn.Module):
    def __init__(self, gelu_approximate: str = "none"):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 32),
                                  nn.GELU(approximate=gelu_approximate), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


def train(directory: Path, dtype: torch.dtype = torch.float32, gelu_approximate: str = "none",
          autocast: bool = False, bug: Optional[dict] = None, late: bool = False,
          inject: Optional[Path] = None) -> None:
    """Train from the same weights and data, dumping every step (the last only with
    ``inject``, a localizing re-run on that dump's values); ``autocast``: float32 weights
    under bfloat16 autocast; ``bug``: ``dumper.perturb`` arguments, in every step, or in the
    last only with ``late``."""
    torch.manual_seed(0)
    model = SmallCNN(gelu_approximate).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    dumper = (HookerAndDumper(directory, steps=[STEPS - 1], inject=inject) if inject else
              HookerAndDumper(directory, params=True))  # weights' values: a reference for 4
    planted = None
    losses = []
    for step in range(STEPS):
        images = torch.randn(16, 3, 12, 12, generator=data).to(dtype)
        labels = torch.randint(0, 10, (16,), generator=data)
        if bug and planted is None and (not late or step == STEPS - 1):
            planted = perturb(model, **bug)
        with dumper.hooks(model, 0, step):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(images)
            loss = nn.functional.cross_entropy(logits.float(), labels)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(f"{loss.item():.7f}")
    print(f"  {directory.name}: losses {' '.join(losses)}; "
          f"dumped {len(dumper.written_files)} steps")


def run_h5cmp(*args: str) -> int:
    print(f"\n$ h5cmp {' '.join(args)}\n", flush=True)
    try:
        h5cmp(list(args), standalone_mode=False)
    except SystemExit as exit:
        return int(exit.code or 0)
    return 0


def run(out: Path) -> int:
    shutil.rmtree(out, ignore_errors=True)
    print(f"training 7 runs of {STEPS} steps into {out}/")
    train(out / "float32")
    train(out / "bfloat16", autocast=True)
    train(out / "bfloat16_bug", autocast=True, bug={"include": "head.2", "scale": 1.1})
    train(out / "float32_tanh_gelu", gelu_approximate="tanh")
    train(out / "bfloat16_late_bug", autocast=True, bug=LATE_BUG, late=True)
    train(out / "bfloat16_late_bug_injected", autocast=True, bug=LATE_BUG, late=True,
          inject=out / "float32")
    pictures = []
    if importlib.util.find_spec("matplotlib"):
        pictures = ["--plot", str(out / "errors.png"), "--heatmap", str(out / "heatmap.png"),
                    "-o", str(out / "report.html")]
    graph = out / ("graph.png" if shutil.which("dot") else "graph.dot")
    a, last = str(out / "float32"), f"0:{STEPS - 1}"
    codes = [run_h5cmp(a, str(out / "bfloat16"), "--step", "0:2"),
             run_h5cmp(a, str(out / "bfloat16_bug"), "--step", "0:2", "--top", "5"),
             run_h5cmp(a, str(out / "float32_tanh_gelu"), "--step", "0:0", "--top", "5",
                       "--dot", str(graph), *pictures),
             run_h5cmp(a, str(out / "float32_tanh_gelu"), "--step", "0:2", "--top", "3"),
             run_h5cmp(a, str(out / "bfloat16_late_bug"), "--step", last, "--top", "3",
                       "--injected", str(out / "bfloat16_late_bug_injected"))]
    print(f"\npictures, call graph and report: {out}/")
    # 0: agreement (or nothing found); 1: differences found, or an origin from the re-run
    return 0 if codes == [0, 1, 1, 1, 1] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    sys.exit(run(parser.parse_args().out))
