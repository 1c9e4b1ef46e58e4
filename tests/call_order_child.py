"""Child process for the call-order tests: one training step of a tiny ModernBERT (random
weights, seed 0), dumped into DIR, in a process whose ``PYTHONHASHSEED`` the test chooses.

ModernBERT calls its rotary embedding once per attention type, in the order of a ``set`` of
strings, which changes with the hash seed. Prints that order (JSON) on the last line.

usage: call_order_child.py DIR [--inject REFERENCE]
With --inject, the step is a localizing re-run on REFERENCE's values
(``Injector(REFERENCE, LOCALIZING)``).
"""
import argparse
import json

import torch
import transformers

from dumper import HookerAndDumper, Injector
from dumper.injection import LOCALIZING

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--inject", default=None)
args = parser.parse_args()
torch.manual_seed(0)
config = transformers.ModernBertConfig(
    vocab_size=96, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
    intermediate_size=96, global_attn_every_n_layers=2, local_attention=8,
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
    sep_token_id=2)
model = transformers.ModernBertForMaskedLM(config)
ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
inject = Injector(args.inject, LOCALIZING) if args.inject else None
# the ops inside the rotary embedding too: they pair as the calls they run in
dumper = HookerAndDumper(args.dir, steps=[0], params=True, inject=inject,
                         ops=["model.rotary_emb"])
with dumper.hooks(model, 0, 0):
    model(input_ids=ids, labels=ids).loss.backward()
dumper.close()
print(json.dumps(list(set(config.layer_types))))
