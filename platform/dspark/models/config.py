"""Drafter configuration: sizes come from the target's HF config, so any Qwen3-family target works."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["dspark", "dflash", "eagle3"]
MarkovKind = Literal["vanilla", "gated", "rnn", "none"]


@dataclass
class DrafterConfig:
    kind: Kind
    hidden_size: int  # d, the target's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # V
    rope_theta: float
    rms_norm_eps: float
    tap_layers: list[int]  # which target layers feed the context (m = len)
    mask_token_id: int  # filler of the parallel block's mask slots
    num_layers: int = 2  # draft layers
    gamma: int = 7  # draft tokens per round the drafter is trained for
    markov: MarkovKind = "vanilla"  # DSpark's sequential head; "none" for DFlash / EAGLE-3
    markov_rank: int = 256  # r
    draft_vocab: int = 0  # V_d: the drafter proposes only V_d target tokens (0 = all V); ids in its weights
    # the parallel block (DSpark/DFlash): True = gamma slots [x_p, MASK..] where slot k predicts x_{p+k+1}
    # (DSpark's, DeepSpec's); False = the fill-in block of gamma + 1 slots [x_p, MASK x gamma] where each
    # mask predicts the token at its own position (z-lab's DFlash, the only block vLLM's DFlash serves)
    sample_from_anchor: bool = True
    target: dict = field(default_factory=dict)  # name and weights hash of the target it was trained for
    # the law the target's cached answers it learned from were sampled with (temperature, top_p, top_k; {}: not
    # recorded, drafters saved before it was): the ideal parallel drafter's bound depends on it (evaluation.oracle)
    cache_law: dict = field(default_factory=dict)

    @property
    def m(self) -> int:
        return len(self.tap_layers)

    def block_len(self, gamma: int) -> int:
        """Slots of a parallel block drafting gamma tokens (see sample_from_anchor)."""
        return gamma if self.sample_from_anchor else gamma + 1

    @classmethod
    def from_target(cls, hf_config, kind: Kind, tap_layers: list[int], mask_token_id: int, **kw) -> "DrafterConfig":
        c = hf_config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        return cls(
            kind=kind,
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            rope_theta=float(theta),
            rms_norm_eps=c.rms_norm_eps,
            tap_layers=list(tap_layers),
            mask_token_id=mask_token_id,
            **kw,
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "DrafterConfig":
        return cls(**json.loads(Path(path).read_text()))
