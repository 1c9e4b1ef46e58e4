"""Demo: dump steps 2-3 of training runs of a small CNN and compare them with h5cmp.

    python scripts/demo.py [--out demo_out]

1. float64 vs float32: the same model in two precisions. Every tensor differs by rounding, and
   h5cmp finds nothing beyond what float32 rounding explains.
2. float32 vs bfloat16 autocast: every tensor differs by far more (bfloat16 keeps 8 bits), and
   still within what bfloat16 rounding explains: B agrees with A.
3. float32 vs bfloat16 autocast with a bug (a 10% error planted in the GELU's output with
   dumper.perturb): h5cmp names the GELU, forward, against the bfloat16 rounding it measured.
4. float32 vs float32 with one "kernel change" (GELU swapped for its tanh approximation),
   and the changed run again with the float32 run's inputs injected into every module: each
   module's local error separates the origin (the GELU) from the modules that only inherit
   its error. Pictures, the call graph and an HTML report land in the output folder.
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
from dumper import HookerAndDumper, Injector, perturb


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


def train(directory: Path, dtype: torch.dtype, gelu_approximate: str = "none",
          steps: int = 4, inject_from: Optional[Path] = None, autocast: bool = False,
          bug: bool = False) -> None:
    """Train from the same weights and data; ``autocast``: in float32 weights under bfloat16
    autocast; ``bug``: the GELU's output 10% too large."""
    torch.manual_seed(0)
    model = SmallCNN(gelu_approximate).to(dtype)
    if bug:
        perturb(model, "head.2", scale=1.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    dumper = HookerAndDumper(directory, epochs=[0], steps=range(2, 4))
    injector = Injector(inject_from, kinds=["input"]) if inject_from else None
    losses = []
    for step in range(steps):
        images = torch.randn(16, 3, 12, 12, generator=data).to(dtype)
        labels = torch.randint(0, 10, (16,), generator=data)
        injecting = injector is not None and dumper.in_window(0, step)
        if injecting:
            injector.register(model, 0, step)
        dumper.register_hooks(model, 0, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(images)
        loss = nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dumper.remove_hooks()
        if injecting:
            injector.remove()
        losses.append(f"{loss.item():.7f}")
    print(f"  {directory.name}: losses {' '.join(losses)}; dumped {len(dumper.written_files)} steps")


def run_h5cmp(*args: str) -> int:
    print(f"\n$ h5cmp {' '.join(args)}\n", flush=True)
    try:
        h5cmp(list(args), standalone_mode=False)
    except SystemExit as exit:
        return int(exit.code or 0)
    return 0


def run(out: Path) -> int:
    shutil.rmtree(out, ignore_errors=True)
    print(f"training 6 runs, dumping steps 2-3 of each into {out}/")
    train(out / "float64", torch.float64)
    train(out / "float32", torch.float32)
    train(out / "bfloat16", torch.float32, autocast=True)
    train(out / "bfloat16_bug", torch.float32, autocast=True, bug=True)
    train(out / "float32_tanh_gelu", torch.float32, gelu_approximate="tanh")
    train(out / "float32_tanh_gelu_injected", torch.float32, gelu_approximate="tanh",
          inject_from=out / "float32")
    pictures = []
    if importlib.util.find_spec("matplotlib"):
        pictures = ["--plot", str(out / "errors.png"), "--heatmap", str(out / "heatmap.png"),
                    "-o", str(out / "report.html")]
    graph = out / ("graph.png" if shutil.which("dot") else "graph.dot")
    codes = [run_h5cmp(str(out / "float64"), str(out / "float32"), "--top", "5"),
             run_h5cmp(str(out / "float32"), str(out / "bfloat16"), "--step", "0:2"),
             run_h5cmp(str(out / "float32"), str(out / "bfloat16_bug"), "--step", "0:2",
                       "--top", "5"),
             run_h5cmp(str(out / "float32"), str(out / "float32_tanh_gelu"), "--step", "0:2",
                       "--top", "8", "--injected", str(out / "float32_tanh_gelu_injected"),
                       "--dot", str(graph), *pictures)]
    print(f"\npictures, call graph and report: {out}/")
    # Exit code 1 means "differences found", which is what the last two comparisons show.
    return 0 if codes == [0, 0, 1, 1] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    sys.exit(run(parser.parse_args().out))
