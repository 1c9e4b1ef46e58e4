"""Child process for the crash tests: trains a small model with the dumper on every step.

usage: crash_child.py DIR STEPS [--hang-at STEP] [--hang-publishing-at STEP] [--fsize-limit BYTES]
With --hang-at, prints HANGING in the middle of that step's backward and sleeps (to be killed).
With --hang-publishing-at, steps are published in the background (``publish="background"``) and
that step's writer prints PUBLISHING while it writes the file, then sleeps; training goes on.
With --fsize-limit, the process may not write files larger than BYTES (a full disk, in effect).
"""
import argparse
import resource
import signal
import sys
import time

import torch
from torch import nn

from dumper import DumpWriteError, HookerAndDumper
from dumper import writer

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("steps", type=int)
parser.add_argument("--hang-at", type=int, default=-1)
parser.add_argument("--hang-publishing-at", type=int, default=-1)
parser.add_argument("--fsize-limit", type=int, default=0)
args = parser.parse_args()
if args.hang_publishing_at >= 0:
    write_index = writer.StepWriter._write_index
    hang_in = f"_{args.hang_publishing_at}-step"

    def hanging_write_index(self, datasets):
        if hang_in in self.final_path.name:
            say("PUBLISHING")
            time.sleep(600)
        return write_index(self, datasets)
    writer.StepWriter._write_index = hanging_write_index
if args.fsize_limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))

torch.set_num_threads(1)  # two processes must compute bit-identically: no thread-dependent splits


def say(line: str) -> None:
    """One line to the test, in one write: the training thread and the writer's both speak,
    and print's text and newline, written apart, interleave under load ("DONE 2PUBLISHING")."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 256), nn.Tanh(),
                      nn.Linear(256, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dumper = HookerAndDumper(args.dir, params=True,
                         publish="background" if args.hang_publishing_at >= 0 else "auto")
for step in range(args.steps):
    x = torch.randn(64 * 3 ** step, 64)  # steps grow: a size limit hits a later step first
    dumper.register_hooks(model, 0, step)
    out = model(x)
    if step == args.hang_at:
        out.register_hook(lambda g: (say("HANGING"), time.sleep(600)))
    out.pow(2).mean().backward()
    try:
        dumper.remove_hooks()
    except DumpWriteError as exc:
        say(f"WRITE-ERROR step {step}: {exc}")
    else:
        say(f"DONE {step}")
    opt.step()
    opt.zero_grad()
dumper.close()
