"""The rollout engine: one in-process vLLM engine per sampler rank, sampling with
log-probs, and new weights loaded in place as they arrive from the learner."""

import os

# The engine core must live in this process: it is driven from the training loop and
# loads weights that arrive over our own process group.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import hashlib

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from comm import param_key


def request_seed(*key):
    """A request's sampling seed from its key (seed, step, sampler, request index): two
    samplers, two steps or two requests never share noise, and a step's samples are a
    function of the key alone. vLLM gives the n children of a request seed + j, so the
    seeds are hashed apart rather than consecutive; < 2**62 leaves room for + j in int64."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 2


class Sampler:
    def __init__(self, model, max_model_len, seed, dtype, gpu_memory_utilization=0.3, kv_cache_gb=1.0):
        on_gpu = torch.cuda.is_available()
        memory = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu else {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
        # CPU: vLLM rewinds a seeded request's generator when it throws away the sample of
        # a chunked prefill, and a CPU generator cannot rewind (the engine dies), so
        # prefills are never chunked there. On GPU the noise is a stateless hash of
        # (seed, position), which chunking cannot change.
        chunking = {} if on_gpu else {"enable_chunked_prefill": False}
        self.llm = LLM(
            model=model,
            dtype=dtype,
            enforce_eager=not on_gpu,
            max_model_len=max_model_len,
            seed=seed,
            # Log-probs after temperature scaling: those of the policy that really sampled.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            use_tqdm_on_load=False,
            **memory,
            **chunking,
        )
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_text_config, "tie_word_embeddings", False))
        # Parameters the engine keeps in another dtype than its own, such as a gated delta
        # net's A_log in float32 under bf16: they travel in that dtype (comm.wire_dtype).
        params = self.llm.collective_rpc(_param_dtypes)[0]
        self.kept_dtypes = {param_key(n): d for n, d in params.items() if d != self.dtype}

    def sample(self, prompt_ids, n, max_tokens, temperature, key):
        """n completions per prompt, in prompt order, each prompt's n contiguous. Request i
        is seeded by request_seed(*key, i), so that the samples are a function of the key
        and the requests alone, whatever else the engine runs beside them."""
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=request_seed(*key, i)) for i in range(len(prompt_ids))]
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
        self.llm.collective_rpc(_reload_weights, args=(with_tied_head(named_tensors) if self.tied else named_tensors,))
        self.llm.reset_prefix_cache()


def with_tied_head(named_tensors):
    """A tied model's parameters lack lm_head.weight (named_parameters drops the
    duplicate), but vLLM's CPU build keeps a packed copy of the output layer that a
    reload rebuilds only when lm_head.weight arrives: without it the sampler would
    generate with its first output layer forever. So the embedding goes in twice; no
    extra byte travels, and on GPU the head is the same tensor and loads as a no-op."""
    for name, tensor in named_tensors:
        yield name, tensor
        if name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor


def _reload_weights(worker, named_tensors):
    worker.model_runner.reload_weights(weights_iterator=named_tensors)


def _param_dtypes(worker):
    return {n: p.dtype for n, p in worker.model_runner.get_model().named_parameters()}
