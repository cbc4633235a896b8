"""Token log-probs of a causal LM, as the learner takes them: the output projection run a
chunk of positions at a time (ChunkedTokenLogprobs), so the [T, V] logits and their
gradient never exist whole, with the dense path kept beside it; and which attention
kernel a micro-batch gets."""

import torch
from torch.distributed.tensor import DTensor

# Widest micro-batch (positions per sequence) that gets transformers' eager attention on a
# CPU in bf16; see attention_kernel.
EAGER_MAX_WIDTH = 240


def attention_kernel(device_type, dtype, width, loaded):
    """The attention transformers runs for one micro-batch of `width` positions. On a CPU
    in bf16, torch's flash-attention kernel is slow in the backward, and transformers'
    eager attention (bf16 batched matmuls, a float32 softmax) runs forward + backward
    faster up to EAGER_MAX_WIDTH (benchmarks/attention.py; docs/results.md, Speed); wider,
    its score tensors outgrow the caches and flash wins. In float32 flash is never slower.
    Everywhere else: the implementation the model loaded with (sdpa)."""
    if device_type == "cpu" and dtype == torch.bfloat16 and width <= EAGER_MAX_WIDTH:
        return "eager"
    return loaded


def token_logprobs(model, ids, attention, temperature, chunk=1024, entropy=True):
    """log p(token t+1 | tokens <= t) at the sampling temperature [B, T-1], and the
    entropy of each next-token distribution [B, T-1] (None with entropy=False: the
    reference pass needs none), for a plain or an FSDP2 model. chunk > 0: the output
    projection runs `chunk` positions at a time, so the [B, T-1, V] logits and their
    gradient never exist whole; 0: dense, all positions at once."""
    if not chunk:
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
        if temperature > 0:
            logits = logits / temperature
        logz = torch.logsumexp(logits, dim=-1)  # [B, T-1]
        logp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logz  # [B, T-1]
        if not entropy:
            return logp, None
        with torch.no_grad():
            entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [B, T-1]
        return logp, entropy
    hidden, head = final_hidden(model, ids, attention)  # [B, T, H]
    B, T, H = hidden.shape
    flat = hidden[:, :-1].reshape(-1, H)  # [B*(T-1), H]
    targets = ids[:, 1:].reshape(-1)  # [B*(T-1)]
    logp, entropies = ChunkedTokenLogprobs.apply(
        flat, head.weight, head.bias, targets, temperature, chunk, entropy
    )  # [B*(T-1)] each
    return logp.view(B, T - 1), entropies.view(B, T - 1) if entropy else None


def final_hidden(model, ids, attention):
    """The input of the output projection at every position [B, T, H], and that
    projection (the lm_head, which tied embeddings share with embed_tokens), from one
    call of the whole model whose head runs on no position. Calling the whole model, not
    its inner decoder, keeps FSDP2's root hooks: they unshard the root's parameters, the
    head's among them, and the root does not reshard after forward, so the head's
    weight stays whole through the backward, where the final callback reduce-scatters
    its gradient like any other."""
    head = model.get_output_embeddings()
    # The chunks apply the head's weight and bias themselves: right only when the logits
    # are exactly a plain linear head of the hidden states.
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"the output projection is a {type(head).__name__}, not a plain Linear: use --logprob-chunk 0")
    if any(
        getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None)
        for c in (model.config, model.config.get_text_config())
    ):
        raise ValueError(
            f"{type(model).__name__} transforms its logits after the output projection: use --logprob-chunk 0"
        )
    captured = []

    def skip_head(module, args):
        captured.append(args[0])  # [B, T, H]
        return (args[0][..., :0, :],)  # the head then makes [B, 0, V] logits: none

    handle = head.register_forward_pre_hook(skip_head)
    try:
        model(input_ids=ids, attention_mask=attention, use_cache=False)
    finally:
        handle.remove()
    if isinstance(head.weight, DTensor):
        raise RuntimeError(
            "the output projection is sharded after the forward: chunked log-probs need it whole (use --logprob-chunk 0)"
        )
    return captured[0], head


def chunk_logits(hidden, weight, bias, temperature, out, half=None):
    """Temperature-scaled float32 logits of a few positions, written into out [C, V]
    (and half [C, V], the head's own output when it computes in a narrower dtype): the
    dense path's ops (the head's linear in its dtype, then float32, then / temperature),
    so its numbers, in buffers that every chunk reuses rather than fresh allocations
    (on CPU each would be page-faulted in anew)."""
    target = out if half is None else half
    if bias is None:
        torch.mm(hidden, weight.t(), out=target)
    else:
        torch.addmm(bias, hidden, weight.t(), out=target)
    if half is not None:
        out.copy_(half)
    if temperature > 0:
        out.div_(temperature)
    return out


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(target) [N] and the entropy [N] of softmax(chunk_logits(hidden)), computed
    `chunk` positions at a time: two [chunk, V] float32 buffers are alive in the forward
    and one in the backward, never the [N, V] logits or their gradient. The forward keeps
    only hidden [N, H] and the log normaliser [N]; the backward recomputes each chunk's
    logits (one matmul more than the dense path's three) and turns them into that chunk's
    gradient in place. The entropy is a metric with no gradient, as in the dense path."""

    @staticmethod
    def buffers(n, chunk, weight, count):
        rows = min(n, chunk)
        full = [
            torch.empty(rows, weight.shape[0], dtype=torch.float32, device=weight.device) for _ in range(count)
        ]  # [C, V] each
        half = (
            None
            if weight.dtype == torch.float32
            else torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        )  # [C, V]
        return full, half

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy=True):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty_like(logp)  # [N]
        logz = torch.empty_like(logp)  # [N]
        (logits_buf, probs_buf), half_buf = ChunkedTokenLogprobs.buffers(n, chunk, weight, 2)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logits = chunk_logits(
                hidden[s:e],
                weight,
                bias,
                temperature,
                logits_buf[: e - s],
                None if half_buf is None else half_buf[: e - s],
            )  # [C, V]
            probs = probs_buf[: e - s]  # [C, V]
            # torch.logsumexp's own steps (max, exp of the difference, sum, log, add), so
            # its very numbers, with the exponentials kept for the entropy.
            top = logits.amax(-1, keepdim=True)  # [C, 1]
            torch.sub(logits, top, out=probs).exp_()
            total = probs.sum(-1)  # [C]
            logz[s:e] = total.log().add_(top.squeeze(-1))
            logp[s:e] = logits.gather(-1, targets[s:e, None]).squeeze(-1) - logz[s:e]
            if with_entropy:
                entropy[s:e] = logz[s:e] - torch.linalg.vecdot(probs, logits) / total
        ctx.save_for_backward(hidden, weight, bias, targets, logz)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, logz = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, H]
        # Accumulated in the weight's dtype, as the dense path's one matmul leaves it.
        grad_weight = torch.zeros_like(weight) if need_weight else None  # [V, H]
        grad_bias = torch.zeros_like(bias) if need_bias else None  # [V]
        (logits_buf,), half_buf = ChunkedTokenLogprobs.buffers(n, ctx.chunk, weight, 1)
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            g = grad_logp[s:e, None].float()  # [C, 1]
            half = None if half_buf is None else half_buf[: e - s]  # [C, V]
            # d logp / d logits = onehot(target) - softmax, times the incoming gradient,
            # built in place in the recomputed logits' buffer.
            grad_logits = chunk_logits(hidden[s:e], weight, bias, ctx.temperature, logits_buf[: e - s], half)  # [C, V]
            grad_logits.sub_(logz[s:e, None]).exp_().mul_(-g)
            grad_logits.scatter_add_(-1, targets[s:e, None], g)
            if ctx.temperature > 0:
                grad_logits.div_(ctx.temperature)
            if half is not None:  # as the dense path casts its float32 gradient back
                grad_logits = half.copy_(grad_logits)
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[s:e])  # [C, H]
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), hidden[s:e])  # [V, H]
            if need_bias:
                grad_bias += grad_logits.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
