"""The user's own data: JSONL prompts and conversations in every supported format, multi-turn, bad
lines named by file and line or skipped with a count, the cache's source list, and the paper's
protocol of regenerating each assistant turn with the target's own chat template (the built-in
tokenizer with pad == EOS, and SmolLM2's real tokenizer: ChatML, its default system prompt)."""

import json
from unittest.mock import patch

import pytest
import torch

from dspark import target as targets
from dspark.cache.build import cut_response, regenerate, turn_rows
from dspark.config import load_config
from dspark.corpus.conversations import Conversation, cache_sources, load_jsonl, parse_jsonl, spread
from dspark.corpus.tokenizer import EOS, chat_ids
from dspark.errors import UserError
from dspark.storage import Storage

RECORDS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "dropped"},
            {"role": "user", "content": [{"type": "text", "text": "b"}]},
            {"role": "user", "content": "b2"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "c"},
            {"from": "gpt", "value": "dropped"},
            {"from": "human", "value": "d"},
        ]
    },
    {"turns": ["e", "f", "g"]},
    {"prompt": "h", "answer": "ignored"},
]


def jsonl(records) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n"


def test_every_format_multi_turn():
    convs, skipped = parse_jsonl(jsonl(RECORDS[:2]) + "\n" + jsonl(RECORDS[2:]), "set.jsonl", "set")
    assert skipped == []
    assert [(c.conv_id, c.turns, c.system) for c in convs] == [
        ("set:1", ("a", "b\n\nb2"), "be brief"),  # consecutive user messages are one turn
        ("set:2", ("c", "d"), ""),
        ("set:4", ("e", "f", "g"), ""),
        ("set:5", ("h",), ""),
    ]  # line 3 is blank
    assert convs[0].messages([]) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
    assert (
        convs[2].messages(["E", "F"])[-3:]
        == [
            {"role": "assistant", "content": "E"},
            {"role": "user", "content": "f"},
            {"role": "assistant", "content": "F"},
            {"role": "user", "content": "g"},
        ][1:]
    )
    assert Conversation.from_json(convs[0].to_json()) == convs[0]


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "Expecting property name"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "x"}', "no 'messages', 'conversations', 'turns' or 'prompt' key"),
        ('{"prompt": ""}', "prompt is not a non-empty string"),
        ('{"turns": "x"}', "turns must be a list"),
        ('{"turns": []}', "no user turn"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}',
            "system message must come first",
        ),
        ('{"messages": [{"role": "tool", "content": "a"}]}', "message 0: role must be one of"),
        ('{"conversations": [{"from": "gpt", "value": "only an answer"}]}', "no user turn"),
    ],
)
def test_bad_line_is_named_by_file_and_line_or_skipped_with_a_count(line, why):
    text = jsonl([RECORDS[3], line, RECORDS[2]])
    with pytest.raises(UserError, match=rf"data/x.jsonl:2: bad record: .*{why}"):
        parse_jsonl(text, "data/x.jsonl", "x")
    convs, skipped = parse_jsonl(text, "data/x.jsonl", "x", skip_bad=True)
    assert [c.conv_id for c in convs] == ["x:1", "x:3"] and len(skipped) == 1 and skipped[0].startswith("line 2:")


def test_unicode_line_separators_stay_inside_strings(tmp_path):
    f = tmp_path / "u.jsonl"
    f.write_text(json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n")
    assert load_jsonl(str(f), Storage()).conversations[0].turns == ("a\u2028b",)


def test_missing_or_empty_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="prompt file .*nowhere.jsonl could not be read"):
        load_jsonl(str(tmp_path / "nowhere.jsonl"), Storage())
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="empty.jsonl holds no usable record"):
        load_jsonl(str(tmp_path / "empty.jsonl"), Storage())


def test_cache_sources_mix_builtin_and_files_capped_per_source(tmp_path):
    (tmp_path / "chat.jsonl").write_text(jsonl(RECORDS * 3))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl([RECORDS[3], "{oops"]))
    cfg = load_config(overrides=[f"cache.sources=[builtin, {tmp_path / 'chat.jsonl'}, {bad}]", "cache.max_examples=4"])
    with pytest.raises(UserError, match="bad.jsonl:2: bad record"):
        cache_sources(cfg, Storage())
    cfg.cache.skip_bad_records = True
    logs = []
    convs, sha = cache_sources(cfg, Storage(), logs.append)
    assert [c.source for c in convs] == ["code", "prose", "code", "prose", "chat", "chat", "chat", "chat", "bad"]
    assert [c.conv_id for c in convs[4:]] == ["chat:1", "chat:4", "chat:7", "chat:10", "bad:1"]  # spread over the file
    assert logs == [
        f"[cache] {bad}: skipped 1 bad records (line 2: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))"
    ]
    bad.write_text(jsonl([RECORDS[3], RECORDS[2]]))
    assert cache_sources(cfg, Storage(), logs.append)[1] != sha  # the data's identity is in the hash
    assert spread(list(range(10)), 3) == [0, 3, 6] and spread([1, 2], 0) == [1, 2]


class Scripted(torch.nn.Module):
    """A stand-in for an HF causal LM whose generate() answers with scripted tokens, padded with
    `pad` after its first EOS the way HF pads finished rows."""

    def __init__(self, answers, pad):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.answers, self.pad, self.prompts, self.max_new_tokens = list(answers), pad, [], []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        self.max_new_tokens.append(max_new_tokens)
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            self.prompts.append([t for t, m in zip(ids, mask) if m])
            rows.append(ids + self.answers.pop(0))
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])


def test_regenerated_turns_follow_the_targets_answers_and_keep_their_eos():
    """pad == EOS (SmolLM2's tokenizer): each answer ends at its first EOS and keeps it; turn 2 is
    rendered with the target's chat template after the target's own answer to turn 1."""
    tok = targets.tokenizer_for("builtin", pad_token=EOS)
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos
    a, b, c = tok.encode("x = 1", add_special_tokens=False), tok.encode("y", add_special_tokens=False), [7, 8, 9]
    model = Scripted([a + [eos], b + [eos, eos], c], pad=eos)  # conv 1 turn 1, conv 2 turn 1, conv 1 turn 2
    convs = [Conversation("s:1", "s", ("first", "second")), Conversation("s:2", "s", ("other",))]
    cfg = load_config(overrides=["cache.batch_size=2"])
    turns = regenerate(model, tok, convs, cfg.cache, 0, (eos,))
    assert [r for ts in turns for _, r in ts] == [
        a + [eos],
        c,
        b + [eos],
    ]  # cut after the first EOS; c hit the length limit
    assert turns[0][1][0] == chat_ids(
        tok,
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "x = 1"},
            {"role": "user", "content": "second"},
        ],
    )
    assert model.prompts == [p for ts in (turns[0][:1], turns[1], turns[0][1:]) for p, _ in ts]
    seq_ids, domains, seqs, n_prompt = turn_rows(convs, turns)
    assert seq_ids == ["s:1", "s:1/turn2", "s:2"] and domains == ["s"] * 3
    assert [s[n:] for s, n in zip(seqs, n_prompt)] == [a + [eos], c, b + [eos]]
    assert cut_response([5, eos, eos], (9, eos)) == [5, eos] and cut_response([5, 6], (eos,)) == [5, 6]


def test_last_turn_can_be_rendered_without_an_answer():
    tok = targets.tokenizer_for("builtin")
    model = Scripted([[5, tok.eos_token_id]], pad=tok.pad_token_id)
    turns = regenerate(model, tok, [Conversation("s:1", "s", ("q1", "q2"))], load_config().cache, 0, answer_last=False)
    assert [r for _, r in turns[0]] == [[5, tok.eos_token_id], []] and model.answers == []


def test_a_conversation_ends_before_a_turn_too_long_for_the_targets_context():
    """With max_len (the target's context), a turn whose prompt leaves no room for an answer is not asked,
    nor any turn after it: the conversation keeps the turns before (none if its first turn is that long)."""
    tok = targets.tokenizer_for("builtin")
    long = " ".join(["word"] * 60)
    convs = [
        Conversation("s:1", "s", ("first", long, "third")),  # ends after its first turn
        Conversation("s:2", "s", (long,)),  # no turn fits
        Conversation("s:3", "s", ("short", "again")),
    ]
    fits = len(chat_ids(tok, [{"role": "user", "content": "short"}]))
    assert len(chat_ids(tok, [{"role": "user", "content": long}])) > 40 > fits + 10
    model = Scripted([[5, tok.eos_token_id], [6, tok.eos_token_id], [7]], pad=tok.pad_token_id)
    cc = load_config().cache
    turns = regenerate(model, tok, convs, cc, 0, max_len=40)
    assert [[r for _, r in ts] for ts in turns] == [[[5, tok.eos_token_id]], [], [[6, tok.eos_token_id], [7]]]
    assert model.answers == [] and all(len(p) < 40 for p in model.prompts)
    assert turn_rows(convs, turns)[0] == ["s:1", "s:3", "s:3/turn2"]
    # each batch's answers stop where its longest prompt meets the context (HF generation would go on)
    widths = [max(len(model.prompts[0]), len(model.prompts[1])), len(model.prompts[2])]
    assert model.max_new_tokens == [min(cc.max_new_tokens, 40 - w) for w in widths]
    # the edge: a prompt of exactly max_len tokens leaves no room, one token less leaves one
    for room, answered in ((0, []), (1, [[8]])):
        model = Scripted([[8]], pad=tok.pad_token_id)
        turns = regenerate(model, tok, [Conversation("s:4", "s", ("short",))], cc, 0, max_len=fits + room)
        assert [r for _, r in turns[0]] == answered and model.max_new_tokens == ([1] if room else [])
    # room=k (evaluation: an answer of k tokens must fit): kept iff prompt + k <= max_len, and the answer is
    # still capped by the context alone
    for extra, answered in ((4, []), (5, [[8]])):
        model = Scripted([[8]], pad=tok.pad_token_id)
        conv = [Conversation("s:5", "s", ("short",))]
        turns = regenerate(model, tok, conv, cc, 0, max_len=fits + extra, room=5)
        assert [r for _, r in turns[0]] == answered and model.max_new_tokens == ([5] if answered else [])


def test_smollm2_cache_rows_use_its_chat_template_and_keep_eos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token_id == end == 2 and tok.eos_token_id == end
    four = tok.encode("4", add_special_tokens=False)
    model = Scripted([four + [end, end], tok.encode("6", add_special_tokens=False) + [end]], pad=end)
    conv = Conversation("mt:1", "mt", ("What is 2+2?", "And 3+3?"))
    turns = regenerate(model, tok, [conv], load_config().cache, 0, (end,))
    seq_ids, _, seqs, n_prompt = turn_rows([conv], turns)
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    first = system + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert seq_ids == ["mt:1", "mt:1/turn2"]
    assert tok.decode(seqs[0][: n_prompt[0]]) == first
    assert tok.decode(seqs[0][n_prompt[0] :]) == "4<|im_end|>"  # the answer keeps its EOS although pad == EOS
    assert (
        tok.decode(seqs[1][: n_prompt[1]])
        == first + "4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert seqs[1][n_prompt[1] :] == tok.encode("6", add_special_tokens=False) + [end]


def test_the_runners_answers_are_hf_generations_at_t0_and_do_not_depend_on_the_batch():
    """A target the decoding runner runs answers there: greedily, token for token what HF generation
    answers (multi-turn, each answer ending at its first EOS); sampled, each answer is drawn with its own
    generator, so the same conversations give the same answers at any batch size."""
    tgt = targets.load("builtin")
    convs = [Conversation(f"s:{i}", "s", ("def add(a, b):", "and sub?")[: 1 + i % 2]) for i in range(5)]
    greedy = load_config(overrides=["cache.temperature=0", "cache.max_new_tokens=40", "cache.batch_size=3"]).cache
    with patch("dspark.cache.build.hf_generate") as hf:  # the runner's path only
        runner = regenerate(tgt.model, tgt.tokenizer, convs, greedy, 0, tgt.eos_token_ids)
    hf.assert_not_called()
    # the HF side of the comparison, forced: a model the runner does not run takes it
    with patch("dspark.cache.build.family", side_effect=UserError("unsupported")):
        hf_generations = regenerate(tgt.model, tgt.tokenizer, convs, greedy, 0, tgt.eos_token_ids)
    assert runner == hf_generations
    assert any(r[-1] in tgt.eos_token_ids for ts in runner for _, r in ts)  # some answers ended at their EOS
    counted = []
    sampled = [
        regenerate(
            tgt.model,
            tgt.tokenizer,
            convs,
            load_config(overrides=["cache.max_new_tokens=24", f"cache.batch_size={b}"]).cache,
            7,
            tgt.eos_token_ids,
            progress=counted.append,
        )
        for b in (1, 4)
    ]
    assert sampled[0] == sampled[1] and sum(counted) == 2 * sum(len(c.turns) for c in convs)
