"""TRL's GRPOTrainer on the shapes of `speed.py --precision` (the random-init 22.8M Qwen2
with the tiny tokenizer, 16 prompts x 8 completions of up to 128 new tokens, no KL),
seconds per optimizer step, with TRL's default bf16=True and with bf16=False. It is the
yardstick of the precision comparison; TRL is not a dependency of this project, so run
it from a scratch install outside it:

    pip install --target /tmp/trl trl accelerate --no-deps
    PYTHONPATH=/tmp/trl .venv/bin/python benchmarks/trl_speed.py [--steps 4] [--bf16 both|true|false]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def seconds_per_step(model_path, bf16, steps, out):
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards import parse_reward_spec
    from tasks.synthetic import synthetic_dataset

    records = synthetic_dataset("train", 16 * (steps + 1))
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in records]
    )

    (_, score, _), *_ = parse_reward_spec("accuracy")

    def accuracy(completions, answer, **_):  # the project's own reward, for the same work per completion
        return [score(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=bf16,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=8,  # 128 completions = 16 prompts x 8 per optimizer step
        num_generations=8,
        max_completion_length=128,
        temperature=1.0,
        beta=0.0,
        learning_rate=1e-6,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=accuracy,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([start, *stamps], stamps)]
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", default="both", choices=["both", "true", "false"])
    args = parser.parse_args()
    from speed import build_mid_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_mid_model(os.path.join(tmp, "mid"))
        for bf16 in {"both": (True, False), "true": (True,), "false": (False,)}[args.bf16]:
            times = seconds_per_step(model, bf16, args.steps, os.path.join(tmp, f"out{bf16}"))
            print(
                f"TRL GRPOTrainer bf16={bf16}: seconds per step {' '.join(f'{t:.1f}' for t in times)};"
                f" median after the first {statistics.median(times[1:] or times):.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
