"""The whole system under real torchrun: FSDP2 over gloo, in-process vLLM samplers,
the weight broadcast group and the rollout group."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST, ROOT, children, rank_of, rows, torchrun, torchrun_cmd

REQUIRED = [
    "step",
    "reward_mean",
    "accuracy",
    "format",
    "completion_len",
    "loss",
    "grad_norm",
    "sample_s",
    "train_s",
    "sync_s",
    "step_s",
    "mismatch_max",
    "staleness",
    "padded_frac",
    "positions_trained",
    "peak_memory_mb_learner",
    "peak_memory_mb_sampler",
]


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


# The on-policy run and the one-step-ahead run share every flag but --max-staleness (and
# what the second saves), so their steps compare: the same seed, data order and evals.
# A large LR and no warm-up, so that one step changes what the policy samples.
PAIR = [
    "--learners",
    2,
    *FAST,
    "--lr",
    1e-2,
    "--warmup-steps",
    0,
    "--samples-every",
    1,
    "--eval-every",
    2,
    "--eval-size",
    8,
]


@pytest.fixture(scope="module")
def on_policy(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("on_policy") / "run"
    result = torchrun(3, *PAIR, "--steps", 3, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    return out


@pytest.fixture(scope="module")
def one_step_ahead(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_step_ahead") / "run"
    result = torchrun(3, *PAIR, "--steps", 4, "--max-staleness", 1, "--save-every", 1, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    return out


def train_rows(out_dir):
    return [r for r in rows(out_dir) if "loss" in r]


def test_three_ranks_train_and_sync(tiny_model, on_policy):
    out = on_policy
    metrics = train_rows(out)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for r in metrics:
        assert all(k in r for k in REQUIRED), sorted(r)
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["samplers"] == 1 and r["tokens_sampled"] > 0 and r["staleness"] == 0
        assert 0 <= r["padded_frac"] < 0.5 and r["peak_memory_mb_learner"] > 0
        # the unpadded positions are the trained tokens and their prompts
        assert r["positions_trained"] * (1 - r["padded_frac"]) > r["tokens_trained"] > 0
        # Sampler log-probs of its own tokens against the learners' forward of the
        # same weights: from step 1 on this only holds if the broadcast landed.
        assert r["mismatch_max"] < 1e-4, r["mismatch_max"]
    print("mismatch_max per step:", [r["mismatch_max"] for r in metrics])
    assert any(r["grad_norm"] > 0 for r in metrics)
    before, after = weights(tiny_model), weights(out / "final")
    assert before.keys() == after.keys()
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-4
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples and all({"step", "text", "reward"} <= set(s) for s in samples)


def test_two_samplers_feed_two_learners(tiny_model, tmp_path):
    out = tmp_path / "run"
    result = torchrun(4, "--learners", 2, "--steps", 2, *FAST, "--eval-every", 1, "--eval-size", 8, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    metrics = rows(out)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for r in metrics[:2]:
        assert r["samplers"] == 2
        assert r["mismatch_max"] < 1e-4
    # greedy eval of 8 held-out prompts split over both samplers, after the last step too
    assert all(0 <= r["eval_accuracy"] <= 1 and r["eval_length"] > 0 for r in metrics)
    assert "eval accuracy" in result.stdout


def test_samplers_run_one_step_ahead(one_step_ahead):
    """--max-staleness 1: step k+1 is sampled with step k's weights while step k trains;
    the first step samples fresh weights, and every eval sees the weights of its step."""
    metrics = rows(one_step_ahead)
    train = [r for r in metrics if "loss" in r]
    assert [r["staleness"] for r in train] == [0, 1, 1, 1]
    assert train[0]["mismatch_max"] < 1e-4  # fresh weights at the first step
    assert all(math.isfinite(r["loss"]) and r["tokens_trained"] > 0 for r in train)
    assert [r["step"] for r in metrics if "eval_accuracy" in r] == [0, 2, 4]


def test_one_step_ahead_widens_the_sampler_learner_gap(on_policy, one_step_ahead):
    """The same seed and flags: at step 0 both runs score rollouts of the weights they
    hold; from step 1 on, one step ahead, the learners score rollouts drawn before their
    last update, and the gap between the sampler's and the learners' log-probs grows from
    numerical noise to one step's change of the policy."""
    s0, s1 = train_rows(on_policy), train_rows(one_step_ahead)
    print("mismatch_mean S=0:", [r["mismatch_mean"] for r in s0], "S=1:", [r["mismatch_mean"] for r in s1])
    assert s1[0]["mismatch_max"] < 1e-4
    for a, b in zip(s0[1:], s1[1:]):
        assert b["mismatch_mean"] > 1e-3 and b["mismatch_mean"] > 100 * a["mismatch_mean"], (
            a["mismatch_mean"],
            b["mismatch_mean"],
        )
        assert b["mismatch_max"] > 10 * a["mismatch_max"]


def drawn(out_dir, step):
    """What a run sampled at `step`: the completions samples.jsonl keeps, and the step's
    totals over all of them."""
    completions = [json.loads(line) for line in open(os.path.join(out_dir, "samples.jsonl"))]
    for c in completions:  # the learners' log-probs are theirs, of their weights: not what was drawn
        del c["learner_logprobs"]
    (row,) = [r for r in train_rows(out_dir) if r["step"] == step]
    return [c for c in completions if c["step"] == step], {
        k: row[k] for k in ("reward_mean", "tokens_sampled", "completion_len", "truncated_frac")
    }


def test_one_step_ahead_draws_step_k_plus_1_with_step_k_weights(on_policy, one_step_ahead, tmp_path):
    """The behaviour behind staleness 1, checked by reproducing it. W_k, the weights
    after k updates, is checkpoint step_k. Step 0 is the same in both runs, so W_1 is
    too; at step 1 the on-policy run draws with W_1 and the one-step-ahead run, still on
    W_0, draws otherwise (so the draws tell the weights apart). Its step 2 was drawn with
    W_1: an on-policy run that resumes from step_1, numbered as step 2 so that it draws
    step 2's prompts with step 2's seeds, draws exactly the same."""
    assert drawn(on_policy, 0) == drawn(one_step_ahead, 0)
    assert drawn(on_policy, 1)[0] != drawn(one_step_ahead, 1)[0]
    ckpt = tmp_path / "step_1_as_2"
    shutil.copytree(one_step_ahead / "checkpoints" / "step_1", ckpt)
    trainer = json.loads((ckpt / "trainer.json").read_text())
    assert trainer["step"] == 1
    (ckpt / "trainer.json").write_text(json.dumps({**trainer, "step": 2}))
    replay = tmp_path / "replay"
    result = torchrun(3, *PAIR, "--eval-every", 0, "--steps", 3, "--resume", ckpt, "--out-dir", replay)
    assert result.returncode == 0, result.stdout[-5000:]
    assert [r["staleness"] for r in train_rows(replay)] == [0]
    assert drawn(replay, 2) == drawn(one_step_ahead, 2)


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_compiled_learners_train_and_keep_the_samplers_numbers(tiny_model, tmp_path, monkeypatch):
    """--compile under real torchrun: two FSDP2 learners (the policy's blocks and the KL
    reference's compiled) and a sampler whose vLLM model is compiled too run three steps;
    each rank's log shows torch.compile tracing its model, and the learners' log-probs
    still match the float32 sampler's after every weight sync."""
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # a line per traced frame, in each rank's log
    out = tmp_path / "run"
    result = torchrun(3, *PAIR, "--eval-every", 0, "--steps", 3, "--beta", 0.1, "--compile", "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    metrics = train_rows(out)
    print([(r["loss"], r["kl"], r["mismatch_max"]) for r in metrics])
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert all(math.isfinite(r["loss"]) and r["mismatch_max"] < 1e-4 for r in metrics)
    assert metrics[-1]["kl"] > 0  # the reference ran, and the policy moved away from it
    learner, sampler = "transformers/models/qwen2/modeling_qwen2", "vllm/model_executor/models/qwen2"
    for rank, model in {0: learner, 1: learner, 2: sampler}.items():
        log = (out / "logs" / f"rank_{rank}.log").read_text()
        assert re.search(rf"start tracing forward .*{model}\.py", log), log[-3000:]


def run_direct(*args, world=3, path=None):
    """job.py as rank 0 of a pretend torchrun world: config errors must come out
    before it ever connects to the store or loads a model."""
    env = {
        **os.environ,
        **({"PATH": path} if path else {}),
        "RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "job.py"), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, world, flag",
    [
        (["--learners", 3], 3, "--learners"),
        (["--learners", 5], 3, "--learners"),
        (["--learners", 0], 3, "--learners"),
        (["--learners", 1, "--prompts-per-step", 3], 3, "--prompts-per-step"),
        (["--group-size", 1], 3, "--group-size"),
        (["--learners", 2, "--prompts-per-step", 3, "--group-size", 3], 3, "--prompts-per-step x --group-size"),
        (["--loss-type", "ppo"], 3, "--loss-type"),
        (["--scale", "sometimes"], 3, "--scale"),
        (["--temperature", 0], 3, "--temperature"),
        (["--rewards", "accuracy,nonsense"], 3, "--rewards"),
        (["--dataset", "/no/such/file.jsonl"], 3, "--dataset"),
        (["--micro-batch-size", 0], 3, "--micro-batch-size"),
        (["--max-staleness", 2], 3, "--max-staleness"),
        (["--report-to", "mlflow"], 3, "--report-to"),
        (["--max-tokens-per-microbatch", 100], 3, "--max-tokens-per-microbatch"),
    ],
)
def test_config_errors_name_the_flag(args, world, flag):
    start = time.time()
    result = run_direct(*args, world=world)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("job.py: error:") and flag in lines[0], result.stderr
    assert time.time() - start < 60


def test_compile_without_a_cpp_compiler_is_refused(tmp_path):
    """On a CPU torch.compile writes C++ kernels: with no compiler on PATH, --compile is a
    one-line refusal, not a traceback at the first step."""
    result = run_direct("--compile", path=str(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--compile" in lines[0], result.stderr


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_report_to_a_missing_package_fails_at_start(package):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    result = run_direct("--report-to", package)
    assert result.returncode == 2 and "--report-to" in result.stderr and "not installed" in result.stderr, result.stderr


def test_not_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "job.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "torchrun" in result.stderr


def test_killed_learner_brings_the_job_down(tiny_model, tmp_path):
    """A learner killed mid-run: the job ends within a minute, torchrun names the rank,
    and no rank is left behind. (A killed sampler: test_console.py.)"""
    victim = 1
    out = tmp_path / "run"
    proc = subprocess.Popen(
        torchrun_cmd(3, "--learners", 2, "--steps", 1000, *FAST, "--out-dir", out),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() or not rows(out):
            assert proc.poll() is None and time.time() < deadline, "the run did not reach its first step"
            time.sleep(0.5)
        ranks = children(proc.pid)
        target = next(p for p in ranks if rank_of(p) == victim)
        os.kill(target, signal.SIGKILL)
        killed = time.time()
        output, _ = proc.communicate(timeout=60)
        assert time.time() - killed < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"rank      : {victim}" in output or f"rank: {victim}" in output, output[-3000:]
    assert not any(os.path.exists(f"/proc/{p}") for p in ranks)
