"""The rollout engine: one in-process vLLM engine per sampler rank, sampling with
log-probs, and new weights loaded in place as they arrive from the learner."""

import os

# The engine core must live in this process: it is driven from the training loop and
# loads weights that arrive over our own process group.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import hashlib
import logging
import sys
import types
import warnings

import torch
from transformers import AutoConfig
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from comm import param_key
from models import checkpoint_files, is_hybrid, text_to_checkpoint, weight_plan

# vLLM's Triton dispatcher trips torch's deprecation of torch.distributed.reduce_op as it
# scans modules, twice at start: nothing a user of this repo can act on.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils\.dispatcher")


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's 'RotaryEmbedding: Failed to load weights', which it logged at every
    weight sync. After an in-place reload, vLLM (model_loader/reload/layerwise.py) warns
    about each module that got none of its tensors and puts the old ones back. A rotary
    embedding's only tensor is its cos/sin table, a non-persistent buffer computed at
    start that no checkpoint holds and no sync sends, so it always "fails", and keeping
    the old table is right. No reload argument avoids it. The same warning about any
    other module (a head or a layer that really missed its weights: a broken sync) still
    passes."""

    def filter(self, record):
        rotary = record.args and str(record.args[0]).endswith("RotaryEmbedding")
        return not (record.msg == "%s: Failed to load weights" and rotary)


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadFilter())


def request_seed(*key):
    """A request's sampling seed from its key (seed, step, sampler, request index): two
    samplers, two steps or two requests never share noise, and a step's samples are a
    function of the key alone. vLLM gives the n children of a request seed + j, so the
    seeds are hashed apart rather than consecutive; < 2**62 leaves room for + j in int64."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 2


def engine_options(on_gpu, compile, hybrid, gpu_memory_utilization, kv_cache_gb):
    """The vLLM settings that differ between a GPU and a CPU, from the device alone."""
    if on_gpu:
        # vLLM always compiles there; chunked prefill stays on, since a GPU's sampling
        # noise is a stateless hash of (seed, position), which chunking cannot change.
        return {"gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": False, "enable_prefix_caching": True}
    return {
        "kv_cache_memory_bytes": int(kv_cache_gb * 2**30),
        # Compiling costs time at every start (vLLM's compile cache fails to reload on a
        # CPU) for a modest gain in sampling speed (docs/results.md, Speed): only with
        # --compile.
        "enforce_eager": not compile,
        # vLLM rewinds a seeded request's generator when it throws away the sample of a
        # chunked prefill, and a CPU generator cannot rewind (the engine dies).
        "enable_chunked_prefill": False,
        # A hybrid model's prefix cache (vLLM's mamba cache mode 'align', which keeps the
        # recurrent state at block boundaries) requires chunked prefill.
        "enable_prefix_caching": not hybrid,
        # KV blocks of 32 tokens, not vLLM's CPU default of 128, sample faster on every
        # model measured (docs/results.md, Speed); 32 is the smallest block its attention
        # kernels take.
        "block_size": 32,
    }


class Sampler:
    def __init__(
        self,
        model,
        max_model_len,
        seed,
        dtype,
        gpu_memory_utilization=0.3,
        kv_cache_gb=1.0,
        compile=False,
        head_dtype=None,
    ):
        allow_qwen3_5_without_torchvision(model)  # on any device: it acts only where torchvision fails
        device_options = engine_options(
            torch.cuda.is_available(), compile, is_hybrid(model), gpu_memory_utilization, kv_cache_gb
        )
        self.llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            # Log-probs after temperature scaling: those of the policy that really sampled.
            logprobs_mode="processed_logprobs",
            # Text only: a composite checkpoint's vision tower is neither built nor loaded.
            language_model_only=True,
            use_tqdm_on_load=False,
            # The output projection in another dtype (benchmarks/mismatch.py measures float32's).
            hf_overrides={"head_dtype": head_dtype} if head_dtype else None,
            **device_options,
        )
        self.dtype = self.llm.llm_engine.model_config.dtype
        text_config = self.llm.llm_engine.model_config.hf_text_config
        self.tied = bool(getattr(text_config, "tie_word_embeddings", False))
        if self.tied:
            self.llm.collective_rpc(_tie_head, args=(text_config.vocab_size,))
        # Parameters the engine keeps in another dtype than its own, such as a gated delta
        # net's A_log in float32 under bf16: they travel in that dtype (comm.wire_dtype).
        params = self.llm.collective_rpc(_param_dtypes)[0]
        self.kept_dtypes = {param_key(n): d for n, d in params.items() if d != self.dtype}
        # The engine loads the checkpoint's names; where the checkpoint stores the trained
        # text model under others (a composite's model.language_model.*), they are renamed.
        mapping = text_to_checkpoint([n for n, _ in weight_plan(model)], checkpoint_files(model))
        self.engine_names = {n: c for n, c in mapping.items() if n != c}

    def sample(self, prompt_ids, n, max_tokens, temperature, key):
        """n completions per prompt, in prompt order, each prompt's n contiguous. Request i
        is seeded by request_seed(*key, i), so that the samples are a function of the key
        and the requests alone, whatever else the engine runs beside them. max_tokens: one
        for all, or one per prompt (an episode's later turns have budgets of their own)."""
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
        params = [
            SamplingParams(n=n, max_tokens=m, temperature=temperature, logprobs=0, seed=request_seed(*key, i))
            for i, m in enumerate(budgets)
        ]
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
        named_tensors = ((self.engine_names.get(n, n), t) for n, t in named_tensors)
        self.llm.collective_rpc(_reload_weights, args=(with_tied_head(named_tensors) if self.tied else named_tensors,))
        # False means blocks are still held: cached prefixes computed with the old weights
        # would be served at the next step, a silent off-policy error. Between steps no
        # request runs, so it never should; if it does, this sampler stops the job.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a weight sync (blocks still held): stopping")


QWEN3_5 = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)


def allow_qwen3_5_without_torchvision(model):
    """vLLM's Qwen3.5 module imports its Qwen3-VL module, which imports smart_resize from
    transformers' torchvision image processor; without torchvision (PyPI has no build for
    the +cpu torch) the import fails and the engine reports that the architecture 'failed
    to be inspected'. Text-only sampling needs no image code: that transformers module is
    stood in for by its PIL twin, which defines the same smart_resize, and the Qwen3.5
    classes are registered as imported here, so that vLLM inspects them in this process
    and not in a fresh interpreter without the stand-in. A no-op for other models and
    wherever torchvision imports."""
    if not set(getattr(AutoConfig.from_pretrained(model), "architectures", None) or []) & set(QWEN3_5):
        return
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # absent, or a CUDA build beside the +cpu torch ('torchvision::nms does not exist')
        pass
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    stand_in = types.ModuleType(name)
    stand_in.smart_resize, stand_in.Qwen2VLImageProcessor = pil.smart_resize, pil.Qwen2VLImageProcessorPil
    sys.modules[name] = stand_in
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen3_5

    for arch in QWEN3_5:
        ModelRegistry.register_model(arch, getattr(qwen3_5, arch))


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
    # The worker's own entry point, which sets vLLM's current config around the runner's
    # reload (code under it may read get_current_vllm_config(), which raises outside it).
    worker.reload_weights(weights_iterator=named_tensors)
    if not torch.cuda.is_available():
        repack_cpu_experts(worker.model_runner.get_model())


def repack_cpu_experts(model):
    """vLLM 0.32's in-place reload re-runs a fused-MoE layer's processing but, on a weight
    update, skips its experts' own process_weights_after_loading, which on CPU is what
    packs w13/w2 for the grouped GEMM: the reloaded experts would compute with unpacked
    weights (a wrong MoE, silently). So the CPU packing is redone here; on GPU that step
    is a no-op and the reload is right as it is."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)


def _tie_head(worker, vocab_size):
    """vLLM's Qwen3-Next builds an output layer of its own even when the config ties it,
    and a tied checkpoint stores no lm_head.weight, so that layer is never loaded: the
    engine would sample from uninitialised memory (zeros in a fresh process, NaN or
    garbage in a used one) until the first sync. It is loaded here from the embedding;
    models that really share the tensor (Qwen3.5, Qwen2) are left as they are."""
    params = dict(worker.model_runner.get_model().named_parameters())
    head = params.get("lm_head.weight")
    embed = next((p for n, p in params.items() if n.endswith("embed_tokens.weight")), None)
    if head is not None and embed is not None and head.data_ptr() != embed.data_ptr():
        # Not _reload_weights: the experts did not reload, and packing them twice breaks them.
        worker.reload_weights(weights_iterator=[("lm_head.weight", embed[:vocab_size].clone())])


def _param_dtypes(worker):
    return {n: p.dtype for n, p in worker.model_runner.get_model().named_parameters()}
