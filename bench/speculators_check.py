"""Load an export (jobs/export.py --reference) with the `speculators` package and reproduce our block:
prints the max abs difference of the draft logits and confidence logits and the top-1 agreement per
slot; exits 1 when they disagree. Runs in speculators' own environment (it pins transformers <= 5.19),
so it imports nothing from this project:

    bench/speculators_roundtrip.sh            # makes the venv, exports a drafter, runs this
    .local/venvs/speculators/bin/python bench/speculators_check.py EXPORT_DIR --verifier TARGET_FOLDER

The block is computed the way speculators' DFlash/DSpark backbone does it (context = hidden_norm(fc(aux))
at positions < p, the block [x_p, MASK, ...] at positions p.., non-causal inside the block; with
`sample_from_anchor: false` the drafts are the masks' outputs), and for
EAGLE-3 its first drafting step at every position, from the loaded modules: a wrong key, layer id or
vocabulary order shows up as a difference.
"""

import argparse
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig
from transformers import AutoModelForCausalLM


def stored_dtype(weights: Path) -> torch.dtype:
    """The export's float dtype."""
    with safe_open(str(weights), "pt") as f:  # every kind has fc: one tensor read, not the whole file
        return f.get_tensor("fc.weight").dtype


@torch.no_grad()
def block(m, aux: torch.Tensor, ids: torch.Tensor, p: int):
    """Draft logits (B, V_d) and, for DSpark, confidence logits (B,) of the block anchored at p."""
    c = m.config
    B = c.block_size
    G = B if getattr(c, "sample_from_anchor", True) else B - 1  # fill-in: the anchor's own output is unused
    blk = torch.full((1, B), c.mask_token_id, dtype=torch.long)
    blk[0, 0] = ids[0, p]
    x = m.embed_tokens(blk)
    ctx = m.hidden_norm(m.fc(aux[:, :p]))
    pos = torch.cat([torch.arange(p), p + torch.arange(B)])[None]
    pe = m.rotary_emb(x, pos)
    for layer in m.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos, position_embeddings=pe)
    hid = m.norm(x)[:, B - G :]  # (1, G, d): the slots that predict x_{p+1} .. x_{p+G}
    logits = m.lm_head(hid)
    conf = None
    if getattr(m, "markov_head", None) is not None:
        prev = ids[:, p : p + G]  # draft k conditions on x_{p+k-1}
        e = m.markov_head.prev_embeddings(prev)
        logits = logits + m.markov_head.block_bias(prev_token_ids=prev, hidden_states=hid, prev_emb=e)
        conf = m.confidence_head(torch.cat([hid, e], -1)).squeeze(-1)[0]
    return logits[0], conf


@torch.no_grad()
def verifier_aux(verifier: str, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The verifier's hidden states at the config's aux ids as vLLM captures them: id 0 = the
    embeddings, id k = the output of decoder layer k - 1 (before the final norm)."""
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    got: dict[int, torch.Tensor] = {}
    hooks = [model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: got.__setitem__(0, out))]
    for k in range(1, model.config.num_hidden_layers + 1):
        hooks.append(
            model.model.layers[k - 1].register_forward_hook(
                lambda _m, _i, out, k=k: got.__setitem__(k, out[0] if isinstance(out, tuple) else out)
            )
        )
    model(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.cat([got[k] for k in sorted(layer_ids)], -1)


@torch.no_grad()
def eagle3_step0(m, aux: torch.Tensor, ids: torch.Tensor):
    """EAGLE-3's first drafting step at every position t: taps at t with token t+1 -> (T-1, V_d) logits."""
    x = torch.cat([m.embed_tokens(ids[:, 1:]), m.fc(aux[:, :-1])], -1)
    pos = 1 + torch.arange(x.shape[1])[None]
    pe = m.rotary_emb(x, pos)
    for layer in m.layers:  # causal (sdpa, no mask)
        x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return m.lm_head(m.norm(x))[0], None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("--verifier", default="", help="the verifier's folder, if not the one named in config.json")
    ap.add_argument("--tol", type=float, default=0.0, help="max abs logit difference allowed (default: by dtype)")
    args = ap.parse_args()
    path = Path(args.export_dir)
    cfg = SpeculatorModelConfig.from_pretrained(path)
    if args.verifier:
        cfg.speculators_config.verifier.name_or_path = args.verifier
    verifier = cfg.speculators_config.verifier.name_or_path
    m = SpeculatorModel.from_pretrained(path, config=cfg).float().eval()
    m.config.transformer_layer_config._attn_implementation = "sdpa"
    ref = load_file(str(path / "reference.safetensors"))
    dtype = stored_dtype(path / "model.safetensors")
    tol = args.tol or (1e-3 if dtype == torch.float32 else 0.5)
    ok = True
    if Path(verifier).is_dir():  # the tap-layer convention: the verifier's own hidden states at the exported ids
        ids = getattr(cfg, "aux_hidden_state_layer_ids", None) or cfg.eagle_aux_hidden_state_layer_ids
        aux = verifier_aux(verifier, ref["input_ids"], list(ids))
        adiff = (aux - ref["aux"]).abs().max().item()
        print(f"verifier hidden states at aux ids {list(ids)}: max abs diff {adiff:.2e}")
        ok = adiff <= 1e-3 * max(1.0, ref["aux"].abs().max().item())
    if cfg.speculators_model_type == "eagle3":
        logits, conf = eagle3_step0(m, ref["aux"], ref["input_ids"])
    else:
        logits, conf = block(m, ref["aux"], ref["input_ids"], int(ref["anchor"]))
    diff = (logits - ref["logits"]).abs().max().item()
    agree = (logits.argmax(-1) == ref["logits"].argmax(-1)).tolist()
    print(f"{type(m).__name__} from {path} ({dtype}): draft logits {tuple(logits.shape)}, max abs diff {diff:.2e}")
    print(f"top-1 agreement per slot: {agree}")
    ok = ok and diff <= tol and all(agree)
    if conf is not None:
        cdiff = (conf - ref["confidence_logit"]).abs().max().item()
        print(f"confidence logits max abs diff {cdiff:.2e}")
        ok = ok and cdiff <= tol
    print("OK" if ok else f"MISMATCH (tolerance {tol:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
