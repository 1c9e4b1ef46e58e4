"""The Lightning callback with a real ``lightning.Trainer`` (CPU, tiny GPT-2 in a
LightningModule, gradient accumulation 2): the right optimizer step is dumped with both
micro-batches, numerics unchanged, two runs compare, and the LightningModule's ``model.``
prefix pairs with a plain dump of the same model."""
from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from compare import compare_dumps, load_dump  # noqa: E402
from dumper import HookerAndDumper, NonFiniteError  # noqa: E402
from dumper.lightning_callback import H5cmpLightningCallback  # noqa: E402
from tests.architectures import build  # noqa: E402


class LitGPT2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model, _ = build("gpt2", "float32", seed=0)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def data():
    return torch.randint(0, 96, (12, 10), generator=torch.Generator().manual_seed(5))


def fit(callback=None, fp16_scale=None):
    """Three optimizer steps; with ``fp16_scale``, precision 16-mixed, its loss scaled by the
    plugin's GradScaler."""
    module = LitGPT2()
    plugins = [] if fp16_scale is None else [MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=fp16_scale))]
    trainer = pl.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback] if callback else [],
                         plugins=plugins)
    trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=2))
    return module


def test_lightning_dumps_the_chosen_optimizer_step(tmp_path):
    module = fit(H5cmpLightningCallback(tmp_path / "a", steps=[1], params=True))
    plain = fit()
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), plain.parameters()))
    assert sorted(p.name for p in (tmp_path / "a").glob("*.hdf5")) == ["0-epoch_1-step_dump.hdf5"]
    index = load_dump(tmp_path / "a").index
    # training_step calls self.model, not the LightningModule: "model" is the outermost call
    outer = index[(index["module"] == "model") & (index["kind"] == "output")]
    assert sorted(set(outer["call_idx"])) == [0, 1]  # two micro-batches
    per_pass = index[index["kind"] != "param_grad"]
    assert (per_pass["micro_batch"] == per_pass["call_idx"]).all()
    grads = index[index["kind"] == "param_grad"]
    assert len(grads) and grads.duplicated(["module", "index"]).sum() == 0  # once, accumulated
    fit(H5cmpLightningCallback(tmp_path / "b", steps=[1], params=True))
    assert (compare_dumps(tmp_path / "a", tmp_path / "b")["status"] == "equal").all()


def test_a_lightning_dump_pairs_with_a_plain_one_by_its_prefix(tmp_path):
    fit(H5cmpLightningCallback(tmp_path / "lit", steps=[0], kinds=["output"]))
    model, _ = build("gpt2", "float32", seed=0)
    batch = data()[:2]
    with HookerAndDumper(tmp_path / "plain", kinds=["output"]).hooks(model, 0, 0):
        model(input_ids=batch, labels=batch).loss.backward()
    result = compare_dumps(tmp_path / "plain", tmp_path / "lit", steps=["0:0"])
    assert "prefix" in result.attrs["name_mapping"]
    first = result[result["call_idx"] == 0]  # the plain run did one micro-batch
    paired = first[first["status"].isin(["equal"])]
    assert len(paired) >= 0.9 * len(first[first["module"] != "[B] <root>"])


def test_lightning_records_the_loss_scale_of_its_grad_scaler(tmp_path):
    """precision 16-mixed: the callback takes the precision plugin's GradScaler, so the dump
    records the scale its gradients carry and compares with a float32 run."""
    fit(H5cmpLightningCallback(tmp_path / "a", steps=[0], params=True))
    fit(H5cmpLightningCallback(tmp_path / "b", steps=[0]), fp16_scale=1024.0)
    index = load_dump(tmp_path / "b").index
    grads = index[index["kind"].isin(["grad_input", "grad_output"])]
    assert len(grads) and (grads["grad_scale"] == 1024.0).all()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert not (result["status"] == "DIFF").any(), result[result["status"] == "DIFF"]


def test_a_dumper_or_its_arguments_not_both(tmp_path):
    dumper = HookerAndDumper(tmp_path)
    assert H5cmpLightningCallback(dumper=dumper).dumper is dumper
    with pytest.raises(TypeError, match="H5cmpLightningCallback: pass either a dumper"):
        H5cmpLightningCallback(steps=[1], dumper=dumper)


class LitFailing(pl.LightningModule):
    """A Linear whose training step raises (``error``) or makes NaN (the sentinel raises) at
    optimizer step 1."""

    def __init__(self, error: bool):
        super().__init__()
        self.lin = torch.nn.Linear(10, 4)
        self.error = error

    def training_step(self, batch, batch_idx):
        x = batch.float()
        if self.trainer.global_step == 1:
            if self.error:
                raise RuntimeError("the user's step failed")
            x = x * float("nan")
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("error", [True, False], ids=["error", "nan"])
def test_a_step_that_raises_in_lightning_leaves_no_hook(tmp_path, error):
    """A failing step is discarded (an error) or published marked incomplete (NaN/Inf): no
    hook stays on the module, the collector runs again, no lock or temporary file is left."""
    import gc
    module = LitFailing(error)
    callback = H5cmpLightningCallback(tmp_path, steps=[1], on_nonfinite="raise")
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with pytest.raises(RuntimeError if error else NonFiniteError):
        trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=2))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())
    assert gc.isenabled()
    files = sorted(p.name for p in tmp_path.iterdir())
    if error:
        assert files == []
    else:
        assert files == ["0-epoch_1-step_dump.hdf5"]
        assert "NonFiniteError" in load_dump(tmp_path).steps[0].incomplete
