"""Measured quality of a target: held-out perplexity and top-1 accuracy, a unigram baseline, and
greedy samples."""

from __future__ import annotations

import math

import numpy as np
import torch

from dspark.corpus.tokenizer import encode_example, encode_prompt


def example_ids(tokenizer, examples, max_len: int) -> list[list[int]]:
    return [encode_example(tokenizer, ex.prompt, ex.response)[0][:max_len] for ex in examples]


@torch.no_grad()
def lm_quality(model, seqs: list[list[int]], pad_id: int, batch_size: int = 8) -> dict:
    """Perplexity and top-1 next-token accuracy over every predicted token of `seqs`."""
    nll, correct, count = 0.0, 0, 0
    device = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths pad less
    for i in range(0, len(order), batch_size):
        batch = [seqs[j] for j in order[i : i + batch_size]]
        width = max(len(s) for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # (B, T-1, V)
        labels, valid = ids[:, 1:], mask[:, 1:].bool()
        logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
        nll -= logp[valid].sum().item()
        correct += (logits.argmax(-1) == labels)[valid].sum().item()
        count += valid.sum().item()
    return {"ppl": math.exp(nll / max(count, 1)), "top1": correct / max(count, 1), "tokens": count}


def unigram_baseline(train_counts: np.ndarray, seqs: list[list[int]]) -> dict:
    """A model that ignores context: add-one smoothed train frequencies."""
    probs = (train_counts + 1.0) / (train_counts.sum() + len(train_counts))
    labels = np.concatenate([np.asarray(s[1:]) for s in seqs if len(s) > 1])
    return {
        "ppl": float(np.exp(-np.log(probs[labels]).mean())),
        "top1": float((labels == int(np.argmax(train_counts))).mean()),
        "tokens": int(labels.size),
    }


@torch.no_grad()
def greedy_continuations(model, tokenizer, prompts: list[str], max_new_tokens: int = 64) -> list[str]:
    out = []
    device = next(model.parameters()).device
    for prompt in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=device)
        gen = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        out.append(tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out
