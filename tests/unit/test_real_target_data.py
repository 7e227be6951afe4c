"""Target-generic data paths: the configured mask token reaches drafters, a bfloat16 target's drafter
trains in float32, the built-in target renders exactly its historical format, and the evaluation runs
on named prompt sets from files (multi-turn ones measured turn by turn), and no committed training
prompt is an evaluated one."""

import json
from pathlib import Path

import pytest
import torch

from dspark import evaluation
from dspark import target as targets
from dspark.config import load_config
from dspark.corpus.tokenizer import chat_ids, encode_prompt
from dspark.errors import UserError
from dspark.models import DrafterConfig, build_drafter
from dspark.train.worker import mask_id


def test_builtin_target_renders_its_historical_prompt_format():
    tok = targets.tokenizer_for("builtin")
    for prompt in ("def add(a, b):\n", "A paragraph.\n\n"):
        assert chat_ids(tok, prompt) == encode_prompt(tok, prompt)


def test_configured_mask_token_reaches_the_drafter_config():
    cfg = load_config(overrides=["target.mask_token=100"])
    assert mask_id(cfg) == 100
    assert mask_id(load_config()) == targets.tokenizer_for("builtin").mask_token_id != 100


def test_evaluation_on_named_prompt_sets_measures_every_turn(tmp_path):
    sets = {
        "chat": [{"turns": ["Say hi.", "Again."]}, {"prompt": "One more."}],
        "code": [{"messages": [{"role": "user", "content": "def f(x):\n"}]}],
    }
    for name, records in sets.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    cfg = load_config(
        overrides=[
            "eval.gamma=2",
            "eval.temperatures=[0.0]",
            "eval.max_new_tokens=4",
            f"eval.prompt_sets={{chat: {tmp_path / 'chat.jsonl'}, code: {tmp_path / 'code.jsonl'}}}",
        ]
    )
    tgt = targets.load("builtin")
    prompts = evaluation.eval_prompts(cfg, tgt, None)
    assert {k: len(v) for k, v in prompts.items()} == {"chat": 3, "code": 1}  # two turns + one prompt; one prompt
    assert prompts["chat"][2] == chat_ids(tgt.tokenizer, "One more.")
    assert prompts["chat"][1][: len(prompts["chat"][0])] == prompts["chat"][0]  # turn 2 follows turn 1 and its answer
    torch.manual_seed(0)
    dc = DrafterConfig.from_target(tgt.config, "dflash", [1, 2, 3], tgt.mask_token_id, num_layers=1, gamma=2)
    res = evaluation.evaluate(
        cfg, tgt, {"d": build_drafter(dc, tgt.model).eval()}, None, tmp_path / "out", calibrate=False
    )
    rows = {(r.drafter, r.domain): r for r in res["results"]}
    assert set(rows) == {("target", "chat"), ("d", "chat"), ("target", "code"), ("d", "code")}
    assert rows[("d", "chat")].prompts == 3 and rows[("target", "code")].speedup == 1.0
    assert "| d | chat | 0 | 2 |" in (tmp_path / "out" / "results.md").read_text()


def test_evaluation_skips_turns_that_leave_no_room_for_the_answer(tmp_path):
    """A turn whose prompt leaves fewer than eval.max_new_tokens positions of the target's context ends its
    conversation there (logged), as a cache build ends it; a set with nothing left is a clear error."""
    tgt = targets.load("builtin")
    context = tgt.model.config.max_position_embeddings

    def words(k: int) -> str:
        return " ".join(f"w{i % 97}" for i in range(k))

    k = next(k for k in range(context, 0, -8) if len(chat_ids(tgt.tokenizer, words(k))) <= context - 40)
    n, hi = len(chat_ids(tgt.tokenizer, words(k))), len(chat_ids(tgt.tokenizer, "Say hi."))
    long = words(2 * context)  # longer than the context
    records = [{"turns": ["Say hi.", long, "Again."]}, {"prompt": words(k)}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": long}) + "\n")

    def prompts(name: str, max_new: int):
        sets = f"eval.prompt_sets={{{name}: {tmp_path}/{name}.jsonl}}"
        logged = []
        cfg = load_config(overrides=[f"eval.max_new_tokens={max_new}", sets])
        return [len(p) for p in evaluation.eval_prompts(cfg, tgt, None, logged.append)[name]], logged

    # the edge: the prompt of n tokens is kept with exactly context - n positions left for its answer
    assert prompts("chat", context - n) == (
        [hi, n],
        [
            f"[eval] eval.prompt_sets chat: 2 of 4 user turns skipped: their prompts leave no room for "
            f"eval.max_new_tokens={context - n} in the target's {context}-token context"
        ],
    )
    assert prompts("chat", context - n + 1)[0] == [hi]  # one position short: skipped
    with pytest.raises(UserError, match="eval.prompt_sets long: no user turn of .*long.jsonl leaves room"):
        prompts("long", 8)


def test_no_evaluated_prompt_is_a_training_prompt():
    prompts = Path(__file__).resolve().parents[2] / "data" / "prompts"

    def turns(split: str) -> set[str]:
        return {
            t
            for f in (prompts / split).glob("*.jsonl")
            for ln in f.read_text().split("\n")
            if ln.strip()
            for t in json.loads(ln)["turns"]
        }

    train, evaluated = turns("train"), turns("eval")
    assert len(train) > 1000 and len(evaluated) > 80
    assert not train & evaluated


def test_drafter_of_a_bfloat16_target_trains_in_float32():
    """target.dtype=bfloat16 (the SmolLM2 config) runs the target in bf16; the drafter and its frozen
    copy of the target's head stay float32 for training, so every kind's loss backpropagates."""

    from dspark.train.loss import LossWeights, drafter_loss
    from dspark.train.worker import drafter_for

    t = 24
    batch = {
        "input_ids": torch.randint(0, 4000, (2, t)),
        "loss_mask": torch.ones(2, t, dtype=torch.bool),
        "valid": torch.ones(2, t, dtype=torch.bool),
        "features": torch.randn(2, t, 3, 256),
        "last_hidden": torch.randn(2, t, 256),
    }
    for kind in ("dspark", "dflash", "eagle3"):
        cfg = load_config(
            overrides=[
                "target.dtype=bfloat16",
                f"train.drafter={kind}",
                "train.num_layers=1",
                "train.gamma=3",
                "train.markov_rank=8",
            ]
        )
        drafter = drafter_for(cfg, [1, 2, 3], {"name": "builtin"}, "cpu")
        assert all(p.dtype == torch.float32 for p in drafter.parameters())
        loss, _, _ = drafter_loss(
            drafter, batch, 3, 4, LossWeights.from_config(cfg.train), torch.Generator().manual_seed(0)
        )
        loss.backward()
