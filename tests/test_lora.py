"""LoRA: adapters on the tiny model, the reference as the adapters switched off, the
merge the samplers make, PEFT's file format, and the whole loop with adapters only on the
wire (real torchrun, FSDP2 and vLLM)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import FAST, latest, start, wait_for
from transformers import AutoModelForCausalLM

import lora
from conftest import rows, torchrun


def adapted(path, rank=4, alpha=8.0, seed=0):
    """The tiny model with adapters whose B is random, so that they change the output."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    names = lora.add_adapters(model, rank, alpha)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05)
    return model, names


def test_only_the_adapters_train(tiny_model):
    model, names = adapted(tiny_model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(trainable) == 2 * len(names) == 2 * 7 * model.config.num_hidden_layers  # every attention and MLP linear
    with pytest.raises(ValueError, match="match no linear layer"):
        lora.add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model), 4, 8.0, ("no_such_proj",))


def test_adapters_off_is_the_base_model_and_the_merge_is_the_adapted_one(tiny_model):
    model, _ = adapted(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[5, 60, 70, 80, 90, 100, 3]])
    with torch.no_grad():
        adapted_logits = model(input_ids=ids).logits
        with lora.adapters_off(model):
            reference = model(input_ids=ids).logits
        want = base(input_ids=ids).logits
    assert (adapted_logits - want).abs().max() > 1e-3  # the adapters do something
    assert torch.equal(reference, want)  # the reference is exactly the base model
    # What a sampler does: the base weights from disk, the adapters merged in.
    adapters = {n: p.detach() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    merged = dict(lora.merged_weights(lora.load_base(tiny_model), adapters, 8.0 / 4))
    base.load_state_dict(merged)
    with torch.no_grad():
        gap = (base(input_ids=ids).logits - adapted_logits).abs().max().item()
    assert gap < 1e-5, gap


def test_peft_format(tiny_model, tmp_path):
    model, names = adapted(tiny_model)
    adapters = {n: p for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    lora.save_peft(tmp_path, adapters, 4, 8.0, lora.DEFAULT_TARGETS, tiny_model)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert f"base_model.model.{names[0]}.lora_A.weight" in tensors  # PEFT's key layout
    assert tensors[f"base_model.model.{names[0]}.lora_A.weight"].shape == (4, model.config.hidden_size)
    assert len(tensors) == 2 * len(names)


# On top of test_checkpoint's short float32 run (FAST): a KL, whose reference is the
# adapters switched off, and a larger step.
LORA = ["--beta", 0.1, "--lr", 1e-2, "--lora-rank", 4]


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory):
    """One uninterrupted LoRA run of 4 steps, saving at 2 and 4: checked for its sync and
    outputs, and the reference for the resume test."""
    out = tmp_path_factory.mktemp("lora") / "straight"
    result = torchrun(3, *FAST, *LORA, "--steps", 4, "--save-every", 2, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-4000:]
    return out


def test_lora_run_syncs_adapters_only_and_the_sampler_matches(lora_run, tiny_model):
    """After each sync the sampler (base + merged adapters, in vLLM) equals the learner's
    adapted policy to float32 noise, while only the adapters cross the weight group.
    final/ is the merged model, adapter/ PEFT's."""
    lora_rows = rows(lora_run)
    assert [r["step"] for r in lora_rows] == [0, 1, 2, 3]
    for r in lora_rows:
        assert r["mismatch_max"] < 1e-4, r["mismatch_max"]
        assert r["grad_norm"] > 0
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    full_mb = sum(t.numel() * 4 for t in initial.values()) / 2**20  # what full fine-tuning sends in float32
    print(f"sync MB: lora {lora_rows[0]['sync_mb']:.4f}, the whole model {full_mb:.4f}")
    assert 0 < lora_rows[0]["sync_mb"] < 0.2 * full_mb
    assert lora_rows[0]["kl"] < 1e-6  # step 0: adapted == base
    merged = load_file(lora_run / "final" / "model.safetensors")
    assert merged.keys() == initial.keys()
    assert max((merged[k] - initial[k]).abs().max().item() for k in merged) > 1e-5
    assert (lora_run / "final" / "adapter" / "adapter_config.json").exists()


def test_lora_resume_after_kill_is_exact(lora_run, tmp_path):
    """kill -9 at step 2 of 4, resume, and the adapters equal an uninterrupted run's."""
    import signal

    broken = tmp_path / "broken"
    proc = start(broken, *LORA, "--steps", 1000, "--save-every", 2)
    wait_for(lambda: latest(broken) == "step_2", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    result = torchrun(3, *FAST, *LORA, "--steps", 4, "--out-dir", broken, "--resume")
    assert result.returncode == 0, result.stdout[-3000:]
    a = load_file(lora_run / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(broken / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max(a[k].abs().max().item() for k in a if "lora_B" in k)
    print(f"LoRA resumed vs straight adapters: max abs diff {diff:.2e} (B moved to {moved:.2e})")
    assert moved > 0 and diff == 0.0
