"""The Hugging Face Trainer callback with the real ``transformers.Trainer`` (tiny GPT-2, random
weights, no download), gradient accumulation 2: the right optimizer steps are dumped, every
micro-batch recorded, parameter gradients once, numerics unchanged, and two runs compare."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from click.testing import CliRunner  # noqa: E402

from compare import compare_dumps, load_dump  # noqa: E402
from compare.cli import main  # noqa: E402
from dumper.hf_callback import H5cmpCallback  # noqa: E402
from tests.architectures import build  # noqa: E402


def train(directory, callback=None, fp16_scale=None):
    """Three optimizer steps; with ``fp16_scale``, float16 autocast and a loss scaled by
    accelerate's GradScaler (on a CPU, accelerate makes none: one is given to it)."""
    model, _ = build("gpt2", "float32", seed=0)
    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (12, 10),
                                                                         generator=gen)]
    args = transformers.TrainingArguments(
        str(directory / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0, seed=7,
        fp16=fp16_scale is not None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[callback] if callback else [])
    if fp16_scale is not None:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=fp16_scale)
    trainer.train()
    return model


def test_trainer_dumps_the_chosen_optimizer_step_with_both_micro_batches(tmp_path):
    options = dict(steps=[1], params=True)
    model = train(tmp_path, H5cmpCallback(tmp_path / "a", **options))
    plain = train(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    files = sorted(p.name for p in (tmp_path / "a").glob("*.hdf5"))
    assert files == ["0-epoch_1-step_dump.hdf5"]
    index = load_dump(tmp_path / "a").index
    root = index[(index["module"] == "") & (index["kind"] == "output")]
    assert sorted(set(root["call_idx"])) == [0, 1]  # two micro-batches
    per_pass = index[index["kind"] != "param_grad"]  # GPT-2 calls each module once per pass
    assert (per_pass["micro_batch"] == per_pass["call_idx"]).all()
    grads = index[index["kind"] == "param_grad"]
    assert (grads["micro_batch"] == -1).all()  # accumulated over both
    own = sum(len(list(m.parameters(recurse=False))) for m in model.modules())
    assert len(grads) == own  # per module (the tied lm_head/wte weight under both)
    assert grads.duplicated(["module", "index"]).sum() == 0  # once, accumulated
    train(tmp_path, H5cmpCallback(tmp_path / "b", **options))
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert (result["status"] == "equal").all()
    assert CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "b")]).exit_code == 0


def test_a_dumper_or_its_arguments_not_both(tmp_path):
    from dumper import HookerAndDumper
    dumper = HookerAndDumper(tmp_path)
    assert H5cmpCallback(dumper=dumper).dumper is dumper
    with pytest.raises(TypeError, match="H5cmpCallback: pass either a dumper"):
        H5cmpCallback(tmp_path, dumper=dumper)


def test_trainer_records_the_loss_scale_of_its_grad_scaler(tmp_path):
    """fp16=True: the callback takes accelerate's GradScaler from the optimizer it steps, so
    the dump records the scale its gradients carry and compares with a float32 run."""
    train(tmp_path, H5cmpCallback(tmp_path / "a", steps=[0], params=True))
    train(tmp_path, H5cmpCallback(tmp_path / "b", steps=[0]), fp16_scale=1024.0)
    index = load_dump(tmp_path / "b").index
    grads = index[index["kind"].isin(["grad_input", "grad_output"])]
    assert len(grads) and (grads["grad_scale"] == 1024.0).all()
    run = CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert run.exit_code == 0 and "B diverges" not in run.output, run.output
