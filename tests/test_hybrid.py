"""Hybrid models (gated delta net layers beside attention) and composite checkpoints,
on tiny random-init models built here (tests/plugins/hybrid_models.py):

- a Qwen3-Next (linear + full attention, 4 experts, tied embeddings) through the real
  engine and the real loop in bf16: vLLM's CPU engine with prefix caching off, its
  in-place reload (experts included), FSDP2 over transformers' pure-torch gated delta net;
- a composite Qwen3.5 checkpoint (vision tower + hybrid text model, the hub layout of
  Qwen/Qwen3.5-4B): the name mapping between the trained text model and the checkpoint,
  the engine loading the learner's weights under the checkpoint's names, and a save that
  gives back the same architecture."""

import json
import math
import os

import pytest
import torch
from hybrid_models import build_tiny_qwen3_5_composite, build_tiny_qwen3_next

from conftest import FAST, rows, torchrun
from models import checkpoint_files, is_hybrid, text_to_checkpoint, weight_plan

TOL = 1e-2  # mean |sampler - learner| log-prob in bf16; a missed or wrong sync gives 1e-1 and more


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("hybrid") / "qwen3-next", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def composite(tmp_path_factory):
    return build_tiny_qwen3_5_composite(tmp_path_factory.mktemp("hybrid") / "qwen3_5")


@pytest.fixture(scope="module")
def tied_composite(tmp_path_factory):
    """Qwen/Qwen3.5-4B's own layout: a composite whose text model ties its head."""
    return build_tiny_qwen3_5_composite(tmp_path_factory.mktemp("hybrid") / "qwen3_5_tied", tie_word_embeddings=True)


def safetensors(path):
    """Every tensor a folder stores, by its stored name, over all its shards."""
    from safetensors.torch import load_file

    return {k: v for file in sorted(set(checkpoint_files(str(path)).values())) for k, v in load_file(file).items()}


# ---------------------------------------------------------------- configs and names


def test_layer_types_tell_a_hybrid_model(qwen3_next, composite, tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]).save_pretrained(tmp_path)
    assert is_hybrid(qwen3_next) and is_hybrid(composite)  # the composite's text_config is read
    assert not is_hybrid(str(tmp_path))


def test_text_names_map_onto_the_checkpoint(qwen3_next, composite):
    stored = checkpoint_files(composite)
    names = [n for n, _ in weight_plan(composite)]
    mapping = text_to_checkpoint(names, stored)
    assert set(mapping) == set(names) and set(mapping.values()) <= set(stored)
    assert mapping["model.embed_tokens.weight"] == "model.language_model.embed_tokens.weight"
    assert mapping["lm_head.weight"] == "lm_head.weight"
    assert {k for k in stored if k.startswith("model.visual.")} and not any(
        v.startswith("model.visual.") for v in mapping.values()
    )
    # A text checkpoint maps to itself, fused experts (stored split per expert) included.
    names = [n for n, _ in weight_plan(qwen3_next)]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert text_to_checkpoint(names, checkpoint_files(qwen3_next)) == {n: n for n in names}


def test_text_names_map_by_stored_names_alone():
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    llava = [
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.0.mlp.up_proj.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "vision_tower.norm.weight",
        "vision_tower.head.weight",
    ]
    assert text_to_checkpoint(names, llava) == {n: "language_model." + n for n in names}
    # 'norm.weight' alone would also fit vision_tower.: the other names decide.
    with pytest.raises(ValueError, match="cannot place model"):
        text_to_checkpoint(["model.norm.weight"], ["a.norm.weight", "b.norm.weight"])


@pytest.mark.parametrize("which", ["composite", "tied_composite"])
def test_a_trained_composite_saves_as_the_same_architecture(which, request, tmp_path, gloo_world, monkeypatch):
    """The learner trains the text model AutoModelForCausalLM makes of the composite;
    its save is the composite again: same config.json and processor files, the trained
    text weights under the checkpoint's own names, the vision tower untouched. The full
    state dict comes as a GPU gives it: every name its own copy, a tied head too (on a
    CPU the two names share storage, which hid an H200's failed save of a tied composite)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForConditionalGeneration

    import learner as learner_module
    from learner import Learner

    composite = request.getfixturevalue(which)
    full_state = learner_module.get_model_state_dict
    monkeypatch.setattr(
        learner_module, "get_model_state_dict", lambda *a, **k: {n: t.clone() for n, t in full_state(*a, **k).items()}
    )
    learner = Learner(composite, init_device_mesh("cpu", (1,)), torch.device("cpu"), lr=1e-3)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # "training"
    trained = {n: learner.full_tensor(n, torch.float32).clone() for n, _ in weight_plan(composite)}
    saved = tmp_path / "final"
    learner.save(str(saved), AutoTokenizer.from_pretrained(composite))

    for name in ("config.json", "preprocessor_config.json"):
        assert (saved / name).read_text() == open(os.path.join(composite, name)).read(), name
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    original, written = safetensors(composite), safetensors(saved)
    assert set(written) == set(original)  # every name the checkpoint's own
    mapping = text_to_checkpoint(list(trained), original)
    for name, tensor in trained.items():
        assert torch.equal(written[mapping[name]], tensor), name
    for name in set(original) - set(mapping.values()):
        assert name.startswith("model.visual.") and torch.equal(written[name], original[name]), name

    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = model.state_dict()
    assert all(torch.equal(state[mapping[n]], t) for n, t in trained.items())
    text = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    assert all(torch.equal(text[n], t) for n, t in trained.items())


def test_the_learner_computes_with_the_parameters_the_engine_keeps_in_float32(composite, gloo_world):
    """vLLM keeps a gated delta net's A_log in float32 under bf16 (the engine's kept_dtypes);
    the learner's forward uses it in float32 too, exactly the master's values, while the
    module's other direct parameter (dt_bias) stays bf16, as the engine holds it, and so do
    its linear children. The master weights are untouched by the forward, both parameters
    still get their gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from learner import Learner

    kept = {"linear_attn.A_log": torch.float32}
    learner = Learner(
        composite,
        init_device_mesh("cpu", (1,)),
        torch.device("cpu"),
        1e-3,
        compute_dtype=torch.bfloat16,
        kept_dtypes=kept,
    )
    (name, delta) = next((n, m) for n, m in learner.model.named_modules() if n.endswith("linear_attn"))
    master = {k: learner.full_tensor(f"{name}.{k}", torch.float32).clone() for k in ("A_log", "dt_bias")}
    assert not torch.equal(master["A_log"], master["A_log"].bfloat16().float())  # bf16 would round it
    seen = {}
    delta.register_forward_pre_hook(  # after the learner's own: what the forward reads
        lambda m, args: seen.update(
            A_log=m.A_log.detach().clone(), dt_bias=m.dt_bias.dtype, proj=m.out_proj.weight.dtype
        )
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    learner.model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    assert seen["A_log"].dtype == torch.float32 and torch.equal(seen["A_log"], master["A_log"])
    assert seen["dt_bias"] == seen["proj"] == torch.bfloat16, "as the engine holds them"
    for k, value in master.items():
        assert torch.equal(learner.full_tensor(f"{name}.{k}", torch.float32), value), f"{k}: the master changed"
        grad = learner.named_params[f"{name}.{k}"].grad
        assert grad is not None and grad.full_tensor().abs().sum() > 0, k


# ---------------------------------------------------------------- the engine


def gap(model, completions):
    """Mean |log-prob| difference between the engine's samples and a transformers forward."""
    diffs = []
    for c in completions:
        ids = torch.tensor([c["prompt_ids"] + c["token_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(c["prompt_ids"]) - 1 :]
        diffs.append((lp - torch.tensor(c["sampler_logprobs"])).abs())
    return torch.cat(diffs).mean().item()


def perturbed(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5 * p.std().clamp(min=0.02))
    return model


@pytest.mark.system  # starts its own processes or model: not in the fast tier
@pytest.mark.parametrize("which", ["qwen3_next", "composite"])
def test_the_engine_loads_the_learners_weights_in_place(which, request):
    """bf16 on CPU (the gated delta net kernel takes nothing else), prefix caching off.
    New weights, sent under the learner's names and wire dtypes, load in place: Qwen3-Next's
    experts (CPU-packed, which vLLM's reload forgets to redo) and tied head, and the
    composite's text model under the checkpoint's model.language_model.* names.
    Before any sync the engine is the checkpoint: vLLM's Qwen3-Next never loads a tied
    output layer (Sampler ties it), and sampled from uninitialised memory without that."""
    from transformers import AutoModelForCausalLM

    from comm import wire_dtype
    from sampler import Sampler

    path = request.getfixturevalue(which)
    engine = Sampler(path, 256, seed=0, dtype="bfloat16", kv_cache_gb=0.25)
    assert engine.dtype == torch.bfloat16 and engine.kept_dtypes == {"linear_attn.A_log": torch.float32}
    assert not engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    prompts = [[10 + i, 20 + i, 30, 40, 50 + i] for i in range(4)]
    as_loaded = engine.sample(prompts, 3, 16, 1.0, key=(1,))
    assert gap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), as_loaded) < TOL
    model = perturbed(path)
    params = dict(model.named_parameters())
    stale = gap(model, as_loaded)
    assert stale > 5 * TOL  # the perturbation is visible
    engine.load_weights(
        (n, params[n].detach().to(wire_dtype(n, engine.dtype, engine.kept_dtypes))) for n, _ in weight_plan(path)
    )
    fresh = gap(model, engine.sample(prompts, 3, 16, 1.0, key=(1,)))
    print(f"{which}: log-prob gap to the new weights before sync {stale:.3f}, after {fresh:.4f}")
    assert fresh < TOL


# ---------------------------------------------------------------- the loop


# A reward that varies within every group of a random model, a high learning rate and no
# warm-up: the weights move a lot at every step, so a sync that fails shows in the mismatch.
RUN = [*FAST, "--learners", 2, "--dataset", "synthetic", "--dtype", "bfloat16", "--lr", 1e-2, "--warmup-steps", 0]
RUN += ["--rewards", "tests.plugins.hybrid_models:parity"]


def check_run(out, steps):
    metrics = rows(out)
    assert [r["step"] for r in metrics] == list(range(steps))
    for r in metrics:
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "mismatch_mean", "mismatch_max", "entropy")), r
        assert r["tokens_trained"] > 0 and r["staleness"] == 0
        # Sampler log-probs against the learners' forward of the weights that were synced.
        assert r["mismatch_mean"] < TOL, (r["step"], r["mismatch_mean"])
    assert all(r["grad_norm"] > 0 for r in metrics)
    print("mismatch_mean per step:", [round(r["mismatch_mean"], 5) for r in metrics])
    return metrics


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_a_hybrid_model_trains_end_to_end(qwen3_next, tmp_path):
    out = tmp_path / "run"
    result = torchrun(3, "--model", qwen3_next, "--steps", 3, *RUN, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    check_run(out, 3)
    before, after = safetensors(qwen3_next), safetensors(out / "final")
    # A tied head is saved once, as the embedding, as transformers itself saves it.
    assert set(before) <= set(after)
    assert max((before[k].float() - after[k].float()).abs().max().item() for k in before) > 1e-3


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_a_composite_checkpoint_trains_and_saves_as_itself(composite, tmp_path):
    out = tmp_path / "run"
    result = torchrun(3, "--model", composite, "--steps", 2, *RUN, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    check_run(out, 2)
    final = out / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert (final / "preprocessor_config.json").exists()
    before, after = safetensors(composite), safetensors(final)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model.visual."))
    assert (
        max((before[k].float() - after[k].float()).abs().max().item() for k in before if ".language_model." in k) > 1e-3
    )


def test_a_hybrid_model_in_float32_on_cpu_is_refused_at_start(qwen3_next):
    import subprocess
    import sys

    from conftest import ROOT, rank0_env

    if torch.cuda.is_available():
        pytest.skip("the check is for vLLM's CPU kernel")
    env = rank0_env()
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "job.py"),
            "--learners",
            "2",
            "--model",
            str(qwen3_next),
            "--dataset",
            "synthetic",
            "--dtype",
            "float32",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--dtype float32" in result.stderr and "bf16" in result.stderr, result.stderr
