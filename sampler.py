"""The rollout engine: one in-process vLLM engine per sampler rank, sampling with
log-probs, and new weights loaded in place as they arrive from the learner."""

import os

# The engine core must live in this process: it is driven from the training loop and
# loads weights that arrive over our own process group.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


class Sampler:
    def __init__(self, model, max_model_len, seed, gpu_memory_utilization=0.3, kv_cache_gb=1.0):
        on_gpu = torch.cuda.is_available()
        memory = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu else {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
        self.llm = LLM(
            model=model,
            # The dtype the learners broadcast in (learner.py): bf16 on GPU, float32 on CPU.
            dtype="bfloat16" if on_gpu else "float32",
            enforce_eager=not on_gpu,
            max_model_len=max_model_len,
            seed=seed,
            # Log-probs after temperature scaling: those of the policy that really sampled.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **memory,
        )
        self.dtype = self.llm.llm_engine.model_config.dtype

    def sample(self, prompt_ids, n, max_tokens, temperature, seed):
        """n completions per prompt, in prompt order, each prompt's n contiguous.
        The engine runs in this process and draws from torch's default generator, so
        seeding it makes a step's samples a function of (seed, requests) alone.
        Per-request seeds would do the same, but vLLM's CPU path cannot rewind their
        generators when a prefill is chunked."""
        torch.manual_seed(seed)
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        completions = []
        for prompt, out in zip(prompt_ids, outputs):
            for c in out.outputs:
                completions.append(
                    {
                        "prompt_ids": list(prompt),
                        "token_ids": list(c.token_ids),
                        "sampler_logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                        "text": c.text,
                        "truncated": c.finish_reason == "length",
                    }
                )
        return completions

    def load_weights(self, named_tensors):
        """Load (name, tensor) pairs in place into the running engine. The iterator is
        consumed inside vLLM's loader, so buckets can arrive while it runs."""
        self.llm.collective_rpc(_reload_weights, args=(named_tensors,))
        self.llm.reset_prefix_cache()


def _reload_weights(worker, named_tensors):
    worker.model_runner.reload_weights(weights_iterator=named_tensors)
