"""Awkward models for the numerics and coverage tests; each factory takes no arguments.

``ZOO`` maps a name to ``(factory, make_batch)``; ``loss_of(output)`` reduces any output to a scalar.
"""
from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class InplaceCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(self.pool(self.relu(self.bn(self.conv(x)))).flatten(1))


class ResidualBlock(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.lin(x)
        y += x
        return self.act(y)


class UsesInputTwice(nn.Module):
    """Consumes its input several times inside: the case where an identity alias would regroup sums."""

    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x) * x + x.sin()


class OuterResidual(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.inner = UsesInputTwice(width)
        self.blocks = nn.Sequential(ResidualBlock(width), ResidualBlock(width))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inner(x) + x          # x feeds the module (twice inside) and the skip
        h = self.blocks(h) + h
        return self.head(h)


class SharedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class KwargsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *, x, scale, mask=None):
        y = self.lin(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = KwargsOnly()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        mask = x[:, :1] > 1.5
        return self.out(self.inner(x=x, scale=0.5, mask=mask.expand_as(x)))


Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Packed:
    main: torch.Tensor
    extra: dict


class DictTupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return {"logits": self.a(x), "aux": (self.b(x), 3, None), "pair": Pair(x * 2, "tag")}


class NoneAndInts(nn.Module):
    def forward(self, x):
        return None


class ReturnsInt(nn.Module):
    def forward(self, x):
        return x.shape[0]


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return Packed(self.lin(x), {"scale": 2.0, "t": x.mean()})


class StructuredModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.dt = DictTupleOut()
        self.none = NoneAndInts()
        self.int = ReturnsInt()
        self.dc = DataclassOut()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        out = self.dt(x)
        self.none(x)
        n = self.int(x)
        packed = self.dc(out["logits"] + out["aux"][0] + out["pair"].left)
        return self.head(packed.main * packed.extra["scale"] + packed.extra["t"]) / n


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1] + h[-1])


class AttentionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        a, weights = self.attn(x, x, x, need_weights=True)
        return self.head(self.norm(a + x).mean(1)) + weights.sum() * 0


class TransformerModel(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.pre = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        h = self.pre(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _vec(batch=6, width=8):
    return lambda: torch.randn(batch, width)


ZOO = {
    "inplace_cnn_bn": (InplaceCNN, lambda: torch.randn(4, 3, 6, 6)),
    "residual_inplace": (OuterResidual, _vec(width=16)),
    "shared_twice": (SharedTwice, _vec()),
    "kwargs_only": (KwargsModel, _vec()),
    "structured_outputs": (StructuredModel, _vec()),
    "lstm": (LSTMModel, lambda: torch.randn(3, 5, 8)),
    "attention": (AttentionModel, lambda: torch.randn(2, 5, 16)),
    "transformer": (TransformerModel, lambda: torch.randn(2, 5, 16)),
    "checkpoint_nonreentrant": (lambda: Checkpointed(False), _vec()),
    "checkpoint_reentrant": (lambda: Checkpointed(True), _vec()),
}


def loss_of(output) -> torch.Tensor:
    return output.float().pow(2).mean()
