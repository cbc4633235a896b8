"""Checkpoints under real torchrun: exact resume after kill -9, a kill during a save,
SIGTERM preemption, refusals, and checkpoints that transformers and vLLM both load."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, torchrun, torchrun_cmd

FAST = ["--learners", 2, "--prompts-per-step", 4, "--group-size", 4, "--max-new-tokens", 16, "--eval-every", 0, "--beta", 0, "--max-staleness", 0]


def rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def start(out, *args):
    """torchrun in its own session, so the whole job can be killed at once."""
    return subprocess.Popen(torchrun_cmd(3, *FAST, "--out-dir", out, *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(condition, proc, timeout=300, poll=0.05):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(poll)


def latest(out):
    marker = os.path.join(out, "checkpoints", "latest")
    return open(marker).read().strip() if os.path.exists(marker) else None


def test_resume_after_kill_equals_an_uninterrupted_run(tiny_model, tmp_path):
    straight = tmp_path / "straight"
    result = torchrun(3, *FAST, "--steps", 4, "--out-dir", straight)
    assert result.returncode == 0, result.stdout[-3000:]

    broken = tmp_path / "broken"
    proc = start(broken, "--steps", 1000, "--save-every", 2)
    wait_for(lambda: latest(broken) == "step_2", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    result = torchrun(3, *FAST, "--steps", 4, "--out-dir", broken, "--resume")
    assert result.returncode == 0, result.stdout[-3000:]

    a, b = rows(straight), rows(broken)
    assert [r["step"] for r in b] == [0, 1, 2, 3]  # no duplicate or missing step
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    wa, wb = weights(straight / "final"), weights(broken / "final")
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"resumed vs straight final weights: max abs diff {diff:.2e}")
    assert diff < 1e-6


def test_kill_during_save_keeps_the_previous_checkpoint(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = start(out, "--steps", 1000, "--save-every", 1, "--keep-last", 2)
    root = out / "checkpoints"
    # kill while a checkpoint is half written, once an earlier one is complete
    wait_for(lambda: latest(out) is not None and any(d.endswith(".tmp") for d in os.listdir(root)), proc, poll=0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = latest(out)
    assert (root / done / "trainer.json").exists() and (root / done / "train_state" / ".metadata").exists()
    assert len([d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")]) <= 3
    step = int(done[5:])
    result = torchrun(3, *FAST, "--steps", step + 1, "--out-dir", out, "--resume")
    assert result.returncode == 0, result.stdout[-3000:]
    assert [r["step"] for r in rows(out)] == list(range(step + 1))


@pytest.mark.parametrize("staleness", [0, 1])
def test_sigterm_checkpoints_and_exits_with_the_preemption_code(tiny_model, tmp_path, staleness):
    out = tmp_path / "run"
    proc = start(out, "--steps", 1000, "--max-staleness", staleness)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len(rows(out)) >= 2, proc)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to every rank
    output, _ = proc.communicate(timeout=90)
    assert "exitcode  : 75" in output or "exit 75" in output, output[-3000:]
    done = latest(out)
    assert done is not None
    step = int(done[5:])
    assert step == len(rows(out))  # the checkpoint holds exactly the steps logged


def test_existing_run_is_refused_and_bad_checkpoints_are_named(tiny_model, tmp_path):
    out = tmp_path / "run"
    result = torchrun(3, *FAST, "--steps", 2, "--save-every", 2, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-3000:]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}

    def direct(*args):
        return subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *map(str, [*FAST[:2], "--out-dir", out, *args])], env=env, capture_output=True, text=True, timeout=120)

    r = direct("--steps", 4)
    assert r.returncode == 2 and "already holds a run" in r.stderr and "--resume" in r.stderr
    os.remove(out / "checkpoints" / "step_2" / "train_state" / ".metadata")
    r = direct("--steps", 4, "--resume")
    assert r.returncode == 2 and "incomplete" in r.stderr and ".metadata" in r.stderr, r.stderr
    (out / "checkpoints" / "step_2" / "trainer.json").write_text("{not json")
    r = direct("--steps", 4, "--resume", out / "checkpoints" / "step_2")
    assert r.returncode == 2 and "trainer.json" in r.stderr, r.stderr
    r = direct("--steps", 4, "--resume", tmp_path / "nowhere")
    assert r.returncode == 2 and "incomplete" in r.stderr
    shutil.rmtree(out / "checkpoints")
    r = direct("--steps", 4, "--resume")
    assert r.returncode == 2 and "no checkpoint" in r.stderr


VLLM_LOGPROBS = """
import json, sys
from sampler import Sampler
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
engine = Sampler(sys.argv[1], 256, seed=0)
ids = json.loads(sys.argv[2])
out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
print("LOGPROBS", json.dumps([lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]))
"""


def test_checkpoint_loads_in_transformers_and_vllm_alike(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    result = torchrun(3, *FAST, "--steps", 2, "--save-every", 2, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-3000:]
    ckpt = out / "checkpoints" / "step_2"
    assert max((weights(ckpt)[k] - weights(tiny_model)[k]).abs().max().item() for k in weights(ckpt)) > 1e-5
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    ids = tokenizer("Ann has 3 pens and gets 4 more.\n3+4=7\n#### 7")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    run = subprocess.run([sys.executable, "-c", VLLM_LOGPROBS, str(ckpt), json.dumps(ids)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((x for x in run.stdout.splitlines() if x.startswith("LOGPROBS")), None)
    assert line, run.stderr[-3000:]
    vllm = torch.tensor(json.loads(line[len("LOGPROBS ") :]))
    gap = (hf - vllm).abs().max().item()
    print(f"checkpoint log-probs, transformers vs vLLM: max abs diff {gap:.2e}")
    assert gap < 1e-4


def test_non_finite_steps_are_skipped_then_abort(tiny_model, tmp_path):
    out = tmp_path / "run"
    result = torchrun(3, *FAST, "--steps", 10, "--rewards", "accuracy,tests.nan_reward:nan", "--max-skips", 2, "--out-dir", out)
    assert result.returncode != 0
    assert "2 consecutive steps with a non-finite loss or grad norm" in result.stdout
    metrics = rows(out)
    assert [r["step"] for r in metrics] == [0, 1] and all(r["skipped"] == 1 for r in metrics)
    assert not (out / "final").exists()
