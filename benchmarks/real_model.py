"""A real pretrained model learning under this loop on CPU: SmolLM2-135M-Instruct
(tests/plugins/smollm2.py) on a task it can score on from its start, in bf16 and in float32.

    python benchmarks/real_model.py [--steps 40] [extra job.py flags]
    python benchmarks/real_model.py --lora R [--steps 20]   # full fine-tuning against LoRA rank R

The task: "Is 14 + 15 = 27? Answer yes or no." Rewards: `yes_no_format`, 1 when the whole
reply is one word, yes or no (the model does so often enough at its start for groups to
differ), and `yes_no_accuracy`, 1 when that word is right. GSM8K teaches this model nothing
on CPU: it solves almost none greedily and never writes '#### N', so every group would
score alike (docs/results.md, Learning).
Each run is `bash launch.sh` with 1 learner + 1 sampler; printed per step: the reward, the
seconds, and the sampler/learner log-prob mismatch (mean and max over the step's tokens),
then the held-out greedy evals and the learner's peak memory.
With --lora R the two runs are full fine-tuning and LoRA at rank R, in the default dtype, with LoRA's
defaults (its learning rate among them) for the second, so the curves compare the
configuration `--lora-rank R` gets."""

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-5  # full fine-tuning's, for this model and task
sys.path.insert(0, ROOT)


def _word(completion):
    return re.sub(r"[^a-z]", "", completion.lower()) if len(completion.split()) == 1 else ""


def yes_no_format(completion, record):
    return float(_word(completion) in ("yes", "no"))


def yes_no_accuracy(completion, record):
    return float(_word(completion) == record["truth"])


yes_no_accuracy.needs = ("truth",)


def write_task(path, n, seed):
    """n questions, half of them true: a + b = c, or c off by one or two."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(2, 30), rng.randint(2, 30)
            c = a + b if i % 2 else a + b + rng.choice([-2, -1, 1, 2])
            row = {"question": f"Is {a} + {b} = {c}? Answer yes or no.", "truth": "yes" if c == a + b else "no"}
            f.write(json.dumps(row) + "\n")


def main():
    from config import LORA_LR
    from tests.plugins.smollm2 import missing_requirements, smollm2_model

    args = sys.argv[1:]
    steps = "40"
    if "--steps" in args:
        steps = args.pop(args.index("--steps") + 1)
        args.remove("--steps")
    runs = {"bfloat16": ["--dtype", "bfloat16"], "float32": ["--dtype", "float32"]}
    if "--lora" in args:
        rank = args.pop(args.index("--lora") + 1)
        args.remove("--lora")
        # Each in the default dtype: bf16 where the CPU has it natively, else float32. LoRA's A
        # at LORA_LR x full fine-tuning's lr, as with no --lr (B at --lora-b-lr x that).
        runs = {"full": [], f"LoRA r{rank}": ["--lora-rank", rank, "--lr", f"{LR * LORA_LR:g}"]}
    if reason := missing_requirements():
        sys.exit(reason)
    model = smollm2_model()
    rewards = "benchmarks.real_model:yes_no_format,benchmarks.real_model:yes_no_accuracy"
    with tempfile.TemporaryDirectory() as tmp:
        train, test = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "test.jsonl")
        write_task(train, 4000, seed=0)
        write_task(test, 64, seed=1)
        flags = ["--model", model, "--dataset", train, "--eval-dataset", test, "--rewards", rewards, "--steps", steps]
        flags += f"--prompts-per-step 16 --group-size 4 --max-new-tokens 16 --lr {LR:g} --warmup-steps 0".split()
        flags += "--beta 0 --max-staleness 0 --eval-every 10 --eval-size 64".split()
        results = {}
        for name, run_flags in runs.items():
            out = os.path.join(tmp, str(len(results)))
            env = {**os.environ, "NPROC": "2", "LEARNERS": "1"}
            start = time.time()
            cmd = ["bash", "launch.sh", *flags, *run_flags, *args, "--out-dir", out]
            result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode:
                print(result.stdout[-4000:])
                sys.exit(f"{name}: launch.sh failed with exit code {result.returncode}")
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            dtype = json.load(open(os.path.join(out, "run.json")))["config"]["dtype"]
            results[name] = (rows, time.time() - start, dtype)
    print("processor:", processor())
    for name, (rows, wall, dtype) in results.items():
        train = [r for r in rows if "loss" in r]
        peak = max(r["peak_memory_mb_learner"] for r in train)
        print(f"\n{name}, {dtype}: {len(train)} steps, {wall:.0f} s wall (engine and model loads included)")
        print(f"learner peak memory {peak:.0f} MB, lr {train[0]['lr']:.2g} at step 0")
        print("step  reward  format  accuracy  step_s  mismatch_mean  mismatch_max")
        for r in train:
            fmt, acc = (r.get(f"reward_benchmarks.real_model:yes_no_{k}", float("nan")) for k in ("format", "accuracy"))
            print(
                f"{r['step']:4d}  {r['reward_mean']:6.3f}  {fmt:6.3f}  {acc:8.3f}  {r['step_s']:6.1f}"
                f"  {r['mismatch_mean']:13.5f}  {r['mismatch_max']:12.4f}"
            )
        for r in (r for r in rows if "eval_reward" in r):
            fmt, acc = (r.get(f"eval_benchmarks.real_model:yes_no_{k}", float("nan")) for k in ("format", "accuracy"))
            print(f"eval step {r['step']:4d}: reward {r['eval_reward']:.3f}, format {fmt:.3f}, accuracy {acc:.3f}")
        steps_s = sorted(r["step_s"] for r in train[1:])
        print(f"median s/step {steps_s[len(steps_s) // 2]:.1f}, median mismatch_mean ", end="")
        print(f"{sorted(r['mismatch_mean'] for r in train)[len(train) // 2]:.5f}")


def processor():
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16") if f in info.split()]
    return f"{name.group(1) if name else 'unknown'}, {os.cpu_count()} cores, bf16 flags: {' '.join(flags) or 'none'}"


if __name__ == "__main__":
    main()
