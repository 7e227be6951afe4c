"""What both export layouts share: the HF names of a draft layer's parameters, the draft-vocabulary
tensors, the verifier's name, and one reference block for a loader of an export to reproduce."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.errors import UserError
from dspark.models import Drafter
from dspark.target.taps import extract

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


TOP_KEYS = {  # DSpark / DFlash
    "backbone.fusion.proj.weight": "fc.weight",
    "backbone.fusion.norm.weight": "hidden_norm.weight",
    "backbone.norm.weight": "norm.weight",
    "markov.W1.weight": "markov_head.markov_w1.weight",
    "markov.W2.weight": "markov_head.markov_w2.weight",
    "markov.Wg.weight": "markov_head.gate_proj.weight",  # gated head
    "markov.Wg.bias": "markov_head.gate_proj.bias",
    "markov.W.weight": "markov_head.joint_proj.weight",  # rnn head: [gate; candidate; output] rows
    "markov.W.bias": "markov_head.joint_proj.bias",
    "confidence.proj.weight": "confidence_head.proj.weight",
    "confidence.proj.bias": "confidence_head.proj.bias",
}
EAGLE3_KEYS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "layers.0.hidden_norm.weight",
    "norm.weight": "norm.weight",
}


def renamed(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The drafter's trained weights under the HF names both layouts use (draft_ids left out):
    backbone.layers.i.MOD.P -> layers.i.HF.P, EAGLE-3's single layer.MOD.P -> layers.0.HF.P, the rest
    by TOP_KEYS / EAGLE3_KEYS."""
    top = EAGLE3_KEYS if drafter.c.kind == "eagle3" else TOP_KEYS
    out = {}
    for k, v in drafter.state_dict().items():
        if k == "draft_ids":
            continue
        if k.startswith("backbone.layers."):
            _, _, i, mod, param = k.split(".")
            out[f"layers.{i}.{LAYER_KEYS[mod]}.{param}"] = v
        elif k.startswith("layer."):
            _, mod, param = k.split(".")
            out[f"layers.0.{LAYER_KEYS[mod]}.{param}"] = v
        else:
            out[top[k]] = v
    return out


def draft_vocab_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """A reduced draft vocabulary as both layouts carry it: lm_head (V_d, d) = the target's rows of the
    draft ids, d2t (target id = draft id + d2t[draft id]) and t2d (V,) bool; {} without one."""
    if drafter.draft_ids is None:
        return {}
    ids = drafter.draft_ids.long().cpu()  # (V_d,) increasing target ids
    if not bool((ids[1:] > ids[:-1]).all()):
        raise UserError("export: the drafter's draft_ids are not increasing target ids (see select_draft_vocab)")
    lm_head = drafter.head.lm_head_weight.detach().float().cpu()  # (V, d)
    return {
        "lm_head.weight": lm_head[ids],
        "d2t": ids - torch.arange(len(ids)),
        "t2d": torch.zeros(lm_head.shape[0], dtype=torch.bool).index_fill_(0, ids, True),
    }


def cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Float tensors to `dtype`, the rest (ids, masks) as they are; contiguous CPU copies for safetensors."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in weights.items()}


def write(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor], drafter_dir=None) -> Path:
    """An export folder: config.json + model.safetensors (+ calibration.json when the drafter folder has one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if drafter_dir and (Path(drafter_dir) / "calibration.json").is_file():
        shutil.copy(Path(drafter_dir) / "calibration.json", out / "calibration.json")
    return out


def default_verifier(target) -> str:
    """What config.json names as the verifier: a hub target's id, else its local folder."""
    return target.name if target.revision else target.path


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
