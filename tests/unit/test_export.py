"""The exports (dspark.export, jobs/export.py): names, shapes and conventions of the speculators and
the DeepSpec layouts. Loading the speculators export with the speculators package itself is
tests/integration/test_export_speculators.py; the DeepSpec one with DeepSpec's code, bench/deepspec_check.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import untrained_drafter

from dspark import export
from dspark import target as targets
from dspark.errors import UserError
from dspark.export import deepspec
from dspark.models import save_drafter


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


def test_aux_ids_count_the_embeddings_as_zero():
    # our taps are 0-based decoder layers whose output is read; vLLM's id k is the output of layer k-1
    assert export.aux_layer_ids([1, 3, 5]) == [2, 4, 6]


def test_dspark_weights_under_speculators_names(tgt):
    ids = torch.arange(0, 4096, 8)  # 512 increasing target ids
    d = untrained_drafter(tgt, "dspark", gamma=5, num_layers=2, markov_rank=16, draft_ids=ids)
    lm_head = tgt.model.get_output_embeddings().weight.detach().float()
    w = export.state_dict(d, torch.bfloat16)
    H, V, D = d.c.hidden_size, d.c.vocab_size, len(ids)
    per_layer = {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (d.c.num_heads * d.c.head_dim, H),
        "self_attn.k_proj.weight": (d.c.num_kv_heads * d.c.head_dim, H),
        "self_attn.v_proj.weight": (d.c.num_kv_heads * d.c.head_dim, H),
        "self_attn.o_proj.weight": (H, d.c.num_heads * d.c.head_dim),
        "self_attn.q_norm.weight": (d.c.head_dim,),
        "self_attn.k_norm.weight": (d.c.head_dim,),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (d.c.intermediate_size, H),
        "mlp.up_proj.weight": (d.c.intermediate_size, H),
        "mlp.down_proj.weight": (H, d.c.intermediate_size),
    }
    want = {
        "fc.weight": (H, 3 * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "markov_head.markov_w1.weight": (V, 16),
        "markov_head.markov_w2.weight": (D, 16),
        "confidence_head.proj.weight": (1, H + 16),
        "confidence_head.proj.bias": (1,),
        "lm_head.weight": (D, H),
        "d2t": (D,),
        "t2d": (V,),
        **{f"layers.{i}.{k}": s for i in range(2) for k, s in per_layer.items()},
    }
    assert {k: tuple(v.shape) for k, v in w.items()} == want
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    # target id = draft id + d2t[draft id]; t2d marks exactly the draft vocabulary
    assert torch.equal(torch.arange(D) + w["d2t"], ids)
    assert torch.equal(w["t2d"].nonzero().squeeze(1), ids)
    assert torch.equal(w["lm_head.weight"], lm_head[ids].to(torch.bfloat16))
    assert torch.equal(w["layers.1.mlp.down_proj.weight"], d.backbone.layers[1].down.weight.to(torch.bfloat16))


def test_full_vocabulary_leaves_lm_head_to_the_verifier(tgt):
    d = untrained_drafter(tgt, "dflash", gamma=4)
    w = export.state_dict(d)
    assert not {"lm_head.weight", "d2t", "t2d"} & set(w) and not any(k.startswith("markov") for k in w)


def test_config_states_the_block_semantics(tgt):
    d = untrained_drafter(tgt, "dspark", gamma=6, markov_rank=16, draft_ids=torch.arange(100, 612))
    c = export.config(d, tgt.model.config, "/models/target")
    assert c["speculators_model_type"] == "dspark" and c["architectures"] == ["DSparkDraftModel"]
    # slot 0 is the anchor token and predicts the next one: gamma drafts from a block of gamma
    assert c["block_size"] == 6 and c["sample_from_anchor"] is True
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
    assert c["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert c["aux_hidden_state_layer_ids"] == [2, 3, 4]  # taps [1, 2, 3]
    assert c["mask_token_id"] == tgt.mask_token_id and c["draft_vocab_size"] == 512
    assert c["markov_rank"] == 16 and c["markov_head_type"] == "vanilla"
    assert c["transformer_layer_config"]["num_hidden_layers"] == 1
    assert c["transformer_layer_config"]["vocab_size"] == tgt.model.config.vocab_size


def test_a_fill_in_dflash_is_vllms_dflash_block(tgt):
    """Trained with the fill-in block, a DFlash drafter is speculators' default DFlash: block_size
    gamma + 1, the anchor a bonus token, gamma drafts; attention inside the block both ways."""
    d = untrained_drafter(tgt, "dflash", gamma=5, sample_from_anchor=False)
    c = export.config(d, tgt.model.config, "/models/target")
    assert c["block_size"] == 6 and c["sample_from_anchor"] is False
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert c["sliding_window_non_causal"] is True  # vLLM: causal = not sliding_window_non_causal
    with pytest.raises(UserError, match="fill-in block"):
        deepspec.state_dict(d)


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_deepspec_layout_keeps_every_markov_head_under_deepspecs_names(tgt, markov):
    d = untrained_drafter(tgt, "dspark", gamma=6, markov=markov, markov_rank=16)
    w = deepspec.state_dict(d, torch.float32)
    H, V, r = d.c.hidden_size, d.c.vocab_size, 16
    assert tuple(w["embed_tokens.weight"].shape) == (V, H) and tuple(w["lm_head.weight"].shape) == (V, H)
    assert tuple(w["markov_head.markov_w1.weight"].shape) == (V, r)
    assert tuple(w["markov_head.markov_w2.weight"].shape) == (V, r)
    extra = {"vanilla": {}, "gated": {"gate_proj": (r, H + r)}, "rnn": {"joint_proj": (3 * r, 2 * r + H)}}[markov]
    assert {k.split(".")[1] for k in w if k.startswith("markov_head.")} == {"markov_w1", "markov_w2", *extra}
    for name, shape in extra.items():
        assert tuple(w[f"markov_head.{name}.weight"].shape) == shape and f"markov_head.{name}.bias" in w
    assert tuple(w["confidence_head.proj.weight"].shape) == (1, H + r)
    assert torch.equal(w["layers.0.self_attn.k_norm.weight"], d.backbone.layers[0].k_norm.weight)
    c = deepspec.config(d, tgt.model.config, "/models/target")
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["markov_head_type"] == markov
    # DeepSpec reads hidden_states[i + 1] for target_layer_id i: our 0-based taps as they are
    assert c["target_layer_ids"] == [1, 2, 3] and c["num_target_layers"] == tgt.model.config.num_hidden_layers
    assert c["block_size"] == 6 and c["markov_rank"] == 16 and c["mask_token_id"] == tgt.mask_token_id
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True


def test_deepspec_layout_of_dflash_eagle3_and_a_draft_vocabulary(tgt):
    ids = torch.arange(0, 4096, 8)
    d = untrained_drafter(tgt, "dflash", gamma=4, draft_ids=ids)
    w, c = deepspec.state_dict(d), deepspec.config(d, tgt.model.config, "t")
    assert c["markov_rank"] == 0 and c["enable_confidence_head"] is False and "markov_head_type" not in c
    assert c["draft_vocab_size"] == len(ids) and torch.equal(torch.arange(len(ids)) + w["d2t"], ids)
    assert tuple(w["lm_head.weight"].shape) == (len(ids), d.c.hidden_size)
    e = untrained_drafter(tgt, "eagle3", gamma=4)
    w, c = deepspec.state_dict(e), deepspec.config(e, tgt.model.config, "t")
    assert c["architectures"] == ["Qwen3Eagle3Model"] and c["ttt_length"] == 4 and c["num_hidden_layers"] == 1
    assert {"layers.0.hidden_norm.weight", "fc.weight", "norm.weight", "embed_tokens.weight"} <= set(w)


@pytest.mark.parametrize("markov", ["gated", "rnn"])
def test_markov_heads_vllm_does_not_build_are_refused_by_name(tgt, markov):
    d = untrained_drafter(tgt, "dspark", gamma=4, markov=markov)
    with pytest.raises(UserError, match=f"the '{markov}' Markov head"):
        export.state_dict(d)


def test_eagle3_is_the_standard_layer_with_its_own_embedding_and_head(tgt):
    d = untrained_drafter(tgt, "eagle3", gamma=4)
    w = export.state_dict(d)
    H, V = d.c.hidden_size, d.c.vocab_size
    assert tuple(w["fc.weight"].shape) == (H, 3 * H)
    assert tuple(w["layers.0.self_attn.q_proj.weight"].shape) == (d.c.num_heads * d.c.head_dim, 2 * H)
    assert {"layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"} <= set(w)
    assert tuple(w["embed_tokens.weight"].shape) == (V, H) and tuple(w["lm_head.weight"].shape) == (V, H)
    c = export.config(d, tgt.model.config, "/models/target")
    assert c["speculators_model_type"] == "eagle3" and c["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert c["norm_before_residual"] is False and c["transformer_layer_config"]["num_hidden_layers"] == 1


def test_the_job_writes_an_export_and_its_reference_block(tgt, tmp_path):
    d = untrained_drafter(tgt, "dspark", gamma=4, markov_rank=16, draft_ids=torch.arange(0, 4096, 4))
    save_drafter(d, tmp_path / "drafter")
    job = Path(__file__).resolve().parents[2] / "jobs" / "export.py"
    args = ["--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"), "--reference"]
    out = subprocess.run([sys.executable, str(job), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "aux hidden-state ids [2, 3, 4]" in out.stdout
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == tgt.path
    ref = load_file(str(tmp_path / "out" / "reference.safetensors"))
    T = ref["input_ids"].shape[1]
    assert ref["aux"].shape == (1, T, 3 * d.c.hidden_size)
    assert ref["logits"].shape == (4, 1024) and ref["confidence_logit"].shape == (4,)
    # the reference is the drafter's own block: its logits are what DSpark drafts from at that anchor
    p = int(ref["anchor"])
    assert 0 < p <= T - 4
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert w["markov_head.markov_w2.weight"].dtype == torch.bfloat16
