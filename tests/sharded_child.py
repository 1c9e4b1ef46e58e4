"""One rank of a sharded training run, with and without the dumper (``tests/test_sharded.py``).

usage: RANK=r WORLD_SIZE=n INIT_METHOD=file:///... sharded_child.py LAYOUT DIR
LAYOUT: ``fsdp2`` (``fully_shard`` per block of a small transformer), ``fsdp1``
(``FullyShardedDataParallel``), ``tp`` (``ColwiseParallel``/``RowwiseParallel`` on an MLP
block; ``tp-planted``: rank 1's shard of its first layer's output is 1 % off;
``tp-replica``: rank 1's input of the block, replicated, is 1 % off), ``ddp``, or
``ddp-broken`` (DDP whose gradients are not all-reduced). A data-parallel layout with the
suffix ``-one-batch`` (``fsdp2-one-batch``) feeds every rank the same batch, as tensor
parallel does: then it computes what one process computes on that batch.

Trains three SGD steps without a dumper, then once per dumper mode, and prints one JSON line:
per mode, whether losses, outputs and gradients are bit-identical to the plain run, and the
step files written.
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from dumper import HookerAndDumper

STEPS = 3
MODES = {"default": {}, "params": {"params": True}, "stats": {"mode": "stats"},
         "stats-params": {"mode": "stats", "params": True}}


class Block(nn.Module):
    """A pre-norm transformer block (attention through ``nn.MultiheadAttention``, GELU MLP,
    an in-place residual add)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = MLP(width)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out = self.mlp(self.norm2(x))
        out += x
        return out


class MLP(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.act = nn.Linear(width, 4 * width), nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Transformer(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


ONE_BATCH = "-one-batch"


def unsharded(layout: str) -> nn.Module:
    """The model of ``layout`` as one process has it, its weights those every rank starts from."""
    torch.manual_seed(0)
    if layout.startswith("tp"):
        return nn.Sequential(nn.Linear(8, 16), MLP(16), nn.Linear(16, 4))
    return Transformer()


def build(layout: str) -> nn.Module:
    layout = layout.removesuffix(ONE_BATCH)
    model = unsharded(layout)
    if layout.startswith("tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {"1.up": ColwiseParallel(), "1.down": RowwiseParallel()})
        if layout == "tp-planted" and dist.get_rank() == 1:  # a wrong kernel on one rank
            model[1].up.register_forward_hook(lambda module, args, out: out * 1.01)
        if layout == "tp-replica" and dist.get_rank() == 1:  # another input on one rank
            model[1].register_forward_pre_hook(lambda module, args: (args[0] * 1.01,))
        return model
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if layout == "ddp-broken":  # a communication hook that forgets to all-reduce
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, _no_all_reduce)
        return ddp
    raise ValueError(f"unknown layout {layout!r}")


def _no_all_reduce(state, bucket):  # no annotation: DDP checks it, and ours are strings
    """A broken DDP communication hook: each rank keeps its own gradients."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _full(t: torch.Tensor | None) -> torch.Tensor:
    """The whole value of a (possibly sharded) tensor; a rank's empty shard (FSDP1 leaves
    the gradient of a parameter with no elements on this rank None) as an empty tensor."""
    if t is None:
        return torch.empty(0)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(layout: str, dumper: HookerAndDumper | None,
          model: nn.Module | None = None) -> list[torch.Tensor]:
    """Losses, outputs, gradients and final weights of ``STEPS`` steps, as whole tensors.
    ``model``: the one to train in this process alone (``unsharded(layout)``, on rank 0's
    batches) instead of ``build(layout)`` on this rank."""
    distributed = model is None
    model = build(layout) if distributed else model
    if dumper is not None and distributed and layout.startswith("tp"):
        # ColwiseParallel returns a plain local shard, which the activation computes on
        dumper.mark_sharded("1.up", ["output", "grad_output"], dim=-1)
        dumper.mark_sharded("1.act", ["input", "output", "grad_input", "grad_output"], dim=-1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # data parallel: a batch per rank; tensor parallel: every rank computes on the same batch
    one_batch = layout.startswith("tp") or layout.endswith(ONE_BATCH)
    data = torch.Generator().manual_seed(
        dist.get_rank() if distributed and not one_batch else 0)
    # DDP ends each hooked step as the README's loop does (step, zero_grad, then remove_hooks:
    # the gradients are recorded as the optimizer step begins); the others remove the hooks
    # right after backward
    late_remove = layout in ("ddp", "ddp-broken")
    seen = []
    for step in range(STEPS):
        x = torch.randn(2, 5, 8, generator=data)
        if dumper is not None:
            dumper.register_hooks(model, 0, step)
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        if dumper is not None and not late_remove:
            dumper.remove_hooks()
        seen += [loss.detach().clone(), _full(out.detach()).clone()]
        seen += [_full(p.grad).clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        if dumper is not None and late_remove:
            dumper.remove_hooks()
    return seen + [_full(p.detach()).clone() for p in model.parameters()]


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        and torch.equal(torch.signbit(x), torch.signbit(y)) for x, y in zip(a, b))


def main() -> None:
    layout, directory = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=os.environ["INIT_METHOD"],
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
    plain = train(layout, None)
    report = {}
    for mode, options in MODES.items():
        dumper = HookerAndDumper(os.path.join(directory, mode), steps=[0, 2], **options)
        identical = _bits_equal(plain, train(layout, dumper))
        report[mode] = {"identical": identical,
                        "files": sorted(p.name for p in dumper.written_files)}
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": int(os.environ["RANK"]), "modes": report}), flush=True)
    # Everything is written and reported. Skip the interpreter's teardown: there torch's gloo
    # threads abort the process now and then ("terminate called without an active exception",
    # about 1 run in 30 of the tp layout here, with or without a dumper).
    os._exit(0)


if __name__ == "__main__":
    main()
