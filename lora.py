"""LoRA in plain torch: low-rank adapters on a model's linear layers, switched off for
the KL reference, merged into full weights for the engine, and saved in PEFT's format.

A target y = W0 x becomes y = W0 x + (alpha / r) B A x, with W0 frozen, A [r, in] and
B [out, r] trainable, and B = 0 at the start, so the adapted model starts as the base."""

import json
import math
import os
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base, rank, alpha):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=base.weight.dtype, device=base.weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=base.weight.dtype, device=base.weight.device)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default, so runs compare
        self.scale = alpha / rank
        self.enabled = True

    def forward(self, x):
        y = self.base(x)
        if self.enabled:
            y = y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale  # [..., in] -> [..., r] -> [..., out]
        return y


def add_adapters(model, rank, alpha, targets=DEFAULT_TARGETS):
    """Wrap every nn.Linear whose name ends in one of targets; freeze everything else.
    Returns the wrapped modules' names (Hugging Face names, e.g. model.layers.0.mlp.up_proj)."""
    model.requires_grad_(False)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in targets]
    if not names:
        raise ValueError(f"--lora-targets {','.join(targets)} match no linear layer of this model")
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), rank, alpha))
    return names


@contextmanager
def adapters_off(model):
    """The base model, for the KL reference: no second copy of the weights."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def base_name(name):
    """A wrapped parameter's Hugging Face name: model.x.q_proj.base.weight -> model.x.q_proj.weight."""
    return name.replace(".base.", ".")


def merge(w0, lora_a, lora_b, scale):
    """W0 + scale * B A, computed in float32 and returned in W0's dtype."""
    return (w0.float() + scale * (lora_b.float() @ lora_a.float())).to(w0.dtype)  # [out, in]


def adapter_plan(model_names_and_shapes):
    """(name, shape) of the adapter parameters, in model order: what an adapter sync sends."""
    return [(n, s) for n, s in model_names_and_shapes if n.endswith((".lora_A", ".lora_B"))]


def merged_weights(base, adapters, scale):
    """(Hugging Face name, tensor) of the whole model with the adapters merged in: base is
    {name: W0} from the checkpoint the run started from, adapters {name.lora_A: A, ...}."""
    for name, w0 in base.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and f"{module}.lora_A" in adapters:
            yield name, merge(w0, adapters[f"{module}.lora_A"], adapters[f"{module}.lora_B"], scale)
        else:
            yield name, w0


def save_peft(path, adapters, rank, alpha, targets, base_model):
    """adapter_config.json and adapter_model.safetensors as PEFT writes them, so peft and
    vLLM's LoRA support load the adapter."""
    os.makedirs(path, exist_ok=True)
    tensors = {f"base_model.model.{n}.weight": t.detach().float().contiguous().cpu() for n, t in adapters.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(targets),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_base(path):
    """{Hugging Face name: tensor} of the checkpoint at path, on the CPU: the weights a
    sampler merges adapters into."""
    base = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            base.update(load_file(os.path.join(path, name)))
    return base


def model_adapter_plan(path, rank, alpha, targets):
    """(name, shape) of the adapters of the model at path, built on the meta device: what
    an adapter sync sends."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: not for launch.sh's check

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        add_adapters(model, rank, alpha, targets)
    return adapter_plan([(n, p.shape) for n, p in model.named_parameters()])


def base_for_engine(path):
    """The base weights a sampler merges the adapters into, under the trained model's
    names (a composite stores its text model under others, and its vision tower, which
    the text-only engine lacks, is left out)."""
    from models import text_to_checkpoint, weight_plan

    stored = load_base(path)
    names = text_to_checkpoint([n for n, _ in weight_plan(path)], stored)
    return {n: stored[c] for n, c in names.items() if c in stored}
