"""The real vLLM engine in this process: sampling with log-probs, and weights loaded in
place matching a transformers forward of the same weights."""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from learner import _broadcast_bucket
from sampler import Sampler, receive_weights


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Sampler(tiny_model, 512, seed=0)


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
    return max((lp - torch.tensor(c["logprobs"])).abs().max().item() for lp, c in zip(hf_logprobs(model, completions), completions))


def prompts(engine, n=4):
    from data import load_prompts

    return [p["prompt_ids"] for p in load_prompts("synthetic", "test", engine.llm.get_tokenizer(), 512)[:n]]


def test_sampling_shapes_and_determinism(engine):
    batch = prompts(engine)
    a = engine.sample(batch, 3, 16, 1.0, seed=7)
    b = engine.sample(batch, 3, 16, 1.0, seed=7)
    c = engine.sample(batch, 3, 16, 1.0, seed=8)
    assert len(a) == 12 and all(x["prompt_ids"] == batch[i // 3] for i, x in enumerate(a))
    assert all(len(x["token_ids"]) == len(x["logprobs"]) <= 16 for x in a)
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert [x["token_ids"] for x in a] != [x["token_ids"] for x in c]
    greedy = engine.sample(batch, 1, 16, 0.0, seed=0)
    assert [x["token_ids"] for x in greedy] == [x["token_ids"] for x in engine.sample(batch, 1, 16, 0.0, seed=1)]


def test_weights_sent_over_a_real_group_load_in_place(engine, tiny_model):
    """Perturb the weights, broadcast them in buckets over a real gloo group from a
    sender thread, load them into the running engine, and compare the engine's
    log-probs of its own samples with transformers on the perturbed weights."""
    from transformers import AutoModelForCausalLM

    from grpo import weight_plan

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    batch = prompts(engine)
    stale = engine.sample(batch, 2, 16, 1.0, seed=3)
    assert max_gap(model, stale) > 1e-2  # the perturbation is visible

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    sent = []

    def send():
        pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 0, 2, timedelta(seconds=60))
        bucket = []
        for _, p in model.named_parameters():
            bucket.append(p.detach().flatten())
            if len(bucket) == 5:  # several buckets, each holding several tensors
                _broadcast_bucket(pg, bucket)
                sent.append(len(bucket))
                bucket = []
        _broadcast_bucket(pg, bucket)
        pg.broadcast(torch.zeros(1, dtype=torch.int64), 0).wait()

    sender = threading.Thread(target=send)
    sender.start()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 1, 2, timedelta(seconds=60))
    engine.load_weights(receive_weights(pg, weight_plan(tiny_model), engine.dtype, torch.device("cpu")))
    sender.join()
    assert len(sent) > 2
    fresh = engine.sample(batch, 2, 16, 1.0, seed=3)
    gap = max_gap(model, fresh)
    print(f"sampler vs transformers log-prob max abs diff after sync: {gap:.2e}")
    assert gap < 1e-4
