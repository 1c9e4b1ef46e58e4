"""Comparing models whose module names differ: rename rules (--map), the prefix that pairs a
model wrapped one level deeper, and rules suggested by aligning the call sequences.

B is GPT-2 (transformers, tiny config, random weights) with its modules renamed the way a port
into a Llama-style codebase names them (``transformer.h.0.attn.c_attn`` becomes
``model.layers.0.self_attn.qkv_proj``), run by GPT-2's own forward: same weights, same
numerics, other names.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import NameMapping, Rule, compare_dumps, load_dump, load_mapping, suggest_mapping
from compare.cli import main
from compare.errors import DumpError
from compare.pairing import tensor_rows
from compare.status import MISSING_IN_A, MISSING_IN_B
from dumper import HookerAndDumper
from tests.architectures import build

pytest.importorskip("transformers")

LLAMA_NAMES = {  # GPT-2 module -> {child: its name in the port}
    "": {"transformer": "model"},
    "transformer": {"h": "layers", "wte": "embed_tokens", "wpe": "embed_positions",
                    "ln_f": "norm"},
    "block": {"ln_1": "input_layernorm", "attn": "self_attn", "ln_2": "post_attention_layernorm"},
    "attn": {"c_attn": "qkv_proj", "c_proj": "o_proj"},
    "mlp": {"c_fc": "up_proj", "c_proj": "down_proj"},
}


def rename_children(module: nn.Module, names: dict[str, str]) -> None:
    """Register ``module``'s children under new names; the old names stay readable (class
    properties), so the module's own forward runs unchanged."""
    cls = type(module)
    props = {old: property(lambda self, new=new: self._modules[new]) for old, new in names.items()}
    module.__class__ = type(cls.__name__, (cls,), props)
    for old, new in names.items():
        module._modules[new] = module._modules.pop(old)


def llama_style_port(gpt2: nn.Module) -> nn.Module:
    port = copy.deepcopy(gpt2)
    transformer = port.transformer
    rename_children(port, LLAMA_NAMES[""])
    for block in transformer.h:
        rename_children(block.attn, LLAMA_NAMES["attn"])
        rename_children(block.mlp, LLAMA_NAMES["mlp"])
        rename_children(block, LLAMA_NAMES["block"])
    rename_children(transformer, LLAMA_NAMES["transformer"])
    return port


class Wrapper(nn.Module):
    """A training wrapper (as a Lightning module holds the model under ``model``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch)


def dump(model: nn.Module, directory, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 12), generator=gen)
    dumper = HookerAndDumper(directory)
    with dumper.hooks(model, 0, 0):
        model(input_ids=ids, labels=ids).loss.backward()


@pytest.fixture(scope="module")
def gpt2():
    return build("gpt2", "float32", seed=0)[0]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, gpt2):
    root = tmp_path_factory.mktemp("mapping")
    dump(copy.deepcopy(gpt2), root / "a")
    dump(copy.deepcopy(gpt2), root / "a2")
    dump(llama_style_port(gpt2), root / "port")
    dump(Wrapper(copy.deepcopy(gpt2)), root / "wrapped")
    return root


PORT_RULES = [
    {"glob": "model.layers.*.input_layernorm", "to": "transformer.h.{1}.ln_1"},
    {"glob": "model.layers.*.post_attention_layernorm", "to": "transformer.h.{1}.ln_2"},
    {"glob": "model.layers.*.self_attn.qkv_proj", "to": "transformer.h.{1}.attn.c_attn"},
    {"glob": "model.layers.*.self_attn.o_proj", "to": "transformer.h.{1}.attn.c_proj"},
    {"glob": "model.layers.*.self_attn.**", "to": "transformer.h.{1}.attn.{2}"},
    {"glob": "model.layers.*.mlp.up_proj", "to": "transformer.h.{1}.mlp.c_fc"},
    {"glob": "model.layers.*.mlp.down_proj", "to": "transformer.h.{1}.mlp.c_proj"},
    {"glob": "model.layers.**", "to": "transformer.h.{1}"},
    {"glob": "model.embed_tokens", "to": "transformer.wte"},
    {"glob": "model.embed_positions", "to": "transformer.wpe"},
    {"glob": "model.norm", "to": "transformer.ln_f"},
    {"regex": r"model(\.(.*))?", "to": r"transformer\1"},
]


def all_paired_and_equal(result) -> None:
    assert not result["status"].isin([MISSING_IN_A, MISSING_IN_B]).any(), \
        result[result["status"].isin([MISSING_IN_A, MISSING_IN_B])][["module", "kind", "status"]]
    assert (result["max_abs_err"].fillna(0) == 0).all()


def test_without_rules_the_port_is_named_another_model(dumps):
    """Renamed modules do not pair: rather than a report of every record missing, the user
    is told that the dumps record different models and how to align them."""
    with pytest.raises(DumpError, match=r"the dumps record different models: 1 of A's 30 "
                                        r"modules .* --suggest-map"):
        compare_dumps(dumps / "a", dumps / "port")
    out = CliRunner().invoke(main, [str(dumps / "a"), str(dumps / "port")])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "--suggest-map" in out.output


def test_rules_file_pairs_every_tensor_of_the_port(dumps, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n" + "".join(
        f"  - {{{'glob' if 'glob' in r else 'regex'}: '{r.get('glob', r.get('regex'))}', "
        f"to: '{r['to']}'}}\n" for r in PORT_RULES))
    result = compare_dumps(dumps / "a", dumps / "port", mapping=rules)
    all_paired_and_equal(result)
    assert len(result) == len(tensor_rows(load_dump(dumps / "a")))
    assert "rules.yaml" in result.attrs["name_mapping"]
    runner = CliRunner()
    out = runner.invoke(main, [str(dumps / "a"), str(dumps / "port"), "--map", str(rules)])
    assert out.exit_code == 0, out.output
    assert "renamed by the rules of" in out.output


def test_suggested_rules_pair_every_tensor_of_the_port(dumps, tmp_path):
    suggested = suggest_mapping(load_dump(dumps / "a"), load_dump(dumps / "port"))
    assert suggested.rules
    all_paired_and_equal(compare_dumps(dumps / "a", dumps / "port", mapping=suggested))
    out = CliRunner().invoke(main, [str(dumps / "a"), str(dumps / "port"), "--suggest-map"])
    assert out.exit_code == 0, out.output
    rules = tmp_path / "suggested.json"
    rules.write_text(out.output)
    assert load_mapping(rules).rules == suggested.rules
    out = CliRunner().invoke(main, [str(dumps / "a"), str(dumps / "port"), "--map", str(rules)])
    assert out.exit_code == 0, out.output


def test_suggest_on_same_names_needs_no_rule(dumps):
    assert suggest_mapping(load_dump(dumps / "a"), load_dump(dumps / "a2")).rules == ()


@pytest.mark.parametrize("a, b", [("a", "wrapped"), ("wrapped", "a")])
def test_a_model_wrapped_one_level_deeper_pairs_by_its_prefix(dumps, a, b):
    result = compare_dumps(dumps / a, dumps / b)
    note = result.attrs["name_mapping"]
    assert "prefix" in note and "model" in note
    paired = result[~result["status"].isin([MISSING_IN_A, MISSING_IN_B])]
    assert (paired["max_abs_err"].fillna(0) == 0).all()
    unpaired = result[result["status"].isin([MISSING_IN_A, MISSING_IN_B])]
    # only the wrapper's own call (its root, which A has not) is left, named as B's
    assert set(unpaired["module"]) <= {"[B] <root>", ""}, set(unpaired["module"])
    out = CliRunner().invoke(main, [str(dumps / a), str(dumps / b)])
    assert "renamed by a prefix" in out.output


@pytest.mark.parametrize("pattern, to, path, expected", [
    ("model.**", "{1}", "model", ""),
    ("model.**", "{1}", "model.h.0", "h.0"),
    ("model.layers.*.attn", "h.{1}.attn", "model.layers.12.attn", "h.12.attn"),
    ("model.layers.*.attn", "h.{1}.attn", "model.layers.1.attn.q", None),
    ("**", "model.{1}", "", "model"),
    ("**", "model.{1}", "h.0", "model.h.0"),
])
def test_glob_rules(pattern, to, path, expected):
    assert Rule(pattern, to).rename(path) == expected


def test_rules_refer_only_to_their_wildcards():
    with pytest.raises(ValueError, match="wildcard 2"):
        Rule("model.*", "{2}")


@pytest.mark.parametrize("text, message", [
    ("[{glob: 'a.*'}]", "give exactly one of glob/regex, and to"),
    ("[{glob: 'a.*', regex: 'b', to: c}]", "give exactly one"),
    ("{rules: 3}", "a rules file holds a list"),
    ("[{regex: '(', to: x}]", "not a valid regex"),
    ("rules: [a: b", "not valid YAML"),
    ("[{glob: 'model.layers.*.**', to: 'x.{2}'}]", "two of B's records get one name"),
    ("[{regex: 'model(.*)', to: 'x\\g<name>'}]", "cannot rename"),
])
def test_bad_rules_files_are_one_line_errors(tmp_path, dumps, text, message):
    rules = tmp_path / "bad.yaml"
    rules.write_text(text)
    if "rename" not in message and "one name" not in message:  # found when the rules load
        with pytest.raises(DumpError, match=message):
            load_mapping(rules)
    out = CliRunner().invoke(main, [str(dumps / "a"), str(dumps / "port"), "--map", str(rules)])
    assert out.exit_code == 2
    assert "bad.yaml" in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1


def test_rules_as_json_and_round_trip(tmp_path):
    mapping = NameMapping((Rule("model.**", "{1}"), Rule(r"x(\d)", r"y\1", "regex", ((1, 0),))))
    path = tmp_path / "rules.json"
    path.write_text(mapping.to_text())
    assert load_mapping(path).rules == mapping.rules
    assert json.loads(path.read_text())["rules"][1]["outputs"] == {"1": 0}


@pytest.mark.parametrize("a, b", [("a", "wrapped"), ("wrapped", "a")])
def test_suggested_rules_for_a_wrapped_model(dumps, a, b):
    suggested = suggest_mapping(load_dump(dumps / a), load_dump(dumps / b))
    result = compare_dumps(dumps / a, dumps / b, mapping=suggested)
    unpaired = result[result["status"].isin([MISSING_IN_A, MISSING_IN_B])]
    assert set(unpaired["module"]) <= {"[B] <root>", ""}, set(unpaired["module"])
    assert (result["max_abs_err"].fillna(0) == 0).all()
