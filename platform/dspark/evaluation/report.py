"""Evaluation reports: markdown tables, plots (conditional acceptance, reliability diagrams, threshold
sweep) and MLflow logging."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from dspark import plots
from dspark.calibration import sts
from dspark.calibration.metrics import ece, reliability
from dspark.evaluation.measure import RunResult


def calibration_markdown(cal_by: dict) -> str:
    rows = [
        "| drafter | domain | rounds | k | observed | ECE raw | STS | STS+offset | matched STS | matched STS+offset "
        "| floor | AUROC | Brier raw / STS+offset |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    for name, cal in cal_by.items():
        for dom, d in cal["domains"].items():
            rows += [
                f"| {name} | {dom} | {d['rounds']} | {p['k']} | {p['observed']:.3f} | {pct(p['ece_raw'])} | "
                f"{pct(p['ece_sts'])} | {pct(p['ece_sts_bias'])} | {pct(p['ece_matched_sts'])} | "
                f"{pct(p['ece_matched_sts_bias'])} | {pct(p['ece_floor_matched'])} | {p['auroc']:.3f} | "
                f"{p['brier_raw']:.4f} / {p['brier_sts_bias']:.4f} |"
                for p in d["positions"]
            ]
    rows += [
        "",
        "| drafter | domain | threshold | verified/step | accepted/step | rejected/step | acceptance rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cal in cal_by.items():
        for dom, d in cal["domains"].items():
            rows += [
                f"| {name} | {dom} | {r['threshold']:.1f} | {r['verified']:.2f} | {r['accepted']:.2f} | "
                f"{r['rejected']:.2f} | {100 * r['acceptance_rate']:.1f}% |"
                for r in d["threshold_sweep"]
            ]
    return "\n".join(rows) + "\n"


def markdown(results: list[RunResult]) -> str:
    head = (
        "| drafter | domain | T | gamma | tau | tau bound | speedup | draft ms | verify ms "
        "| cond. acceptance by position | bound by position |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {r.drafter} | {r.domain} | {r.temperature:g} | {r.gamma} | {r.tau:.3f} | "
        f"{f'{r.tau_bound:.3f} ({r.bound_law})' if r.bound_accept else '-'} | {r.speedup:.2f}x | {r.draft_ms:.1f} | "
        f"{r.verify_ms:.1f} | {' '.join(f'{a:.2f}' for a in r.cond_accept)} | "
        f"{' '.join(f'{a:.2f}' for a in r.bound_accept) or '-'} |"
        for r in results
    ]
    return head + "\n".join(rows) + "\n"


def plot_acceptance(results: list[RunResult], path: Path) -> None:
    panels = sorted({(r.domain, r.temperature) for r in results if r.gamma})
    fig, axes = plots.figure(1, len(panels), (4.5 * len(panels), 3.6))
    for ax, (dom, t) in zip(axes[0], panels):
        rows = [r for r in results if r.domain == dom and r.temperature == t and r.gamma]
        for r in rows:
            ax.plot(range(1, r.gamma + 1), r.cond_accept, marker="o", label=f"{r.drafter} (tau {r.tau:.2f})")
        bounds = {}  # law -> its bound at the longest gamma (drafters trained on other answers have others)
        for r in sorted((r for r in rows if r.bound_accept), key=lambda r: r.gamma):
            bounds[r.bound_law] = r
        for style, bound in zip(itertools.cycle(("k--", "k:", "k-.")), bounds.values()):
            ax.plot(
                range(1, bound.gamma + 1),
                bound.bound_accept,
                style,
                label=f"ideal parallel, {bound.bound_law} answers (tau {bound.tau_bound:.2f})",
            )
        ax.set_title(f"{dom}, T={t:g}")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_ylim(0, 1)
    plots.finish(fig, path, axes[0])


def plot_reliability(obs_by: dict, cal: sts.Calibration, path: Path, bins: int = 20) -> None:
    """Reliability diagrams of prefix survival a_k (paper Fig. 6): one row per held-out domain, one
    column per position, raw vs calibrated, with the ECE of each and the bin counts shaded."""
    gamma = next(iter(obs_by.values())).logits.shape[1]
    ks = list(range(1, min(gamma, 4) + 1))  # later positions hold almost no survival mass at this scale
    fig, axes = plots.figure(len(obs_by), len(ks), (3.6 * len(ks), 3.4 * len(obs_by)))
    for row, (label, obs) in zip(axes, obs_by.items()):
        raw, fitted = sts.survival(obs.logits, sts.Calibration.identity(gamma)), sts.survival(obs.logits, cal)
        for ax, k in zip(row, ks):
            sel, y, _ = obs.at(k)
            counts = np.bincount(np.minimum((fitted[sel, k - 1] * bins).astype(int), bins - 1), minlength=bins)
            ax.bar((np.arange(bins) + 0.5) / bins, counts / max(counts.max(), 1), width=1 / bins, color="0.9")
            for name, a, style in (("raw", raw, "rs-"), ("STS", fitted, "bo-")):
                pts = reliability(a[sel, k - 1], y, bins)
                ax.plot(
                    [p for p, _, _ in pts],
                    [o for _, o, _ in pts],
                    style,
                    ms=3,
                    label=f"{name} ECE {100 * ece(a[sel, k - 1], y, bins):.1f}%",
                )
            ax.plot([0, 1], [0, 1], "k--", lw=0.8)
            ax.set_title(f"{label}, position {k} (n={int(sel.sum())})", fontsize=9)
            ax.set_xlabel("predicted a_k")
            ax.set_ylabel("observed")
            ax.legend(fontsize=7)
    plots.finish(fig, path, [])


def plot_sweep(sweeps: dict, path: Path) -> None:
    """Threshold sweep (paper Fig. 5): accepted and rejected drafts per step (bars), acceptance rate (line)."""
    fig, axes = plots.figure(1, len(sweeps), (4.5 * len(sweeps), 3.6))
    for ax, (label, rows) in zip(axes[0], sweeps.items()):
        th = np.array([r["threshold"] for r in rows])
        acc, rej = np.array([r["accepted"] for r in rows]), np.array([r["rejected"] for r in rows])
        ax.bar(th, acc, width=0.07, label="accepted")
        ax.bar(th, rej, width=0.07, bottom=acc, hatch="//", fill=False, label="rejected")
        ax.set_xlabel("confidence threshold on a_k")
        ax.set_ylabel("drafts verified per step")
        ax.set_title(label)
        ax.legend(fontsize=7, loc="upper right")
        ax2 = ax.twinx()
        ax2.plot(th, [100 * r["acceptance_rate"] for r in rows], "k-o", ms=3)
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("acceptance rate (%)")
    plots.finish(fig, path, [])


def log_results(tracker, res: dict, out_dir: Path, prefix: str = "", artifact_path: str | None = None) -> None:
    """MLflow: tau, its bound and speedup per drafter/domain/T, calibration (ECE raw/STS, AUROC) per position,
    and every JSON/markdown/PNG the evaluation wrote."""
    for r in res["results"]:
        key = f"{prefix}{r.drafter}.{r.domain}.T{r.temperature:g}"
        tracker.metrics({f"{key}.tau": r.tau, f"{key}.speedup": r.speedup}, 0)
        if r.bound_accept:
            tracker.metrics({f"{key}.tau_bound": r.tau_bound}, 0)
    for name, cal in res["calibration"].items():
        for dom, d in cal["domains"].items():
            for p in d["positions"]:
                tracker.metrics(
                    {
                        f"{prefix}{name}.{dom}.calibration.{m}": p[m]
                        for m in ("ece_raw", "ece_sts", "ece_sts_bias", "ece_matched_sts_bias", "ece_floor", "auroc")
                    },
                    p["k"],
                )
    for f in sorted(out_dir.iterdir()):
        if f.suffix in (".json", ".md", ".png"):
            tracker.artifact(f, artifact_path)
