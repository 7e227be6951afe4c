"""Load an export in DeepSpec's layout (jobs/export.py --layout deepspec --reference) with DeepSpec's own
model classes and reproduce our block: prints the max abs difference of the draft logits and confidence
logits and the top-1 agreement per slot; exits 1 when they disagree.

DeepSpec is not a package: point --deepspec-src (or DEEPSPEC_SRC) at a checkout of
github.com/deepseek-ai/DeepSpec (its `deepspec/` folder is imported from there; it runs with this
project's transformers):

    python jobs/export.py --drafter DRAFTER --out exports/d --layout deepspec --dtype float32 --reference
    python bench/deepspec_check.py exports/d --deepspec-src ~/src/DeepSpec

The model is built from the export's config.json (Qwen3DSparkModel, or Qwen3Eagle3Model) and loads
model.safetensors strictly; its block is computed with DeepSpec's helpers (create_noise_embed,
create_position_ids, create_dspark_attention_mask, _forward_backbone, compute_logits, the Markov head's
apply_block_logits, the confidence head) at the reference's anchor; EAGLE-3's first drafting step with
its forward over the whole sequence. When the verifier named in config.json is a local folder, its
hidden states at target_layer_ids (DeepSpec's extract_context_feature) must be the reference's features:
the tap-layer numbering. DeepSpec always drafts over the whole vocabulary: an export with
a draft vocabulary is loaded with lm_head and markov_w2 sized to draft_vocab_size (the convention vLLM's
Qwen3DSparkModel loader reads), every other tensor as DeepSpec defines it.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn.attention.flex_attention import create_mask
from transformers import Qwen3Config


def load(path: Path):
    """DeepSpec's model for the export at `path`, weights loaded strictly, float32, eval."""
    from deepspec.modeling import Qwen3DSparkModel, Qwen3Eagle3Model

    cfg = Qwen3Config.from_pretrained(path)
    cfg._attn_implementation = "sdpa"  # DeepSpec's block mask made dense (it trains with flex_attention)
    cls = {"Qwen3DSparkModel": Qwen3DSparkModel, "Qwen3Eagle3Model": Qwen3Eagle3Model}[cfg.architectures[0]]
    m = cls(cfg)
    weights = load_file(str(path / "model.safetensors"))
    vd = getattr(cfg, "draft_vocab_size", None)
    if vd:
        m.lm_head = torch.nn.Linear(cfg.hidden_size, vd, bias=False)
        if getattr(m, "markov_head", None) is not None:
            m.markov_head.markov_w2 = torch.nn.Linear(cfg.markov_rank, vd, bias=False)
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    m.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return m.float().eval(), cfg


@torch.no_grad()
def block(m, cfg, aux: torch.Tensor, ids: torch.Tensor, p: int):
    """Draft logits (G, V') and confidence logits (G,) of the block anchored at p, DeepSpec's way."""
    from deepspec.modeling.dspark.common import create_dspark_attention_mask, create_noise_embed, create_position_ids

    G, T = cfg.block_size, ids.shape[1]
    anchors, keep = torch.tensor([[p]]), torch.tensor([[True]])
    noise = create_noise_embed(m.embed_tokens, ids, anchors, keep, mask_token_id=cfg.mask_token_id, block_size=G)
    pos = torch.cat([torch.arange(T)[None], create_position_ids(anchors, G)], 1)
    bm = create_dspark_attention_mask(  # DeepSpec's flex-attention BlockMask, made dense for sdpa
        anchor_positions=anchors, block_keep_mask=keep, seq_len=T, block_size=G, device=ids.device
    )
    mask = create_mask(bm.mask_mod, 1, 1, G, T + G, device=ids.device)  # (1, 1, G, T+G) bool
    hid = m._forward_backbone(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden_states=aux)
    logits = m.compute_logits(hid).view(1, 1, G, -1)
    prev = ids[:, p : p + G].view(1, 1, G)  # slot k's previous token: x_{p+k}
    conf = None
    if m.markov_head is not None:
        logits = m.markov_head.apply_block_logits(logits, token_ids=prev, hidden_states=hid.view(1, 1, G, -1))
    if m.confidence_head is not None:
        e = m.markov_head.get_prev_embeddings(prev).view(1, G, -1)
        conf = m.confidence_head(torch.cat([hid, e], -1))[0]
    return logits[0, 0], conf


@torch.no_grad()
def verifier_aux(verifier: str, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The verifier's context features at the config's target_layer_ids, taken by DeepSpec's own
    extract_context_feature from HF's hidden states (index 0 = the embeddings)."""
    from deepspec.modeling.dspark.common import extract_context_feature
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    return extract_context_feature(model(input_ids=ids, output_hidden_states=True).hidden_states, layer_ids)


@torch.no_grad()
def eagle3_step0(m, aux: torch.Tensor, ids: torch.Tensor):
    """EAGLE-3's first drafting step at every position t (taps at t, token t+1), causal: (T-1, V')."""
    T1 = ids.shape[1] - 1
    h = m(hidden_states=aux[:, :-1], input_ids=ids[:, 1:], position_ids=torch.arange(T1)[None])
    return m.compute_logits(h)[0], None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("--deepspec-src", default=os.environ.get("DEEPSPEC_SRC", ""), help="a DeepSpec checkout")
    ap.add_argument("--tol", type=float, default=1e-3, help="max abs logit difference allowed (float32 export)")
    args = ap.parse_args()
    if not (Path(args.deepspec_src) / "deepspec" / "modeling").is_dir():
        sys.exit(f"--deepspec-src {args.deepspec_src!r}: not a DeepSpec checkout (no deepspec/modeling in it)")
    sys.path.insert(0, str(Path(args.deepspec_src).resolve()))
    path = Path(args.export_dir)
    m, cfg = load(path)
    ref = load_file(str(path / "reference.safetensors"))
    ok = True
    verifier = getattr(cfg, "target_model_name_or_path", "")
    if Path(verifier).is_dir():  # the tap-layer convention: the verifier's own features at target_layer_ids
        aux = verifier_aux(verifier, ref["input_ids"], list(cfg.target_layer_ids))
        adiff = (aux - ref["aux"]).abs().max().item()
        print(f"verifier features at target_layer_ids {list(cfg.target_layer_ids)}: max abs diff {adiff:.2e}")
        ok = adiff <= 1e-3 * max(1.0, ref["aux"].abs().max().item())
    if cfg.architectures[0] == "Qwen3Eagle3Model":
        logits, conf = eagle3_step0(m, ref["aux"], ref["input_ids"])
    else:
        logits, conf = block(m, cfg, ref["aux"], ref["input_ids"], int(ref["anchor"]))
    diff = (logits - ref["logits"]).abs().max().item()
    agree = (logits.argmax(-1) == ref["logits"].argmax(-1)).tolist()
    head = getattr(cfg, "markov_head_type", "none") if getattr(cfg, "markov_rank", 0) else "none"
    print(f"{type(m).__name__} (markov {head}) from {path}: draft logits {tuple(logits.shape)}", end=", ")
    print(f"max abs diff {diff:.2e}")
    print(f"top-1 agreement per slot: {agree}")
    ok = ok and diff <= args.tol and all(agree)
    if conf is not None:
        cdiff = (conf - ref["confidence_logit"]).abs().max().item()
        print(f"confidence logits max abs diff {cdiff:.2e}")
        ok = ok and cdiff <= args.tol
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
