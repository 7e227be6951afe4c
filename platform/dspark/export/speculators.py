"""A trained drafter in the `speculators` layout (the format vLLM documents for speculative decoding;
speculators 0.9's DSparkDraftModel / DFlashDraftModel / Eagle3DraftModel load it).

What maps one to one (our name -> speculators name):

    backbone.fusion.proj / .norm        fc / hidden_norm          fused tapped layers, then RMSNorm
    backbone.layers.i.input_norm        layers.i.input_layernorm
    backbone.layers.i.{q,k,v,o}_proj    layers.i.self_attn.{q,k,v,o}_proj   (and q_norm, k_norm)
    backbone.layers.i.post_norm         layers.i.post_attention_layernorm
    backbone.layers.i.{gate,up,down}    layers.i.mlp.{gate,up,down}_proj
    backbone.norm                       norm
    (EAGLE-3) fc / hidden_norm / layer  fc / layers.0.hidden_norm / layers.0.*   (q/k/v read 2d)
    markov.W1 / markov.W2               markov_head.markov_w1 / markov_w2     (vanilla head)
    confidence.proj                     confidence_head.proj
    draft_ids                           lm_head = the target's rows, d2t (target = draft + d2t[draft]), t2d

Conventions that differ and are converted here:
- Tapped layers: ours are 0-based decoder-layer indices whose *output* is captured; speculators and
  vLLM count hidden states with 0 = the embeddings, so layer i's output is id i + 1 (an off-by-one
  here silently destroys acceptance).
- Block semantics: by default our slot k (position p+k, slot 0 = the anchor token x_p) predicts
  x_{p+k+1}: that is speculators' `sample_from_anchor: true`, block_size = gamma = speculative tokens.
  A drafter trained with the fill-in block (train.sample_from_anchor=false) is `sample_from_anchor:
  false`, block_size = gamma + 1: the only DFlash block vLLM serves.
- Attention inside the block is bidirectional: `sliding_window_non_causal: true` (vLLM makes every
  DFlash layer causal when it is false).
- The draft vocabulary: ours is kept in increasing target-id order (select_draft_vocab), which is
  also speculators' order (it rebuilds lm_head from the verifier as lm_head[t2d]).

Not carried over: the per-position calibration (STS temperatures and offsets) has no field in the
format; it is copied beside the weights as calibration.json. Our gated and rnn Markov heads are
refused with an error naming them (vLLM builds only the vanilla head).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.export.common import cast, draft_vocab_tensors, renamed, write
from dspark.models import Drafter

SPECULATORS_VERSION = "0.9.0"  # the release whose loaders this layout was checked against


def algorithm(drafter: Drafter) -> str:
    """speculators_model_type of a drafter, or a UserError naming what cannot be exported."""
    c = drafter.c
    if c.kind == "eagle3":
        return "eagle3"
    if c.markov not in ("vanilla", "none"):
        raise UserError(
            f"export: the {c.markov!r} Markov head has no counterpart in the speculators layout (vLLM builds "
            "only the vanilla head); train with train.markov=vanilla to export"
        )
    return "dspark" if c.markov == "vanilla" else "dflash"


def aux_layer_ids(tap_layers: list[int]) -> list[int]:
    """Our 0-based tapped decoder layers -> speculators/vLLM hidden-state ids (0 = embeddings)."""
    return [i + 1 for i in tap_layers]


def state_dict(drafter: Drafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Our weights under speculators' names, with the target's (frozen) lm_head rows of the draft
    vocabulary; EAGLE-3 also carries the target's embedding and lm_head (speculators' Eagle3DraftModel
    does not take them from the verifier)."""
    kind = algorithm(drafter)
    out = renamed(drafter) | draft_vocab_tensors(drafter)
    if kind == "eagle3":
        out.setdefault("lm_head.weight", drafter.head.lm_head_weight.detach().float().cpu().clone())
        out["embed_tokens.weight"] = drafter.head.embed_weight.detach().float().cpu().clone()
    return cast(out, dtype)


def config(drafter: Drafter, target_config, verifier: str) -> dict:
    """config.json: speculators_config (proposal and verifier), the draft layers as a Qwen3 config."""
    c, kind = drafter.c, algorithm(drafter)
    layer = {
        "model_type": "qwen3",  # our draft layer is Qwen3's (per-head q/k RMSNorm), whatever the target
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": c.hidden_size,
        "num_hidden_layers": 1 if kind == "eagle3" else c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 32768),
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    out = {
        "speculators_model_type": kind,
        "architectures": [
            {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel", "eagle3": "Eagle3DraftModel"}[kind]
        ],
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": c.gamma,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(target_config, "architectures", []))},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab or c.vocab_size,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
    }
    if kind == "eagle3":  # our layer: residual from g (not its norm), no norms around fc, none on the output
        out.update(
            eagle_aux_hidden_state_layer_ids=aux_layer_ids(c.tap_layers),
            norm_before_residual=False,
            norm_before_fc=False,
            fc_norm=False,
            norm_output=False,
        )
        return out
    out.update(
        {
            "block_size": c.block_len(c.gamma),
            "aux_hidden_state_layer_ids": aux_layer_ids(c.tap_layers),
            "mask_token_id": c.mask_token_id,
            "sample_from_anchor": c.sample_from_anchor,
            # vLLM reads `causal = not sliding_window_non_causal` for every DFlash layer: ours attend
            # both ways inside the block
            "sliding_window_non_causal": True,
        }
    )
    if kind == "dspark":
        out.update(
            markov_rank=c.markov_rank,
            markov_head_type="vanilla",
            enable_confidence_head=True,
            confidence_head_with_markov=True,
        )
    return out


def export_speculators(
    drafter: Drafter, target, out_dir: str | Path, verifier: str, dtype: torch.dtype = torch.bfloat16, drafter_dir=None
) -> Path:
    """Write config.json + model.safetensors (+ calibration.json when the drafter folder has one)."""
    return write(out_dir, config(drafter, target.model.config, verifier), state_dict(drafter, dtype), drafter_dir)
