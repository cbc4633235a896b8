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


def test_lora_rank_alone_gets_loras_learning_rates_and_the_outer_layers_are_refused(capsys):
    """--lora-rank R alone: A at LORA_LR x full fine-tuning's lr, B at 16x that, alpha 32
    for any rank; a given --lr is A's as given. Adapters on the embeddings or the output
    layer are refused in one line, before any model loads."""
    from config import LORA_LR, parse_config, resolve
    from conftest import refusal

    def resolved(args):
        cfg = resolve(parse_config([*args.split(), "--out-dir", "/nonexistent/run"]), world_size=3, has_gpu=False)
        return cfg.lr, cfg.lora_b_lr, cfg.lora_alpha

    full_lr = resolved("")[0]
    assert resolved("--lora-rank 16") == resolved("--lora-rank 1")[:2] + (32.0,) == (LORA_LR * full_lr, 16.0, 32.0)
    assert resolved("--lora-rank 16 --lr 2e-4 --lora-b-lr 4 --lora-alpha 8") == (2e-4, 4.0, 8.0)
    assert resolved("--lr 2e-4") == (2e-4, 16.0, 32.0)  # full fine-tuning has no B: the flag is inert
    assert "--lora-targets lm_head:" in refusal(capsys, "--lora-rank 4 --lora-targets q_proj,lm_head")
    assert "--lora-targets embed_tokens:" in refusal(capsys, "--lora-rank 4 --lora-targets embed_tokens")
    assert "--lora-b-lr must be > 0" in refusal(capsys, "--lora-rank 4 --lora-b-lr 0")


def test_adams_first_step_moves_b_at_lora_b_lr_times_as_far_as_a(tiny_model, gloo_world):
    """LoRA+'s two learning rates are two optimizer groups: with every gradient 1, Adam's
    first step moves each A entry by lr and each B entry by lora_b_lr x lr."""
    from torch.distributed.device_mesh import init_device_mesh

    from learner import Learner

    adapters = (4, 32.0, lora.DEFAULT_TARGETS)
    learner = Learner(tiny_model, init_device_mesh("cpu", (1,)), torch.device("cpu"), 1e-3, lora=adapters, lora_b_lr=16)
    before = {n: p.detach().full_tensor().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    for p in learner.trainable:
        p.grad = torch.ones_like(p)
    learner.optimizer.step()
    for n, p in learner.model.named_parameters():
        if p.requires_grad:
            step = (p.detach().full_tensor() - before[n]).abs()
            want = 1.6e-2 if n.endswith("lora_B") else 1e-3
            assert torch.allclose(step, torch.full_like(step, want), rtol=1e-4), (n, step.max().item())


# On top of test_checkpoint's short float32 run (FAST): a KL, whose reference is the
# adapters switched off, and LoRA's own learning rates.
LORA = ["--beta", 0.1, "--lora-rank", 4]


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
