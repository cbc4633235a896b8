"""The real vLLM engine in this process: sampling with log-probs, and weights loaded in
place matching a transformers forward of the same weights."""

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from comm import receive_weights
from conftest import ROOT, free_port
from sampler import Sampler, engine_options


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Sampler(tiny_model, 512, seed=0, dtype="float32")


def hf_logprobs(model, completions):
    """Log-probs of each completion's tokens under a plain transformers forward."""
    out = []
    for c in completions:
        ids = torch.tensor([c["prompt_ids"] + c["token_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(lp[len(c["prompt_ids"]) - 1 :])
    return out


def max_gap(model, completions):
    return max(
        (lp - torch.tensor(c["sampler_logprobs"])).abs().max().item()
        for lp, c in zip(hf_logprobs(model, completions), completions)
    )


def prompts(engine, n=4):
    from data import load_prompts

    return [p["prompt_ids"] for p in load_prompts("synthetic", "test", engine.llm.get_tokenizer(), 512)[:n]]


def test_sampling_shapes_and_determinism(engine):
    batch = prompts(engine)
    a = engine.sample(batch, 3, 16, 1.0, key=(7,))
    b = engine.sample(batch, 3, 16, 1.0, key=(7,))
    c = engine.sample(batch, 3, 16, 1.0, key=(8,))
    assert len(a) == 12 and all(x["prompt_ids"] == batch[i // 3] for i, x in enumerate(a))
    assert all(len(x["token_ids"]) == len(x["sampler_logprobs"]) <= 16 for x in a)
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert [x["token_ids"] for x in a] != [x["token_ids"] for x in c]
    greedy = engine.sample(batch, 1, 16, 0.0, key=(0,))
    assert [x["token_ids"] for x in greedy] == [x["token_ids"] for x in engine.sample(batch, 1, 16, 0.0, key=(1,))]


SENDER = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from comm import bucket_plan, send_weights
from models import weight_plan
from test_sampler import perturbed
model = perturbed(sys.argv[1])
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=120))
pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 0, 2, timedelta(seconds=120))
params = dict(model.named_parameters())
buckets = bucket_plan(weight_plan(sys.argv[1]), lambda name: torch.float32, int(sys.argv[4]))
send_weights(pg, lambda name, dtype: params[name].detach().to(dtype), buckets, torch.device("cpu"))
print("BUCKETS", len(buckets), flush=True)
# Skip interpreter teardown: destroying a bare gloo group there can abort the process
# ("terminate called without an active exception", seen once in CI) after its work is done.
os._exit(0)
"""


def perturbed(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def sync_and_compare(engine, model_path):
    """Perturb the weights, broadcast them in buckets over a real gloo group from another
    process, load them into the running engine, and return the largest gap between the
    engine's log-probs of its own samples and transformers' on the perturbed weights."""
    from comm import bucket_plan
    from models import weight_plan

    model = perturbed(model_path)
    batch = prompts(engine)
    stale = engine.sample(batch, 2, 16, 1.0, key=(3,))
    assert max_gap(model, stale) > 1e-2  # the perturbation is visible

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    bucket_bytes = 200_000  # several buckets, each holding several tensors
    cmd = [sys.executable, "-c", SENDER, model_path, str(port), ROOT, str(bucket_bytes)]
    sender = subprocess.Popen(
        cmd, cwd=os.path.join(ROOT, "tests"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 1, 2, timedelta(seconds=120))
    buckets = bucket_plan(weight_plan(model_path), lambda name: torch.float32, bucket_bytes)
    engine.load_weights(receive_weights(pg, buckets, torch.device("cpu")))
    out, err = sender.communicate(timeout=120)
    assert sender.returncode == 0, err[-3000:]
    assert int(out.split("BUCKETS")[1]) > 2
    return max_gap(model, engine.sample(batch, 2, 16, 1.0, key=(3,)))


def test_engine_options_by_device():
    """The GPU's settings, which no CPU test's engine reaches, and the CPU's, side by side."""
    for hybrid in (False, True):
        gpu = engine_options(True, False, hybrid, 0.3, 1.0)
        assert gpu == {"gpu_memory_utilization": 0.3, "enforce_eager": False, "enable_prefix_caching": True}
    cpu = engine_options(False, False, False, 0.3, 1.5)
    assert cpu == {
        "kv_cache_memory_bytes": 3 * 2**29,
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": True,
        "block_size": 32,
    }
    assert not engine_options(False, True, False, 0.3, 1.5)["enforce_eager"]  # --compile
    assert not engine_options(False, False, True, 0.3, 1.5)["enable_prefix_caching"]  # hybrid


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPUs keep vLLM's own block size")
def test_a_cpu_engine_keeps_32_token_kv_blocks(engine):
    # vLLM's CPU default, 128, samples 1.2-1.4x slower (docs/results.md); a platform or
    # model override would put it back without a word.
    assert engine.llm.llm_engine.vllm_config.cache_config.block_size == 32


def test_weights_sent_over_a_real_group_load_in_place(engine, tiny_model):
    gap = sync_and_compare(engine, tiny_model)
    print(f"sampler vs transformers log-prob max abs diff after sync: {gap:.2e}")
    assert gap < 1e-4


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_tied_embeddings_sync_the_output_layer_too(tmp_path):
    """Tied embeddings (Qwen2.5-0.5B has them): named_parameters() holds no lm_head.weight,
    and vLLM's CPU build keeps a packed copy of the output layer that only a sent
    lm_head.weight rebuilds. Without it the engine would sample from its first head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import tiny

    tokenizer = tiny.build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    path = str(tmp_path / "tied")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    engine = Sampler(path, 512, seed=0, dtype="float32")
    assert engine.tied
    gap = sync_and_compare(engine, path)
    print(f"tied model: sampler vs transformers log-prob max abs diff after sync: {gap:.2e}")
    assert gap < 1e-4


def _probe_reload(worker):
    """Wrap the model runner's reload so it records whether vLLM's current config is set
    around it, as vLLM's own Worker.reload_weights sets it."""
    from vllm.config import get_current_vllm_config_or_none

    original = worker.model_runner.reload_weights

    def reload(*args, **kwargs):
        worker.grpo_reload_config = get_current_vllm_config_or_none() is worker.vllm_config
        return original(*args, **kwargs)

    worker.model_runner.reload_weights = reload


def _probe_result(worker):
    del worker.model_runner.reload_weights  # the class's own method again
    return worker.grpo_reload_config


def test_a_reload_runs_inside_vllms_config_context(engine, tiny_model):
    """Code under vLLM's reload may call get_current_vllm_config(), which raises outside
    set_current_vllm_config(): the sync goes through the worker's entry point, which sets it."""
    model = perturbed(tiny_model)
    engine.llm.collective_rpc(_probe_reload)
    engine.load_weights([(n, p.detach()) for n, p in model.named_parameters()])
    assert engine.llm.collective_rpc(_probe_result) == [True]


def test_a_prefix_cache_that_will_not_reset_stops_the_sampler(engine, tiny_model, monkeypatch):
    """reset_prefix_cache() answers False while blocks are held: the cache would then serve
    prefixes computed with the old weights, so the sync fails loudly instead."""
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *args, **kwargs: False)
    model = perturbed(tiny_model)
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.load_weights([(n, p.detach()) for n, p in model.named_parameters()])


def test_the_gpu_learner_checks_stand_in_engine_takes_the_samplers_arguments():
    """benchmarks/gpu_learner_check.py stands its GenerateEngine in for Sampler where vLLM
    cannot be installed, and job.py builds either with the same call: a parameter added
    to one and not the other (as --compile's was) fails every check's sampler rank on a
    GPU node, so the two signatures are held equal here."""
    import importlib.util
    import inspect

    spec = importlib.util.spec_from_file_location(
        "gpu_learner_check", os.path.join(ROOT, "benchmarks", "gpu_learner_check.py")
    )
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert inspect.signature(check.GenerateEngine.__init__) == inspect.signature(Sampler.__init__)
