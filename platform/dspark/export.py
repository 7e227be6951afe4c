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
- Block semantics: our slot k (position p+k, slot 0 = the anchor token x_p) predicts x_{p+k+1}: that
  is speculators' `sample_from_anchor: true`, block_size = gamma = speculative tokens.
- The draft vocabulary: ours is kept in increasing target-id order (select_draft_vocab), which is
  also speculators' order (it rebuilds lm_head from the verifier as lm_head[t2d]).

Not carried over: the per-position calibration (STS temperatures and offsets) has no field in the
format; it is copied beside the weights as calibration.json. Our gated and rnn Markov heads are
refused with an error naming them (vLLM builds only the vanilla head).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.errors import UserError
from dspark.models import Drafter
from dspark.target.taps import extract

SPECULATORS_VERSION = "0.9.0"  # the release whose loaders this layout was checked against
LAYER_KEYS = {
    "input_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "post_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
TOP_KEYS = {
    "backbone.fusion.proj.weight": "fc.weight",
    "backbone.fusion.norm.weight": "hidden_norm.weight",
    "backbone.norm.weight": "norm.weight",
    "markov.W1.weight": "markov_head.markov_w1.weight",
    "markov.W2.weight": "markov_head.markov_w2.weight",
    "confidence.proj.weight": "confidence_head.proj.weight",
    "confidence.proj.bias": "confidence_head.proj.bias",
}


EAGLE3_KEYS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "layers.0.hidden_norm.weight",
    "norm.weight": "norm.weight",
}


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
    c_kind = algorithm(drafter)
    lm_head = drafter.head.lm_head_weight.detach().float().cpu()  # (V, d)
    out: dict[str, torch.Tensor] = {}
    for k, v in drafter.state_dict().items():
        if k == "draft_ids":
            continue
        if k.startswith("backbone.layers."):
            _, _, i, mod, param = k.split(".")
            name = f"layers.{i}.{LAYER_KEYS[mod]}.{param}"
        elif k.startswith("layer."):  # EAGLE-3's single layer
            _, mod, param = k.split(".")
            name = f"layers.0.{LAYER_KEYS[mod]}.{param}"
        elif c_kind == "eagle3":
            name = EAGLE3_KEYS[k]
        else:
            name = TOP_KEYS[k]
        out[name] = v
    if drafter.draft_ids is not None:
        ids = drafter.draft_ids.long().cpu()  # (V_d,) increasing target ids
        if not bool((ids[1:] > ids[:-1]).all()):
            raise UserError("export: the drafter's draft_ids are not increasing target ids (see select_draft_vocab)")
        out["lm_head.weight"] = lm_head[ids]  # (V_d, d)
        out["d2t"] = ids - torch.arange(len(ids))  # target id = draft id + d2t[draft id]
        out["t2d"] = torch.zeros(lm_head.shape[0], dtype=torch.bool).index_fill_(0, ids, True)
    elif c_kind == "eagle3":
        out["lm_head.weight"] = lm_head.clone()  # a tied target shares it with the embedding
    if c_kind == "eagle3":
        out["embed_tokens.weight"] = drafter.head.embed_weight.detach().float().cpu().clone()
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in out.items()}


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
            "block_size": c.gamma,
            "aux_hidden_state_layer_ids": aux_layer_ids(c.tap_layers),
            "mask_token_id": c.mask_token_id,
            "sample_from_anchor": True,
            "sliding_window_non_causal": False,
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


def default_verifier(target) -> str:
    """What config.json names as the verifier: a hub target's id, else its local folder."""
    return target.name if target.revision else target.path


def export_speculators(
    drafter: Drafter, target, out_dir: str | Path, verifier: str, dtype: torch.dtype = torch.bfloat16, drafter_dir=None
) -> Path:
    """Write config.json + model.safetensors (+ calibration.json when the drafter folder has one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = state_dict(drafter, dtype)
    (out / "config.json").write_text(json.dumps(config(drafter, target.model.config, verifier), indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if drafter_dir and (Path(drafter_dir) / "calibration.json").is_file():
        shutil.copy(Path(drafter_dir) / "calibration.json", out / "calibration.json")
    return out


@torch.no_grad()
def reference(drafter: Drafter, target, ids: list[int], anchor: int) -> dict[str, torch.Tensor]:
    """Inputs and our outputs for one block, for a loader of the export to reproduce (float32):
    aux (1, T, m·d) the tapped layers in ascending order as vLLM concatenates them, input_ids (1, T),
    the anchor position p, the block's draft logits (gamma, V_d) with the Markov bias of the teacher
    tokens x_p..x_{p+gamma-1}, and the confidence logits; for EAGLE-3 the first drafting step's logits
    at every position (T-1, V_d)."""
    c = drafter.c
    if not 0 < anchor <= len(ids) - c.gamma:
        raise ValueError(f"anchor {anchor} needs {c.gamma} tokens from it in a sequence of {len(ids)}")
    feats, _ = extract(target.model, ids, c.tap_layers)  # (T, m, d)
    x = torch.tensor([ids])
    d = drafter.float()
    if c.kind == "eagle3":  # step 0 at every position t: (taps at t, x_{t+1}) -> logits for x_{t+2}
        T1 = len(ids) - 1
        causal = torch.tril(torch.ones(T1, T1, dtype=torch.bool))[None, None]
        h0, _ = d._step(x[:, 1:], d.fusion(feats[None, :-1].float()), torch.arange(T1)[None], None, causal)
        return {
            "aux": feats.flatten(-2)[None].float().contiguous(),
            "input_ids": x,
            "anchor": torch.tensor([anchor]),
            "logits": d.logits(d.norm(h0))[0].contiguous(),  # (T-1, V_d)
        }
    out = d.train_outputs(
        feats[None].float(), x, torch.ones_like(x, dtype=torch.bool), torch.tensor([[anchor]]), c.gamma
    )
    ref = {
        "aux": feats.flatten(-2)[None].float().contiguous(),
        "input_ids": x,
        "anchor": torch.tensor([anchor]),
        "logits": out["logits"][0, 0].contiguous(),  # (gamma, V_d)
    }
    if "conf_logit" in out:
        ref["confidence_logit"] = out["conf_logit"][0, 0].contiguous()
    return ref
