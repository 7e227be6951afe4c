"""Training the small built-in target: a transformers Qwen3ForCausalLM on the built-in corpora.

The run is resumable (model, optimizer, step, data position, RNG and elapsed time are checkpointed
atomically), so a longer budget can be spent across several sittings. The learning-rate schedule is
linear warmup then cosine over the budget: steps if `max_steps` is set, else wall-clock minutes.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.config import Config, TargetTrainConfig
from dspark.corpus.examples import split_examples
from dspark.corpus.sources import DOMAINS, Corpus
from dspark.corpus.tokenizer import load_tokenizer, to_hf, train_tokenizer
from dspark.target import quality
from dspark.tracking import Tracker, system_info
from dspark.tracking import run as tracking_run

CARD = "target_card.json"


def qwen3_config(tc: TargetTrainConfig, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_layers,
        num_attention_heads=tc.num_heads,
        num_key_value_heads=tc.num_kv_heads,
        head_dim=tc.hidden_size // tc.num_heads,
        max_position_embeddings=tc.max_position_embeddings,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


class TokenStream:
    """All training examples, tokenized once; each epoch shuffles them, concatenates, and cuts
    rows of seq_len+1 tokens. A data position is (epoch, row)."""

    def __init__(self, seqs: list[np.ndarray], seq_len: int, seed: int):
        self.seqs, self.seq_len, self.seed = seqs, seq_len, seed
        self.tokens = int(sum(len(s) for s in seqs))
        self._epoch, self._rows = -1, None

    def rows(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.seqs))
            flat = np.concatenate([self.seqs[i] for i in order])
            n = len(flat) // (self.seq_len + 1)
            self._rows, self._epoch = flat[: n * (self.seq_len + 1)].reshape(n, self.seq_len + 1), epoch
        return self._rows

    def counts(self, vocab: int) -> np.ndarray:
        return np.bincount(np.concatenate(self.seqs), minlength=vocab)


def lr_at(tc: TargetTrainConfig, step: int, elapsed_s: float) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = step / tc.max_steps if tc.max_steps else elapsed_s / (tc.minutes * 60)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cosine)


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def prepare_tokenizer(cfg: Config, corpus: Corpus, out: Path):
    if (out / "tokenizer.json").is_file():  # resuming: the vocabulary must not change
        return load_tokenizer(out)
    texts = [d.text for domain in DOMAINS for d in corpus.split(domain, "train")]
    hf = to_hf(train_tokenizer(texts, cfg.target_train.vocab_size))
    hf.save_pretrained(str(out))
    return load_tokenizer(out)


def train_target(cfg: Config, log=print) -> dict:
    from transformers import Qwen3ForCausalLM

    tc = cfg.target_train
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    out = Path(tc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"

    corpus = Corpus.load(cfg.corpus)
    manifest = corpus.manifest()
    tok = prepare_tokenizer(cfg, corpus, out)
    train_ex = [ex for d in DOMAINS for ex in split_examples(corpus, d, "train", cfg.corpus)]
    full = tok([ex.prompt for ex in train_ex], add_special_tokens=False)["input_ids"]
    resp = tok([ex.response for ex in train_ex], add_special_tokens=False)["input_ids"]
    seqs = [
        np.asarray(
            [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>")]
            + p
            + [tok.convert_tokens_to_ids("<|assistant|>")]
            + r
            + [tok.eos_token_id],
            dtype=np.int64,
        )
        for p, r in zip(full, resp)
    ]
    stream = TokenStream(seqs, tc.seq_len, tc.seed)
    log(f"corpus {manifest['sha256'][:12]}: {len(train_ex)} train examples, {stream.tokens:,} tokens/epoch")

    model = Qwen3ForCausalLM(qwen3_config(tc, tok))
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    state = {"step": 0, "epoch": 0, "row": 0, "elapsed_s": 0.0, "tokens": 0, "run_id": None}
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        torch.set_rng_state(ck["torch_rng"])
        log(
            f"resumed from {ckpt_path} at step {state['step']} ({state['tokens']:,} tokens, "
            f"{state['elapsed_s'] / 60:.1f} min)"
        )
    n_params = sum(p.numel() for p in model.parameters())
    log(f"Qwen3ForCausalLM {tc.num_layers}L d={tc.hidden_size}: {n_params / 1e6:.2f} M parameters")

    def checkpoint():
        _save_atomic(
            {"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "torch_rng": torch.get_rng_state()},
            ckpt_path,
        )

    with tracking_run(cfg, "train-target", run_id=state["run_id"]) as tracker:
        if state["run_id"] is None:
            state["run_id"] = tracker.run_id
            tracker.params(
                {
                    **{k: v for k, v in cfg.flat().items() if k.startswith(("target_train.", "corpus."))},
                    "corpus_sha256": manifest["sha256"],
                    "params": n_params,
                    **system_info(),
                }
            )
        _train_loop(model, opt, stream, tc, state, tracker, checkpoint, log)
        checkpoint()
        card = _finish(cfg, model, tok, corpus, stream, state, manifest, n_params, out, log)
        tracker.metrics({f"final.{k}": v for k, v in _flat_quality(card).items()}, state["step"])
        tracker.artifact(out / CARD)
    return card


def _train_loop(
    model, opt, stream: TokenStream, tc: TargetTrainConfig, state: dict, tracker: Tracker, checkpoint, log
) -> None:
    model.train()
    budget_s = tc.minutes * 60
    last_ckpt = time.monotonic()
    bar = tqdm(total=tc.max_steps or None, initial=state["step"], unit="step", mininterval=10, desc="target")
    while (state["step"] < tc.max_steps) if tc.max_steps else (state["elapsed_s"] < budget_s):
        t0 = time.perf_counter()
        rows = stream.rows(state["epoch"])
        if state["row"] + tc.batch_size > len(rows):
            state["epoch"], state["row"] = state["epoch"] + 1, 0
            continue
        batch = torch.from_numpy(rows[state["row"] : state["row"] + tc.batch_size])  # (B, T+1)
        lr = lr_at(tc, state["step"], state["elapsed_s"])
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        dt = time.perf_counter() - t0
        state["step"] += 1
        state["row"] += tc.batch_size
        state["tokens"] += batch[:, 1:].numel()
        state["elapsed_s"] += dt
        tok_s = batch[:, 1:].numel() / dt
        if state["step"] % 10 == 0:
            tracker.metrics(
                {
                    "loss": loss.item(),
                    "lr": lr,
                    "grad_norm": gnorm.item(),
                    "tokens_per_s": tok_s,
                    "tokens": state["tokens"],
                    "epoch": state["epoch"],
                },
                state["step"],
            )
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:.0f}", min=f"{state['elapsed_s'] / 60:.1f}")
        bar.update(1)
        if time.monotonic() - last_ckpt > tc.checkpoint_every_s:
            checkpoint()
            last_ckpt = time.monotonic()
    bar.close()
    model.eval()


def _flat_quality(card: dict) -> dict:
    return {f"{d}.{k}": v for d, q in card["heldout"].items() for k, v in q.items() if isinstance(v, float)}


def _finish(cfg: Config, model, tok, corpus, stream, state, manifest, n_params, out: Path, log) -> dict:
    """Save HF format, measure held-out quality per domain against a unigram baseline, write the card."""
    tc = cfg.target_train
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    counts = stream.counts(len(tok))
    heldout = {}
    for domain in DOMAINS:
        exs = split_examples(corpus, domain, "heldout", cfg.corpus)[: tc.eval_examples]
        seqs = quality.example_ids(tok, exs, tc.seq_len)
        heldout[domain] = {
            "model": quality.lm_quality(model, seqs, tok.pad_token_id),
            "unigram": quality.unigram_baseline(counts, seqs),
            "examples": len(exs),
        }
    prompts = [ex.prompt for ex in split_examples(corpus, "code", "heldout", cfg.corpus)[:2]]
    samples = [{"prompt": p, "greedy": c} for p, c in zip(prompts, quality.greedy_continuations(model, tok, prompts))]
    card = {
        "architecture": "Qwen3ForCausalLM",
        "parameters": n_params,
        "recipe": tc.model_dump(),
        "corpus": manifest,
        "training": {
            "steps": state["step"],
            "tokens": state["tokens"],
            "epochs": state["tokens"] / stream.tokens,
            "wall_minutes": state["elapsed_s"] / 60,
            "threads": tc.threads,
        },
        "heldout": {
            d: {
                "ppl": h["model"]["ppl"],
                "top1": h["model"]["top1"],
                "tokens": h["model"]["tokens"],
                "unigram_ppl": h["unigram"]["ppl"],
                "unigram_top1": h["unigram"]["top1"],
            }
            for d, h in heldout.items()
        },
        "greedy_samples": samples,
    }
    (out / CARD).write_text(json.dumps(card, indent=2) + "\n")
    for d, h in card["heldout"].items():
        log(
            f"held-out {d}: ppl {h['ppl']:.1f} (unigram {h['unigram_ppl']:.1f}), "
            f"top-1 {h['top1']:.1%} (unigram {h['unigram_top1']:.1%}) over {h['tokens']:,} tokens"
        )
    return card
