"""Real architectures for the verdict tests and ``scripts/bench_localize.py``: Hugging Face
``transformers`` models built from tiny configs with random weights (no download), a
torchvision-style ResNet with in-place ReLU, an ``nn.LSTM`` language model and a deep residual
MLP. Every builder is deterministic in its seed.

``run_step(arch, precision, directory, ...)`` dumps a training step (forward, loss, backward)
of ``arch`` at ``precision``: ``float32``; ``float64`` (the model and float inputs in double);
``bfloat16`` / ``float16`` (float32 weights under ``torch.autocast(device, dtype=...)``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Optional

import torch
from torch import nn

PRECISIONS = ("float32", "float64", "bfloat16", "float16")


@dataclasses.dataclass
class Arch:
    """A model factory, its batch and its loss, all deterministic."""

    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict]
    loss: Callable[[nn.Module, dict], torch.Tensor]


def _hf(config_name: str, model_name: str, **config) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers
        transformers.logging.set_verbosity_error()  # tiny configs draw harmless warnings
        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, model_name)(cfg).train()
    return make


def _tokens(vocab: int = 96, batch: int = 2, length: int = 12):
    def batch_of(gen: torch.Generator) -> dict:
        ids = torch.randint(0, vocab, (batch, length), generator=gen)
        return {"input_ids": ids, "labels": ids}
    return batch_of


def _masked_tokens(vocab: int = 96, batch: int = 2, length: int = 12, masked: int = 4,
                   mask_id: int = 3):
    """A masked-language-model batch: ``masked`` positions per row (drawn with replacement)
    replaced by ``mask_id``, the loss on those only."""
    def batch_of(gen: torch.Generator) -> dict:
        ids = torch.randint(0, vocab, (batch, length), generator=gen)
        at = torch.zeros_like(ids, dtype=torch.bool).scatter_(
            1, torch.randint(0, length, (batch, masked), generator=gen), True)
        return {"input_ids": ids.masked_fill(at, mask_id),
                "labels": ids.masked_fill(~at, -100)}
    return batch_of


def _audio_batch(gen: torch.Generator) -> dict:
    """Log-mel-like features for a tiny Whisper (8 bins, 32 frames) and target tokens."""
    return {"input_features": torch.randn(2, 8, 32, generator=gen),
            "labels": torch.randint(0, 96, (2, 12), generator=gen)}


def _hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


_TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=32)
_NO_DROPOUT_BERT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-bn-relu(in place)-conv-bn, + shortcut, relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A small torchvision-style ResNet (stem, two stages of BasicBlocks, pool, fc)."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 96, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        out, _ = self.lstm(self.embed(input_ids))
        return self.head(self.norm(out))


class ResidualMLPBlock(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def _deep_mlp(depth: int = 12, width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), *[ResidualMLPBlock(width) for _ in range(depth)],
                         nn.LayerNorm(width), nn.Linear(width, 4))


def _image_batch(gen: torch.Generator) -> dict:
    return {"x": torch.randn(4, 3, 16, 16, generator=gen),
            "y": torch.randint(0, 10, (4,), generator=gen)}


def _classification_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]).float(), batch["y"])


def _lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"]).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def _vector_batch(gen: torch.Generator) -> dict:
    return {"x": torch.randn(16, 16, generator=gen), "y": torch.randint(0, 4, (16,), generator=gen)}


def _vit_batch(gen: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 10, (2,), generator=gen)}


# The verdict's constants were tuned on the architectures above; the ones below were chosen
# before their results were looked at and are held out from tuning (scripts/bench_localize.py
# reports them apart): an encoder-decoder, a q/k-norm decoder, a parallel-attention decoder,
# another mixture of experts, a ConvNeXt and a MobileNetV2 (depthwise convolutions, ReLU6),
# then a Bloom and a RegNet.
ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch(_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_TINY),
                  _tokens(), _hf_loss),
    "gpt2": Arch(_hf("GPT2Config", "GPT2LMHeadModel", vocab_size=96, n_embd=48, n_layer=2,
                     n_head=4, n_positions=32, **_NO_DROPOUT_GPT2), _tokens(), _hf_loss),
    "bert": Arch(_hf("BertConfig", "BertForMaskedLM", **_TINY, **_NO_DROPOUT_BERT), _tokens(),
                 _hf_loss),
    "mixtral": Arch(_hf("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager",
                        **_TINY), _tokens(), _hf_loss),
    "vit": Arch(_hf("ViTConfig", "ViTForImageClassification", image_size=16, patch_size=4,
                    hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=96, num_labels=10, **_NO_DROPOUT_BERT), _vit_batch, _hf_loss),
    "resnet": Arch(ResNet, _image_batch, _classification_loss),
    "lstm": Arch(LSTMLanguageModel, _tokens(), _lm_loss),
    "mlp": Arch(_deep_mlp, _vector_batch, _classification_loss),
}
HELD_OUT: dict[str, Arch] = {
    "t5": Arch(_hf("T5Config", "T5ForConditionalGeneration", vocab_size=96, d_model=48, d_kv=12,
                   d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                   decoder_start_token_id=0), _tokens(), _hf_loss),
    "qwen3": Arch(_hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=12,
                      **_TINY), _tokens(), _hf_loss),
    "gpt_neox": Arch(_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", use_parallel_residual=True,
                         hidden_dropout=0.0, attention_dropout=0.0, **_TINY), _tokens(), _hf_loss),
    "qwen2_moe": Arch(_hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64, **_TINY), _tokens(), _hf_loss),
    "convnext": Arch(_hf("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[8, 16],
                         depths=[1, 1], num_stages=2, patch_size=2, image_size=16, num_labels=10),
                     _vit_batch, _hf_loss),
    "mobilenet_v2": Arch(_hf("MobileNetV2Config", "MobileNetV2ForImageClassification",
                             image_size=16, depth_multiplier=0.25, num_labels=10),
                         _vit_batch, _hf_loss),
    # added 2026-11-25 once MobileNetV2's healthy pairs had been studied to model cancelling
    # sums and normalizations (it is no longer unseen): chosen, and built, before any result
    # of theirs was looked at: ALiBi attention with a fused query-key-value, and a RegNet
    # (grouped convolutions, squeeze-and-excitation, BatchNorm)
    "bloom": Arch(_hf("BloomConfig", "BloomForCausalLM", vocab_size=96, hidden_size=48, n_layer=2,
                      n_head=4, hidden_dropout=0.0, attention_dropout=0.0), _tokens(), _hf_loss),
    "regnet": Arch(_hf("RegNetConfig", "RegNetForImageClassification", embedding_size=8,
                       hidden_sizes=[8, 16], depths=[1, 1], groups_width=4, num_labels=10),
                   _vit_batch, _hf_loss),
    # added 2026-11-28 (sixteenth session), chosen and built before any result of theirs was
    # looked at: a selective state-space model (Mamba: a recurrent scan, a causal depthwise
    # convolution, gating), a Gemma2 decoder (logit soft-capping, norms before and after each
    # block, alternating sliding-window attention) and a SegFormer (attention over a
    # spatially reduced sequence, depthwise convolutions in its feed-forward layers)
    "mamba": Arch(_hf("MambaConfig", "MambaForCausalLM", vocab_size=96, hidden_size=48,
                      state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                      use_mambapy=False), _tokens(), _hf_loss),
    "gemma2": Arch(_hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=12,
                       sliding_window=8, **_TINY), _tokens(), _hf_loss),
    "segformer": Arch(_hf("SegformerConfig", "SegformerForImageClassification", num_channels=3,
                          num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                          hidden_sizes=[16, 32], patch_sizes=[3, 3], strides=[2, 2],
                          num_attention_heads=[1, 2], mlp_ratios=[2, 2], hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                          classifier_dropout_prob=0.0, num_labels=10), _vit_batch, _hf_loss),
    # added 2026-11-29 (nineteenth session), chosen and built before any result of theirs was
    # looked at: a Swin (shifted-window attention with a relative position bias, patch
    # merging), a DeBERTa-v2 (disentangled content-to-position attention) and a Falcon
    # (multi-query attention, attention and feed-forward in parallel, rotary embedding);
    # DeBERTa-v2's results at seeds 1-3 were then studied (a parameter handed on as an input)
    "swin": Arch(_hf("SwinConfig", "SwinForImageClassification", image_size=16, patch_size=2,
                     embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, mlp_ratio=2.0,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     drop_path_rate=0.0, num_labels=10), _vit_batch, _hf_loss),
    "deberta_v2": Arch(_hf("DebertaV2Config", "DebertaV2ForMaskedLM", **_TINY,
                           **_NO_DROPOUT_BERT, relative_attention=True, position_buckets=8,
                           pos_att_type=["c2p", "p2c"]), _tokens(), _hf_loss),
    "falcon": Arch(_hf("FalconConfig", "FalconForCausalLM", vocab_size=96, hidden_size=48,
                       num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                       parallel_attn=True, new_decoder_architecture=False, alibi=False,
                       hidden_dropout=0.0, attention_dropout=0.0), _tokens(), _hf_loss),
    # added 2026-11-29 (twentieth session), chosen and built before any result of theirs was
    # looked at: a Whisper (a convolutional audio front end, an encoder-decoder with cross
    # attention), an RWKV (a recurrence over time with exponential decay, token shift) and a
    # Funnel Transformer (the sequence pooled between blocks and upsampled back, relative
    # attention; a masked-language-model loss)
    "whisper": Arch(_hf("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=96,
                        num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, d_model=48,
                        encoder_ffn_dim=96, decoder_ffn_dim=96, max_source_positions=16,
                        max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, decoder_start_token_id=0, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2), _audio_batch, _hf_loss),
    "rwkv": Arch(_hf("RwkvConfig", "RwkvForCausalLM", vocab_size=96, hidden_size=48,
                     num_hidden_layers=2, attention_hidden_size=48, intermediate_size=96,
                     context_length=32), _tokens(), _hf_loss),
    "funnel": Arch(_hf("FunnelConfig", "FunnelForMaskedLM", vocab_size=96, block_sizes=[1, 1],
                       d_model=48, n_head=4, d_head=12, d_inner=96, hidden_dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, num_decoder_layers=1),
                   _masked_tokens(), _hf_loss),
    # added 2026-12-02 (twenty-eighth session), chosen and built before any result of theirs
    # was looked at: an ALBERT (one layer's modules shared by every depth: each called once per
    # layer; factorized embeddings), a Phi (partial rotary embedding, attention and
    # feed-forward in parallel off one LayerNorm) and a DINOv2 (layer scale, SwiGLU
    # feed-forward)
    "albert": Arch(_hf("AlbertConfig", "AlbertForMaskedLM", vocab_size=96, embedding_size=16,
                       hidden_size=48, num_hidden_layers=3, num_hidden_groups=1,
                       num_attention_heads=4, intermediate_size=96, max_position_embeddings=32,
                       classifier_dropout_prob=0.0, **_NO_DROPOUT_BERT), _tokens(), _hf_loss),
    "phi": Arch(_hf("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5, resid_pdrop=0.0,
                    embd_pdrop=0.0, attention_dropout=0.0, **_TINY), _tokens(), _hf_loss),
    "dinov2": Arch(_hf("Dinov2Config", "Dinov2ForImageClassification", image_size=16,
                       patch_size=4, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                       mlp_ratio=2, use_swiglu_ffn=True, layerscale_value=0.1, drop_path_rate=0.0,
                       num_labels=10, **_NO_DROPOUT_BERT), _vit_batch, _hf_loss),
}
ARCHITECTURES.update(HELD_OUT)


def build(arch: str, precision: str, seed: int = 0, device: str = "cpu", dropout: bool = True
          ) -> tuple[nn.Module, dict]:
    """The model of ``arch`` (weights from ``seed``) and its batch, at ``precision``, on
    ``device``; with ``dropout=False`` its dropout layers drop nothing (runs on two devices
    draw different random numbers, so their masks would differ)."""
    spec = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = spec.make()
    if not dropout:
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0
    batch = spec.batch(torch.Generator().manual_seed(seed + 1))
    if precision == "float64":
        model = model.double()
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    return model.to(device), {k: v.to(device) for k, v in batch.items()}


def precision_context(precision: str, device: str = "cpu"):
    """What the step runs under: autocast for the 16-bit precisions, nothing otherwise."""
    if precision in ("bfloat16", "float16"):
        return torch.autocast(torch.device(device).type, dtype=getattr(torch, precision))
    return contextlib.nullcontext()


@functools.cache
def cannot_run(arch: str, precision: str, device: str = "cpu") -> str:
    """Why torch itself cannot run a training step of ``arch`` at ``precision`` on this
    machine, with no dumper involved (e.g. oneDNN has no bfloat16 LSTM kernel on CPUs without
    native bfloat16 arithmetic), or "" when it can. Tests skip such variants with this reason;
    a failure with the dumper attached in a variant torch runs is ours."""
    model, batch = build(arch, precision, 0, device)
    try:
        with precision_context(precision, device):
            loss = ARCHITECTURES[arch].loss(model, batch)
        loss.backward()
    except (RuntimeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"
    return ""


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def run_step(arch: str, precision: str, directory, *, seed: int = 0,
             plant: Optional[dict] = None, plant_last_only: bool = False,
             dumper_options: Optional[dict] = None, steps: int = 1, optimizer: str = "sgd",
             device: str = "cpu", dropout: bool = True, loss_scale: Optional[float] = None
             ) -> float:
    """Train ``arch`` at ``precision`` for ``steps`` optimizer steps (``OPTIMIZERS``) on one
    batch and dump the last one into ``directory`` (``dumper_options`` are passed to
    ``HookerAndDumper``, e.g. ``{"params": True}`` or ``{"inject": reference}``); ``plant`` is
    passed to ``dumper.perturb`` (e.g. ``{"include": "model.layers.0.mlp", "scale": 1.1,
    "where": "output"}``), in every step, or in the dumped one only with ``plant_last_only``.
    With ``loss_scale``, the loss is scaled by a ``torch.amp.GradScaler`` starting there (as
    float16 mixed precision trains), which the dumper is given. Returns the last loss."""
    from dumper import HookerAndDumper, perturb
    model, batch = build(arch, precision, seed, device, dropout)
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=loss_scale or 1.0,
                                  enabled=loss_scale is not None)
    dumper = HookerAndDumper(directory, steps=[steps - 1], scaler=scaler,
                             **(dumper_options or {}))
    planted = None
    for step in range(steps):
        if plant and planted is None and (not plant_last_only or step == steps - 1):
            planted = perturb(model, **plant)
        with dumper.hooks(model, 0, step):
            with precision_context(precision, device):
                loss = ARCHITECTURES[arch].loss(model, batch)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    if planted is not None:
        planted.remove()
    return float(loss.detach())
