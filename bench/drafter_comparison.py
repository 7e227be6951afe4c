"""Equal-budget drafter comparison on the configured target (the built-in reference target by default;
the drafters issue's experiment).

Every variant trains for the same number of optimizer steps on the same cache (built for that
target), in the same data order and with the same anchors (single-process loop,
`dspark.train.loop.fit`), then all are evaluated together on held-out prompts (`dspark.evaluation`,
with the eval.* settings).

    python bench/drafter_comparison.py --cache s3://dspark/main/caches/bf16 --steps 600 \\
        --variants eagle3,dflash,dspark,dspark_rnn --out results/comparison
    python bench/drafter_comparison.py --config configs/smollm2.yaml --cache CACHE --steps 100 \\
        --variants dflash,dspark --out results/comparison-smollm2

Learning curves (`--curve-every N`): a fraction of the cache's rows (`--heldout`, chosen by a hash of
seq_id) is never trained on; every N steps each variant's held-out expected tau (teacher-forced,
T=1: 1 + Σ_k Π_{i<=k} (1 - TV_i), the training loss's own acceptance estimate; beside it the log
prints its T=0 counterpart, greedy tau, from argmax agreement) is recorded against
the response tokens trained on and the training seconds (held-out passes excluded), and
learning_curves.png plots both. `--budget-s S` gives every variant the same wall-clock: its step
count is S over its own step time, probed on a throwaway copy (the cosine schedule then ends at S):

    python bench/drafter_comparison.py --config configs/smollm2.yaml --cache CACHE --budget-s 600 \
        --curve-every 10 --variants dspark,dflash,eagle3 --out results/curves-smollm2

Training settings: the bench's own (TRAIN_DEFAULTS: global batch 16, micro-batch 8, lr 1e-3, 32
anchors per sequence) over the --config file's; --set overrides both.

Variants: eagle3 (1 layer), dflash (2 layers), dflash5 (5 layers), dspark (2 layers, vanilla Markov),
dspark5 (5 layers, the paper's), dspark_rnn, dspark_gated, and the same names with suffix _g15 (trained and
drafted at gamma=15), _fp8 (trained on --fp8-cache), _code (trained on the cache's code rows only: a drafter whose
confidences shift when traffic turns to prose), _kl (DSpark with KL(p_t||p_d) in place of the L1
term: an ablation). Prints a tau table with ratios next to the paper's.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import torch

from dspark import evaluation, plots
from dspark import target as targets
from dspark.cache.read import iter_local, open_cache
from dspark.config import add_config_args, config_from_args, run_main
from dspark.corpus.sources import Corpus
from dspark.decoding.sampling import SamplingParams
from dspark.errors import UserError
from dspark.models import (
    DrafterConfig,
    build_drafter,
    count_params,
    init_from_target,
    load_drafter,
    save_drafter,
    warm_start,
)
from dspark.storage import Storage
from dspark.train.loop import draft_vocabulary, fit
from dspark.train.loss import LossWeights, drafter_loss, summarize

TRAIN_DEFAULTS = ["train.global_batch=16", "train.micro_batch=8", "train.lr=1e-3", "train.anchors_per_seq=32"]

VARIANTS = {  # name -> (kind, draft layers, markov head)
    "eagle3": ("eagle3", 1, "none"),
    "dflash": ("dflash", 2, "none"),
    "dflash5": ("dflash", 5, "none"),
    "dspark": ("dspark", 2, "vanilla"),
    "dspark5": ("dspark", 5, "vanilla"),
    "dspark_rnn": ("dspark", 2, "rnn"),
    "dspark_gated": ("dspark", 2, "gated"),
}
PAPER = {"dspark/dflash": (1.16, 1.18), "dspark/eagle3": (1.27, 1.31)}


def parse(name: str):
    """variant name -> (kind, layers, markov, gamma, fp8 cache, training domains or None = all)."""
    base, gamma, fp8, domains = name.removesuffix("_kl"), 7, False, None
    if base.endswith("_code"):
        base, domains = base[:-5], ("code",)
    if base.endswith("_fp8"):
        base, fp8 = base[:-4], True
    if base.endswith("_g15"):
        base, gamma = base[:-4], 15
    if base not in VARIANTS:
        raise UserError(
            f"unknown variant {name!r} (base names: {', '.join(VARIANTS)}; suffixes _g15, _fp8, _code, _kl)"
        )
    return (*VARIANTS[base], gamma, fp8, domains)


def held_out(seq_id: str, frac: float) -> bool:
    """A fixed split that does not depend on row order: held out when seq_id hashes below frac."""
    return zlib.crc32(seq_id.encode()) % 10_000 < frac * 10_000


def make_drafter(name, tgt, cache, cfg):
    """The variant's drafter with train.markov_rank and, with train.draft_vocab, the cache's most
    frequent response tokens as its draft vocabulary (as the distributed trainer selects them)."""
    kind, layers, markov, gamma, _, _ = parse(name)
    tc = cfg.train.model_copy(update={"gamma": gamma, "dist_loss": "kl" if name.endswith("_kl") else "l1"})
    dc = DrafterConfig.from_target(
        tgt.config,
        kind,
        cache.manifest.layers,
        tgt.mask_token_id,
        num_layers=layers,
        gamma=gamma,
        markov=markov,
        markov_rank=tc.markov_rank,
        sample_from_anchor=tc.sample_from_anchor,
        draft_vocab=tc.draft_vocab,
        target=cache.manifest.target,
        cache_law=cache.manifest.law,
    )
    torch.manual_seed(cfg.train.seed)
    drafter = build_drafter(dc, tgt.model).float()  # trained in float32 (as the distributed trainer), any target dtype
    if tc.draft_vocab:
        drafter.set_draft_vocab(draft_vocabulary(cache, cache.manifest.shards, tc.draft_vocab)[0])
    init_from_target(cfg, drafter)
    warm_start(cfg, drafter)
    return drafter, tc


def heldout_metrics(drafter, batches: list[dict], tc) -> dict:
    """Expected tau and per-slot acceptance (1 - TV at T=1) on held-out rows, teacher-forced, with the
    same anchors at every call."""
    gen = torch.Generator().manual_seed(tc.seed)
    lw = LossWeights.from_config(tc)
    total, w = None, 0.0
    drafter.eval()
    with torch.no_grad():
        for b in batches:
            _, w_sum, stats = drafter_loss(drafter, b, tc.gamma, tc.anchors_per_seq, lw, gen)
            w += float(w_sum)
            total = stats if total is None else {k: total[k] + v for k, v in stats.items()}
    drafter.train()
    return summarize(total, max(w, 1e-9))


def step_seconds(name, tgt, cache, cfg, batches, probe: int = 4) -> float:
    """Seconds per optimizer step of a variant: the median of `probe` steps after a warm-up one, on a
    throwaway copy (the real run starts from the same initialisation)."""
    drafter, tc = make_drafter(name, tgt, cache, cfg)
    marks: list[float] = []
    fit(drafter, batches, tc, probe + 1, lambda step, m: marks.append(time.perf_counter()))
    return float(torch.tensor([b - a for a, b in zip(marks, marks[1:])]).median())


def train_variant(name, tgt, cache, cfg, steps, out_dir, log, curve_every=0, heldout=0.0, budget_s=0.0):
    domains = parse(name)[5]
    keep = (lambda s: not held_out(s, heldout)) if heldout else None
    epoch, seen = [0], [0]

    def batches():
        epoch[0] += 1
        for b in iter_local(
            cache, cfg.train.micro_batch, seed=cfg.train.seed, epoch=epoch[0], domains=domains, keep=keep
        ):
            seen[0] += int(b["loss_mask"].sum())  # response tokens trained on
            yield b

    if budget_s:
        t_step = step_seconds(name, tgt, cache, cfg, batches)
        steps = max(1, int(budget_s / t_step))
        log(f"[{name}] {t_step:.2f} s per step: {steps} steps in {budget_s:.0f} s")
        epoch[0], seen[0] = 0, 0
    drafter, tc = make_drafter(name, tgt, cache, cfg)
    held = []
    if curve_every:
        held = list(iter_local(cache, tc.micro_batch, domains=domains, keep=lambda s: held_out(s, heldout)))
        if not held:
            raise UserError(f"--heldout {heldout} leaves no held-out rows in {cache.uri}")
    curve: list[dict] = []
    clock = {"train_s": 0.0, "mark": time.perf_counter()}

    def point(step):
        m = heldout_metrics(drafter, held, tc)
        curve.append({"step": step, "tokens": seen[0], "train_s": clock["train_s"], **m})
        log(
            f"[{name}] step {step:4d} held-out expected tau {m['expected_tau']:.3f} "
            f"accept_1 {m['accept_1']:.3f} greedy tau {m['greedy_tau']:.3f} ({seen[0]} tokens, {clock['train_s']:.0f}s)"
        )

    if curve_every:
        point(0)
        clock["mark"] = time.perf_counter()

    def progress(step, m):
        clock["train_s"] += time.perf_counter() - clock["mark"]
        if curve_every and ((step + 1) % curve_every == 0 or step == steps - 1):
            point(step + 1)
        elif step % 50 == 0 or step == steps - 1:
            log(
                f"[{name}] step {step:4d} loss {m['loss']:.4f} expected tau {m['expected_tau']:.3f} "
                f"accept_1 {m['accept_1']:.3f} {m['tokens_per_s']:.0f} tok/s ({clock['train_s']:.0f}s)"
            )
        clock["mark"] = time.perf_counter()

    hist = fit(drafter, batches, tc, steps, progress)
    if budget_s and not 0.67 < clock["train_s"] / budget_s < 1.5:  # the probe ran under other load than the run
        log(
            f"[{name}] WARNING: {steps} steps took {clock['train_s']:.0f} s against a budget of {budget_s:.0f} s "
            f"(probed {t_step:.2f} s per step, ran {clock['train_s'] / steps:.2f}): another job shared the "
            "machine during the probe or the run, so the variants did not get equal wall-clock"
        )
    save_drafter(drafter, out_dir / name)
    return drafter, {
        "params": count_params(drafter),
        "steps": steps,
        "train_s": clock["train_s"],
        "tokens": seen[0],
        "final": hist[-1],
        "epochs": epoch[0],
        "curve": curve,
    }


def plot_curves(info: dict, path: Path) -> None:
    """Held-out expected tau against response tokens trained on and against training seconds."""
    fig, axes = plots.figure(1, 2, (11, 4))
    for name, v in info.items():
        c = v.get("curve") or []
        if c:
            axes[0][0].plot([x["tokens"] for x in c], [x["expected_tau"] for x in c], "-o", ms=2, label=name)
            axes[0][1].plot([x["train_s"] for x in c], [x["expected_tau"] for x in c], "-o", ms=2, label=name)
    axes[0][0].set_xlabel("response tokens trained on")
    axes[0][1].set_xlabel("training seconds")
    for ax in axes[0]:
        ax.set_ylabel("held-out expected tau (T=1, teacher-forced)")
    plots.finish(fig, path, axes[0])


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--cache", required=True)
    p.add_argument("--fp8-cache", default="")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--variants", default="eagle3,dflash,dspark,dspark_rnn")
    p.add_argument("--out", default="results/comparison")
    p.add_argument("--eval-only", action="store_true", help="evaluate drafters already trained into --out")
    p.add_argument(
        "--budget-s", type=float, default=0.0, help="equal wall-clock training per variant (overrides --steps)"
    )
    p.add_argument("--curve-every", type=int, default=0, help="held-out expected tau every N steps (learning curves)")
    p.add_argument("--heldout", type=float, default=0.1, help="fraction of cache rows held out for the curves")
    p.add_argument("--train-only", action="store_true", help="train (and plot the curves), no evaluation")
    p.add_argument(
        "--gammas", default="", help="static verification lengths to also evaluate _g15 variants at, e.g. 3,7,15"
    )
    args = p.parse_args(argv)
    args.overrides = TRAIN_DEFAULTS + args.overrides
    cfg = config_from_args(args)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = targets.load_from_config(cfg.target)
    storage = Storage.from_config(cfg.storage)
    same_target = {"target.weights_sha256": tgt.weights_sha256}  # a cache of another target is an error naming it
    caches = {False: open_cache(args.cache, storage, same_target)}
    if args.fp8_cache:
        caches[True] = open_cache(args.fp8_cache, storage, same_target)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    info = json.loads((out / "training.json").read_text()) if (out / "training.json").exists() else {}
    drafters = {}
    for name in names:
        if args.eval_only or (out / name / "model.safetensors").exists():
            drafters[name] = d = load_drafter(out / name, tgt.model, tgt.weights_sha256)
            # a drafter saved before drafters recorded their cache's law learned from this bench's --cache
            d.c.cache_law = d.c.cache_law or caches.get(parse(name)[4], caches[False]).manifest.law
            continue
        trained, info[name] = train_variant(
            name,
            tgt,
            caches[parse(name)[4]],
            cfg,
            args.steps,
            out,
            print,
            args.curve_every,
            args.heldout if args.curve_every else 0.0,
            args.budget_s,
        )
        drafters[name] = trained.to(next(tgt.model.parameters()).dtype)  # evaluated as load_drafter serves it
        (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    if any(v.get("curve") for v in info.values()):
        plot_curves(info, out / "learning_curves.png")
    if args.train_only:
        return
    corpus = Corpus.load(cfg.corpus)
    groups: dict[int, dict] = {}
    for name, d in drafters.items():
        groups.setdefault(parse(name)[3], {})[name] = d
    summary = {"training": info, "steps": args.steps, "evals": {}}
    for gamma, ds in sorted(groups.items()):
        ecfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"gamma": gamma})})
        res = evaluation.evaluate(ecfg, tgt, ds, corpus, out / f"gamma{gamma}")
        # served and simulated with these
        evaluation.save_calibrations(res, {name: out / name for name in res["calibrations"]}, {"gamma": gamma})
        summary["evals"][gamma] = [r.__dict__ for r in res["results"]]
        print((out / f"gamma{gamma}" / "results.md").read_text())
    if args.gammas:
        summary["static_lengths"] = static_lengths(
            cfg, tgt, groups.get(15, {}), corpus, [int(x) for x in args.gammas.split(",")]
        )
    print(ratio_table(summary["evals"].get(7, [])))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def static_lengths(cfg, tgt, drafters: dict, corpus, lengths: list[int]) -> list[dict]:
    """tau when drafting 15 tokens but verifying only the first l (l = 3, 7, 15), T=1."""
    rows = []
    sp = SamplingParams(1.0)
    for dom in ("code", "prose"):
        prompts = evaluation.prompts_for(cfg, corpus, dom, "heldout", cfg.eval.prompts_per_domain, tgt.tokenizer)
        for name, d in drafters.items():
            for ell in lengths:
                reqs = evaluation.decode(
                    tgt.model,
                    d,
                    prompts,
                    sp,
                    15,
                    cfg.eval.max_new_tokens,
                    tgt.eos_token_ids,
                    cfg.eval.seed,
                    policy=lambda s, R, g, ell=ell: [ell] * R,
                )
                r = evaluation.summarize(name, dom, sp, 15, reqs)
                rows.append(
                    {
                        "drafter": name,
                        "domain": dom,
                        "verify_len": ell,
                        "tau": r.tau,
                        "draft_ms": r.draft_ms,
                        "verify_ms": r.verify_ms,
                    }
                )
                print(
                    f"[static] {name} {dom} l={ell}: tau {r.tau:.3f} draft {r.draft_ms:.2f} ms "
                    f"verify {r.verify_ms:.2f} ms"
                )
    return rows


def ratio_table(rows: list[dict]) -> str:
    by = {(r["drafter"], r["domain"], r["temperature"]): r["tau"] for r in rows}
    lines = [
        "| domain | T | "
        + " | ".join(sorted({r["drafter"] for r in rows if r["gamma"]}))
        + " | DSpark/DFlash (paper 1.16-1.18) | DSpark/EAGLE-3 (paper 1.27-1.31) |",
        "",
    ]
    lines[1] = "|" + "---|" * (len(lines[0].split("|")) - 2)
    for dom in sorted({r["domain"] for r in rows}):
        for t in sorted({r["temperature"] for r in rows}):
            names = sorted({r["drafter"] for r in rows if r["gamma"]})
            taus = [by.get((n, dom, t), float("nan")) for n in names]
            ds, df, ea = by.get(("dspark", dom, t)), by.get(("dflash", dom, t)), by.get(("eagle3", dom, t))
            r1 = f"{ds / df:.3f}" if ds and df else "-"
            r2 = f"{ds / ea:.3f}" if ds and ea else "-"
            lines.append(f"| {dom} | {t:g} | " + " | ".join(f"{x:.3f}" for x in taus) + f" | {r1} | {r2} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
