"""Tiny random-init hybrid models for the tests, built in seconds with no hub access and
no vision code: a Qwen3-Next (gated delta net 'linear_attention' layers beside full
attention, a few experts) and a composite Qwen3.5 checkpoint (vision tower + hybrid text
model, the hub layout of Qwen/Qwen3.5-4B). Both use the tiny character tokenizer.

Also a reward that varies within a group for a random model, so that advantages, and with
them the weights, really change from step to step (`--rewards tests.plugins.hybrid_models:parity`)."""

import os
import shutil

# vLLM's CPU gated-delta-net kernel takes only some head sizes: 64 works, 32 fails
# ("Unexpected head dim size, 32"). Qwen3.5-4B uses 128.
LINEAR_HEAD_DIM = 64


def tiny_text_shapes(tokenizer, layer_types, tie_word_embeddings):
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=LINEAR_HEAD_DIM,
        linear_value_head_dim=LINEAR_HEAD_DIM,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def save_folder(path, model, tokenizer, extra=()):
    """Model, tokenizer and generation config into path, written aside and renamed."""
    from transformers import GenerationConfig

    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    for name, text in extra:
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    return str(path)


def build_tiny_qwen3_next(path, tie_word_embeddings=False, layer_types=("linear_attention", "full_attention"), seed=0):
    """A Qwen3NextForCausalLM: 64 wide, one gated-delta-net layer and one full-attention
    layer by default, 4 experts (2 per token) plus the shared expert, random weights."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen3NextConfig(
        **tiny_text_shapes(tokenizer, layer_types, tie_word_embeddings),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )
    torch.manual_seed(seed)
    return save_folder(path, Qwen3NextForCausalLM(config), tokenizer)


# What a composite checkpoint's processor files look like; their content is copied as it is.
PREPROCESSOR = (
    '{"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}\n'
)


def build_tiny_qwen3_5_composite(
    path, tie_word_embeddings=False, layer_types=("linear_attention", "full_attention"), seed=0
):
    """A Qwen3_5ForConditionalGeneration saved in the hub layout: config.json with
    text_config and vision_config, weights under model.language_model.*, model.visual.*
    and lm_head.*, and a preprocessor_config.json beside them."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    # The tie goes in both configs: AutoModelForCausalLM reads text_config's alone, and
    # with True only at the top it would build an untied text model with a random head.
    text = tiny_text_shapes(tokenizer, layer_types, tie_word_embeddings)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    # Image and video tokens inside the tiny vocabulary (the character tokens 3..6).
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=3,
        video_token_id=4,
        vision_start_token_id=5,
        vision_end_token_id=6,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    return save_folder(path, model, tokenizer, extra=[("preprocessor_config.json", PREPROCESSOR)])


def parity(completion, record):
    """1 when the completion's first character has an odd code point: a random model's
    completions score 0 and 1 about equally, so every group has an advantage to follow."""
    return float(ord(completion[0]) % 2) if completion else 0.0
