"""A trained drafter in DeepSpec's checkpoint layout: what DeepSpec's training saves
(`save_pretrained` of its Qwen3DSparkModel / Qwen3Eagle3Model) and what serves DeepSpec checkpoints
elsewhere reads (SGLang's DSpark, vLLM's `Qwen3DSparkModel` loader, DeepSpec's own evaluation).

config.json is a flat Qwen3 config of the draft layers plus DeepSpec's fields:

    target_layer_ids      our tap_layers as they are: 0-based decoder layers whose output is read
                          (hidden_states[i + 1] in HF's list; -1 would be the embeddings)
    num_target_layers     the target's depth
    block_size            gamma: slot k of [x_p, MASK, ..] predicts x_{p+k+1} (DeepSpec's labels
                          p+1 .. p+block_size), our default block
    mask_token_id, markov_rank (0 = DFlash), markov_head_type (vanilla | gated | rnn: all three),
    enable_confidence_head, confidence_head_with_markov (ours reads [h_k; W1[x_{k-1}]])
    EAGLE-3: ttt_length = gamma, step_loss_decay, draft_num_hidden_layers = 1

model.safetensors carries embed_tokens and lm_head (the target's, frozen) beside the trained weights,
under the same HF names as the speculators layout (dspark.export.common), the gated head's
markov_head.gate_proj and the rnn head's markov_head.joint_proj included. DeepSpec itself always drafts
over the whole vocabulary; a drafter with a reduced one is written as vLLM's Qwen3DSparkModel loader
takes it: draft_vocab_size, lm_head rows of the draft ids, d2t and t2d.

Not carried over: the fill-in block (DeepSpec's block is anchor-sampled; refused by name); the STS
calibration has no field (copied beside the weights as calibration.json).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.export.common import cast, draft_vocab_tensors, renamed, write
from dspark.models import Drafter

ARCHITECTURES = {"dspark": "Qwen3DSparkModel", "dflash": "Qwen3DSparkModel", "eagle3": "Qwen3Eagle3Model"}
NUM_ANCHORS = 512  # DeepSpec's training setting (its model requires the field; decoding ignores it)
EAGLE3_STEP_DECAY = 0.8  # our EAGLE-3 loss weights step k by 0.8^k (dspark.train.loss)


def state_dict(drafter: Drafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """DeepSpec's keys: our renamed weights, the target's embedding, and lm_head (all V rows, or the
    draft vocabulary's rows with d2t / t2d)."""
    if not drafter.c.sample_from_anchor:
        raise UserError(
            "export --layout deepspec: this drafter was trained with the fill-in block "
            "(train.sample_from_anchor=false); DeepSpec's block is anchor-sampled (use --layout speculators)"
        )
    out = renamed(drafter) | draft_vocab_tensors(drafter)
    out.setdefault("lm_head.weight", drafter.head.lm_head_weight.detach().float().cpu().clone())
    out["embed_tokens.weight"] = drafter.head.embed_weight.detach().float().cpu().clone()
    return cast(out, dtype)


def config(drafter: Drafter, target_config, verifier: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    c = drafter.c
    layers = 1 if c.kind == "eagle3" else c.num_layers
    out = {
        "model_type": "qwen3",  # our draft layer is Qwen3's (per-head q/k RMSNorm), whatever the target
        "architectures": [ARCHITECTURES[c.kind]],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 32768),
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
        "dtype": str(dtype).removeprefix("torch."),
        "num_target_layers": target_config.num_hidden_layers,
        "target_layer_ids": list(c.tap_layers),
        "target_model_name_or_path": verifier,
    }
    if c.draft_vocab:
        out["draft_vocab_size"] = c.draft_vocab
    if c.kind == "eagle3":
        return out | {"ttt_length": c.gamma, "step_loss_decay": EAGLE3_STEP_DECAY, "draft_num_hidden_layers": 1}
    markov = c.markov != "none"
    out |= {
        "block_size": c.gamma,
        "mask_token_id": c.mask_token_id,
        "num_anchors": NUM_ANCHORS,
        "markov_rank": c.markov_rank if markov else 0,
        "enable_confidence_head": drafter.has_confidence,
    }
    if markov:
        out["markov_head_type"] = c.markov
    if drafter.has_confidence:
        out["confidence_head_with_markov"] = True
    return out


def export_deepspec(
    drafter: Drafter, target, out_dir: str | Path, verifier: str, dtype: torch.dtype = torch.bfloat16, drafter_dir=None
) -> Path:
    """Write config.json + model.safetensors (+ calibration.json when the drafter folder has one)."""
    cfg = config(drafter, target.model.config, verifier, dtype)
    return write(out_dir, cfg, state_dict(drafter, dtype), drafter_dir)
