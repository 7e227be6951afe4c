"""Loading the target model: the built-in reference target, a local HF folder, or a hub id.

Device, dtype and attention backend are configuration; nothing here assumes a CPU.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.errors import UserError

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    name: str  # what the user asked for ("builtin", a path, or a hub id)
    path: str  # where it was loaded from
    model: torch.nn.Module  # an HF causal LM in eval mode
    tokenizer: object
    weights_sha256: str  # identifies the exact weights (recorded in caches and drafters)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve(name_or_path: str) -> str:
    if name_or_path == "builtin":
        if not (BUILTIN_DIR / "config.json").is_file():
            raise UserError(f"the built-in target is missing from {BUILTIN_DIR}; run jobs/train_target.py")
        return str(BUILTIN_DIR)
    return name_or_path


def weights_hash(path: str) -> str:
    """sha256 over the safetensors files of a local folder; for hub ids, the id and revision."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    h = hashlib.sha256()
    if not files:
        h.update(path.encode())
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def tokenizer_hash(path: str) -> str:
    f = Path(path) / "tokenizer.json"
    return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else ""


def _check_local(path: str) -> bool:
    """True for a local folder (which must hold config.json); False for a hub id."""
    local = Path(path)
    looks_local = local.is_absolute() or path.startswith(".") or local.exists()
    if looks_local and not (local / "config.json").is_file():
        raise UserError(f"target not found: {path} (expected an HF model folder with config.json)")
    return looks_local


def hf_config(name_or_path: str):
    """The target's HF config (sizes, layer count) without loading weights."""
    from transformers import AutoConfig

    path = resolve(name_or_path)
    _check_local(path)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target {path!r} config could not be read: {str(e).splitlines()[0]}") from None


def load(name_or_path: str = "builtin", device: str = "cpu", dtype: str = "float32",
         attn_implementation: str | None = None) -> Target:
    """Load any HF causal LM (local folder or hub id) with its tokenizer, frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    from dspark.corpus.tokenizer import load_tokenizer

    path = resolve(name_or_path)
    looks_local = _check_local(path)
    if dtype not in DTYPES:
        raise UserError(f"target.dtype: unknown dtype {dtype!r} (valid: {', '.join(DTYPES)})")
    kwargs = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target {path!r} could not be loaded: {str(e).splitlines()[0]}") from None
    if looks_local:
        tokenizer = load_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    model.to(device).eval().requires_grad_(False)
    return Target(name_or_path, path, model, tokenizer, weights_hash(path))


def tokenizer_for(name_or_path: str):
    path = resolve(name_or_path)
    if _check_local(path):
        from dspark.corpus.tokenizer import load_tokenizer

        return load_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def head_weights(name_or_path: str, dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head matrices (V, d) without loading the whole model:
    what a drafter shares. Local safetensors folders are read selectively (sharded or not)."""
    from safetensors import safe_open

    path = resolve(name_or_path)
    if not _check_local(path):  # a hub id: let transformers fetch it
        tgt = load(path, dtype=dtype)
        return tgt.model.get_input_embeddings().weight, tgt.model.get_output_embeddings().weight
    cfg = hf_config(path)
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None

    def read(name: str) -> torch.Tensor | None:
        file = folder / (weight_map.get(name, "") if weight_map else "model.safetensors")
        if not file.is_file():
            return None
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name).to(DTYPES[dtype]) if name in f.keys() else None

    embed = read("model.embed_tokens.weight")
    if embed is None:
        raise UserError(f"target {path}: no model.embed_tokens.weight in its safetensors files")
    head = None if getattr(cfg, "tie_word_embeddings", False) else read("lm_head.weight")
    return embed, embed if head is None else head


def load_from_config(cfg) -> Target:
    """`cfg` is a dspark.config.TargetConfig."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return load(cfg.name_or_path, cfg.device, cfg.dtype, cfg.attn_implementation)


def card(path: str) -> dict:
    """The model card (recipe, corpus hash, measured quality) saved next to a trained target."""
    f = Path(resolve(path)) / "target_card.json"
    return json.loads(f.read_text()) if f.is_file() else {}
