"""Tiny random HF decoder-only models of every family the decoding runner supports, for tests that
need a target's forward but not its quality: the runner-equals-HF tests, and the exactness tests of
speculative sampling (exact for any target weights), where 10,000 requests then cost seconds. And
untrained drafters: exactness never depends on the drafter's quality."""

import torch
import transformers

from dspark.models import DrafterConfig, build_drafter

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.3,
)
CONFIGS = {  # family -> its config class and what to switch on beyond TINY
    "llama": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True, rope_theta=500.0)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=5)),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": (transformers.Qwen3Config, dict(attention_bias=True)),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        dict(
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_local_base_freq=100.0,
            final_logit_softcapping=3.0,
        ),
    ),
}


def tiny_model(family: str):
    """A random model of `family` (fixed seed, every parameter perturbed), eval mode, no gradients."""
    cls, extra = CONFIGS[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**TINY, **extra), attn_implementation="eager")
    for p in model.parameters():  # norms start at exactly 1 (or 0 for Gemma's 1 + w): perturb them too
        p.data.add_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


def untrained_drafter(
    tgt,
    kind: str,
    gamma: int,
    num_layers: int = 1,
    markov: str = "vanilla",
    markov_rank: int = 32,
    draft_ids=None,
    sample_from_anchor: bool = True,
):
    """A freshly initialised drafter of `kind` (seed 0, taps [1, 2, 3]) for the loaded target `tgt`, eval mode;
    `markov` applies to DSpark only; `draft_ids` (increasing token ids) a draft vocabulary;
    `sample_from_anchor` False: the fill-in block."""
    torch.manual_seed(0)
    c = DrafterConfig.from_target(
        tgt.config,
        kind,
        [1, 2, 3],
        tgt.mask_token_id,
        num_layers=num_layers,
        gamma=gamma,
        markov=markov if kind == "dspark" else "none",
        markov_rank=markov_rank,
        draft_vocab=len(draft_ids) if draft_ids is not None else 0,
        sample_from_anchor=sample_from_anchor,
    )
    drafter = build_drafter(c, tgt.model).eval()
    if draft_ids is not None:
        drafter.set_draft_vocab(torch.as_tensor(draft_ids))
    return drafter
