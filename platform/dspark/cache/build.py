"""Building a target cache with Ray Data.

The conversations of `cache.sources` are cut into shards of `cache.shard_rows`. A Ray Data `map_batches`
over the shard list runs an actor pool (`ShardBuilder`, each holding the target, on CPU or `num_gpus`):
per shard it regenerates every assistant turn (prompts rendered with the target's chat template; the
decoding runner's continuous batching with the configured sampling), runs one target forward per row (one
row per assistant turn) capturing the tapped layers and the final-norm hidden state, and publishes the Parquet
shard atomically. The driver streams the per-shard stats back, reports progress, and writes
manifest.json last. Rerunning skips shards already published, after checking that each was built with
this run's settings (its "built_with" record); one builder at a time holds the cache's lock
(dspark.cache.lock).
"""

from __future__ import annotations

import io
import json
import logging
import time
import uuid
from dataclasses import asdict, replace
from typing import Callable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from ray.experimental import tqdm_ray

from dspark import target as targets
from dspark.artifacts import cache_uri
from dspark.cache import codec as codecs
from dspark.cache.format import (
    MANIFEST,
    PARQUET_OPTIONS,
    SCHEMA,
    Manifest,
    ShardStats,
    sha256_of,
    shard_name,
)
from dspark.cache.lock import CacheLock
from dspark.cache.read import Cache, decode_batch, read_manifest, read_shard, shard_bytes
from dspark.cluster import quiet_ray_data
from dspark.config import Config
from dspark.corpus.conversations import Conversation, cache_sources
from dspark.corpus.tokenizer import chat_ids
from dspark.decoding.runner import family
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.errors import UserError
from dspark.storage import Storage
from dspark.target.taps import extract, resolve_layers

log = logging.getLogger(__name__)
TOO_LONG = "skipped: their prompts leave no room in the target's context"

# the manifest fields that a shard's content depends on (with which examples it holds)
BUILD_KEYS = ("target", "tokenizer_sha256", "layers", "hidden_size", "codec", "generation", "corpus_sha256")


def _put_atomic(fs: pafs.FileSystem, final: str, data: bytes, tmp_dir: str) -> None:
    """Write to a temporary name, then move into place: readers never see a partial file."""
    fs.create_dir(tmp_dir, recursive=True)
    fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    tmp = f"{tmp_dir}/{final.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, final)


def _read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


class ShardBuilder:
    """Ray Data actor: holds the target; turns one batch of shard descriptions into published shards."""

    def __init__(self, cfg_json: str, cache_uri: str, layers: list[int], storage: Storage, settings: dict):
        cfg = Config.model_validate_json(cfg_json)
        self.cfg, self.cache_uri, self.layers, self.storage, self.settings = cfg, cache_uri, layers, storage, settings
        self.tgt = targets.load_from_config(cfg.target)
        self.tok = self.tgt.tokenizer
        self.max_len = context_of(self.tgt.model)

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {k: [] for k in ("shard_id", "stats", "seconds")}
        for shard_id, convs in zip(batch["shard_id"], batch["conversations"]):
            t0 = time.perf_counter()
            stats = self.build_shard(int(shard_id), [Conversation.from_json(c) for c in convs])
            out["shard_id"].append(int(shard_id))
            out["stats"].append(stats)
            out["seconds"].append(time.perf_counter() - t0)
        return out

    def build_shard(self, shard_id: int, convs: list[Conversation]) -> dict:
        cc = self.cfg.cache
        # the target answering a shard is the long wait (minutes on a CPU): a bar per shard, drawn by the driver
        bar = tqdm_ray.tqdm(desc=f"[cache] shard {shard_id} answers", total=sum(len(c.turns) for c in convs))
        try:
            turns = regenerate(
                self.tgt.model,
                self.tok,
                convs,
                cc,
                cc.seed * 100_003 + shard_id,
                self.tgt.eos_token_ids,
                self.cfg.target.chat_template_kwargs,
                progress=bar.update,
                max_len=self.max_len,
            )
            skipped = skipped_turns(convs, turns)
            bar.update(skipped)  # turns that did not fit the target's context: done, unanswered
        finally:
            bar.close()
        cols = make_rows(self.tgt.model, self.layers, cc.codec, *turn_rows(convs, turns))
        fs, root = self.storage.pyarrow_fs(self.cache_uri)
        record = shard_record(self.settings, [c.conv_id for c in convs])
        return asdict(publish_shard(fs, root, shard_id, cols, record, skipped))


def settings_of(m: Manifest) -> dict:
    """The build settings a manifest states (BUILD_KEYS), as they read back from JSON."""
    return json.loads(json.dumps({k: getattr(m, k) for k in BUILD_KEYS}))


def shard_record(settings: dict, seq_ids: list[str]) -> dict:
    """What a built shard was built with: the settings and the examples it holds."""
    return {**settings, "examples_sha256": sha256_of("\n".join(seq_ids).encode())}


def publish_shard(
    fs: pafs.FileSystem,
    root: str,
    shard_id: int,
    cols: dict[str, list],
    built_with: dict | None = None,
    skipped_turns: int = 0,
) -> ShardStats:
    """Write one shard (then its sidecar: stats and the `built_with` record), each atomically. A shard
    without a record (None: a hand-made cache) is never reused by a resumed build. `skipped_turns`: the user
    turns of its conversations that were not answered (their prompt did not fit the target's context)."""
    buf = io.BytesIO()
    rows = len(cols["seq_id"])
    pq.write_table(pa.table(cols, schema=SCHEMA), buf, row_group_size=max(1, min(64, rows)), **PARQUET_OPTIONS)
    data = buf.getvalue()
    tokens, response_tokens = sum(cols["num_tokens"]), sum(int(sum(m)) for m in cols["loss_mask"])
    return _publish(
        fs,
        root,
        ShardStats(shard_id, shard_name(shard_id), rows, tokens, response_tokens, 0, "", skipped_turns),
        data,
        built_with,
    )


def _publish(fs: pafs.FileSystem, root: str, stats: ShardStats, data: bytes, built_with: dict | None) -> ShardStats:
    """The Parquet bytes of a shard, then its sidecar (`stats` with the bytes' size and sha256)."""
    stats = replace(stats, bytes=len(data), sha256=sha256_of(data))
    _put_atomic(fs, f"{root}/{stats.file}", data, f"{root}/_tmp")
    sidecar = json.dumps({**asdict(stats), "built_with": built_with}).encode()
    _put_atomic(fs, f"{root}/_shards/{stats.file}.json", sidecar, f"{root}/_tmp")
    return stats


def context_of(model) -> int:
    """The target's context in tokens, regenerate's `max_len` (0: no known limit)."""
    return getattr(model.config, "max_position_embeddings", 0) or 0


def skipped_turns(convs: list[Conversation], turns: list[list]) -> int:
    """The user turns of `convs` that `regenerate` left out (their prompts left no room in the context)."""
    return sum(len(c.turns) for c in convs) - sum(len(ts) for ts in turns)


def regenerate(
    model,
    tok,
    convs: list[Conversation],
    cc,
    seed: int,
    eos_ids: tuple[int, ...] = (),
    chat_template_kwargs: dict | None = None,
    answer_last: bool = True,
    progress: Callable[[int], object] | None = None,
    max_len: int = 0,
    room: int = 1,
) -> list[list[tuple[list[int], list[int]]]]:
    """The target answers the conversations itself, the paper's protocol: user turn t is rendered with the
    target's chat template after the target's own answers to turns 1..t-1, then answered; batched over the
    conversations turn by turn. Per conversation and turn: (prompt ids, response ids ending at its first EOS);
    with answer_last=False the last turn's prompt is rendered but not answered (its response is []).
    `progress(n)` is called as n more answers are generated. With `max_len` (the target's context), a
    conversation ends before the first turn whose prompt leaves no room for an answer of `room` tokens: that
    turn and the ones after it are not answered and have no entry (a first turn that long: the conversation
    has none)."""
    eos = tuple(eos_ids) or (tok.eos_token_id,)
    answers: list[list[str]] = [[] for _ in convs]
    out: list[list[tuple[list[int], list[int]]]] = [[] for _ in convs]
    ended: set[int] = set()
    for t in range(max((len(c.turns) for c in convs), default=0)):
        live = [i for i, c in enumerate(convs) if t < len(c.turns) and i not in ended]
        prompts = [chat_ids(tok, convs[i].messages(answers[i]), True, chat_template_kwargs) for i in live]
        if max_len:
            ended |= {i for i, p in zip(live, prompts) if len(p) + room > max_len}
            live, prompts = [i for i in live if i not in ended], [p for p in prompts if len(p) + room <= max_len]
        ask = [k for k, i in enumerate(live) if answer_last or t < len(convs[i].turns) - 1]
        asked = [prompts[k] for k in ask]
        answered = generate(model, asked, cc, eos, tok.pad_token_id, progress, hash((seed, t)), max_len) if ask else []
        responses = dict(zip(ask, answered))
        for k, (i, p) in enumerate(zip(live, prompts)):
            out[i].append((p, responses.get(k, [])))
            answers[i].append(tok.decode(responses.get(k, []), skip_special_tokens=True))
    return out


def generate(
    model,
    prompts: list[list[int]],
    cc,
    eos: tuple[int, ...],
    pad: int,
    progress: Callable[[int], object] | None = None,
    seed: int = 0,
    max_len: int = 0,
) -> list[list[int]]:
    """Responses to token-id prompts with the configured sampling (`cc` is a CacheConfig), each ending at its
    first EOS (kept) or after cc.max_new_tokens; progress(n) as n more are done. A target of a family the
    decoding runner runs is decoded there (continuous batching over cc.batch_size KV slots, answer i sampled
    with its own generator seeded by (seed, i): the same answer in any batch; SmolLM2 in float32, 16 prompts
    of 128 tokens on 2 threads: 27.9 tok/s against 22.7 for HF generation, the built-in target: equal), any
    other model by HF generation, whose answers end where `max_len` (the target's context) does."""
    if not prompts:
        return []
    try:
        family(model.config)
    except (AttributeError, UserError):
        return hf_generate(model, prompts, cc, eos, pad, progress, seed, max_len)
    longest = max(len(p) for p in prompts) + cc.max_new_tokens + 1
    dec = SpeculativeDecoder(model, None, max_slots=min(cc.batch_size, len(prompts)), capacity=longest)
    sp = SamplingParams(cc.temperature, cc.top_p, cc.top_k)
    reqs = []
    for i, p in enumerate(prompts):
        room = dec.max_len - len(p)  # the answer is cut where the target's context ends (as in hf_generate)
        if room < 1:
            raise UserError(f"a prompt of {len(p)} tokens leaves no room in the target's {dec.max_len}-token context")
        reqs.append(Request(p, sp, min(cc.max_new_tokens, room), hash((seed, i)) & (2**63 - 1), eos))
    return [r.out for r in dec.run(reqs, progress)]


@torch.no_grad()
def hf_generate(model, prompts, cc, eos, pad, progress, seed, max_len: int = 0) -> list[list[int]]:
    """`generate` (same arguments) by batched, left-padded, KV-cached HF generation, cc.batch_size at a time;
    with `max_len`, a batch's answers stop where its longest prompt reaches it (HF itself would go on)."""
    torch.manual_seed(seed & (2**63 - 1))
    device = next(model.parameters()).device
    sampling = (
        dict(do_sample=True, temperature=cc.temperature, top_p=cc.top_p, top_k=cc.top_k or None)
        if cc.temperature > 0
        else dict(do_sample=False)
    )
    responses: list[list[int]] = []
    for i in range(0, len(prompts), cc.batch_size):
        enc = prompts[i : i + cc.batch_size]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(enc):
            ids[r, width - len(e) :] = torch.tensor(e)
            mask[r, width - len(e) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=min(cc.max_new_tokens, max_len - width) if max_len else cc.max_new_tokens,
            eos_token_id=list(eos),
            pad_token_id=pad,
            **sampling,
        )
        responses += [cut_response(row, eos) for row in gen[:, width:].tolist()]
        if progress:
            progress(len(enc))
    return responses


def cut_response(row: list[int], eos: tuple[int, ...]) -> list[int]:
    """A generated row up to and including its first EOS. What follows is HF's padding of a finished row;
    nothing before the cut is dropped, since the pad token may be an EOS itself (SmolLM2)."""
    end = next((k for k, t in enumerate(row) if t in eos), len(row) - 1)
    return row[: end + 1]


def turn_rows(convs: list[Conversation], turns: list[list[tuple[list[int], list[int]]]]):
    """make_rows' (seq_ids, domains, seqs, n_prompt): one row per assistant turn, its prompt the
    conversation so far; the first turn's row is named by the conversation's id."""
    seq_ids, domains, seqs, n_prompt = [], [], [], []
    for c, ts in zip(convs, turns):
        for t, (prompt, response) in enumerate(ts):
            seq_ids.append(c.conv_id if t == 0 else f"{c.conv_id}/turn{t + 1}")
            domains.append(c.source)
            seqs.append(prompt + response)
            n_prompt.append(len(prompt))
    return seq_ids, domains, seqs, n_prompt


def make_rows(
    model,
    layers: list[int],
    codec: str,
    seq_ids: list[str],
    domains: list[str],
    seqs: list[list[int]],
    n_prompt: list[int],
) -> dict[str, list]:
    """Cache rows (columns of SCHEMA) for token sequences whose first n_prompt tokens are the prompt:
    one target forward per sequence captures the tapped layers and the last hidden state."""
    cols: dict[str, list] = {f.name: [] for f in SCHEMA}
    for sid, dom, ids, n in zip(seq_ids, domains, seqs, n_prompt):
        feats, last = extract(model, ids, layers)  # (T, m, d), (T, d)
        for k, v in (
            ("seq_id", sid),
            ("domain", dom),
            ("num_tokens", len(ids)),
            ("input_ids", ids),
            ("loss_mask", [0] * n + [1] * (len(ids) - n)),
            ("features", codecs.encode(feats, codec)),
            ("last_hidden", codecs.encode(last, codec)),
        ):
            cols[k].append(v)
    return cols


def published_stats(fs: pafs.FileSystem, root: str) -> dict[int, tuple[ShardStats, dict | None]]:
    """Stats and `built_with` records (None from older versions) of shards already published by an
    earlier (possibly crashed) build. An unreadable sidecar leaves its shard to be built again."""
    done: dict[int, tuple[ShardStats, dict | None]] = {}
    listing = fs.get_file_info(pafs.FileSelector(f"{root}/_shards", allow_not_found=True))
    for info in listing:
        if info.path.endswith(".parquet.json"):
            try:
                d = json.loads(_read_bytes(fs, info.path))
                built_with = d.pop("built_with", None)
                s = ShardStats(**d)
            except (ValueError, TypeError) as e:
                log.warning("rebuilding the shard of %s: unreadable (%s)", info.path, e)
                continue
            if fs.get_file_info(f"{root}/{s.file}").type == pafs.FileType.File:
                done[s.shard_id] = (s, built_with)
    return done


def differences(have: dict, want: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, have, want) for every key whose values differ; nested dicts compared key by key."""
    out: list[tuple[str, object, object]] = []
    for k in sorted(set(have) | set(want)):
        a, b = have.get(k), want.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append((f"{prefix}{k}", a, b))
    return out


def describe(diffs: list[tuple[str, object, object]]) -> str:
    def short(v):
        r = repr(v)
        return r if len(r) <= 40 else r[:37] + "..."

    return "; ".join(f"{k}: {short(a)} there, {short(b)} now" for k, a, b in diffs)


def check_resume(uri: str, done: dict[int, tuple[ShardStats, dict | None]], want: dict[int, dict]) -> None:
    """Refuse to finish a build whose published shards were built with other settings (or hold other
    examples) than `want` (shard id -> record): the error names the keys that differ."""
    diffs: dict[str, tuple] = {}
    for i, (_, have) in sorted(done.items()):
        if have is None:
            raise UserError(
                f"cache {uri}: {shard_name(i)} was published without a record of its settings (by an "
                f"older version): delete the cache folder or choose another cache.name / cache.uri"
            )
        found = differences(have, want[i]) if i in want else [("examples_sha256", have.get("examples_sha256"), None)]
        for key, a, b in found:
            diffs.setdefault(key, (key, a, b))
    if diffs:
        hint = (
            " (which examples each shard holds: cache.shard_rows, cache.max_examples or the corpus changed)"
            if "examples_sha256" in diffs
            else ""
        )
        raise UserError(
            f"cache {uri} holds shards built with other settings{hint}: {describe(list(diffs.values()))}; "
            f"rerun with the settings it was started with, or choose another cache.name / cache.uri"
        )


def build_cache(cfg: Config, tracker=None, log_fn=print) -> Manifest:
    """Build (or finish building) the cache of `cache.sources` (the built-in corpus's train split and/or JSONL
    conversations); returns the manifest."""
    cc = cfg.cache
    codecs.bytes_per_vector(cc.codec, 1)  # validates the codec name
    storage = Storage.from_config(cfg.storage)
    uri = cache_uri(cfg)
    storage.check(uri)
    fs, root = storage.pyarrow_fs(uri)
    fs.create_dir(root, recursive=True)
    old = read_manifest(storage, uri)  # a damaged one fails here, before any work

    tgt_path = targets.resolve(cfg.target.name_or_path, cfg.target.revision, cfg.target.cache_dir)
    tgt_cfg = targets.hf_config(tgt_path)  # sizes and layer ids are validated before any work
    layers = resolve_layers(tgt_cfg.num_hidden_layers, cc.layers, cc.num_layers)
    convs, sources_sha256 = cache_sources(cfg, storage, log_fn)
    shards = [convs[i : i + cc.shard_rows] for i in range(0, len(convs), cc.shard_rows)]

    manifest = Manifest(
        target={
            "name": cfg.target.name_or_path,
            "weights_sha256": targets.weights_hash(tgt_path),
            "num_layers": tgt_cfg.num_hidden_layers,
            "vocab_size": tgt_cfg.vocab_size,
        },
        tokenizer_sha256=targets.tokenizer_hash(tgt_path),
        layers=layers,
        hidden_size=tgt_cfg.hidden_size,
        codec=cc.codec,
        generation={
            "temperature": cc.temperature,
            "top_p": cc.top_p,
            "top_k": cc.top_k,
            "max_new_tokens": cc.max_new_tokens,
            "seed": cc.seed,
            **({"chat_template_kwargs": cfg.target.chat_template_kwargs} if cfg.target.chat_template_kwargs else {}),
        },
        corpus_sha256=sources_sha256,
    )
    settings = settings_of(manifest)
    if old is not None:
        diffs = differences(settings_of(old), settings)
        if len(old.shards) != len(shards):
            diffs.append(("shards", len(old.shards), len(shards)))
        if not diffs:
            log_fn(f"[cache] {uri} is complete: {old.rows} rows, {old.tokens:,} tokens; nothing to do")
            return old
        raise UserError(
            f"cache {uri} already holds a different build ({MANIFEST}: {describe(diffs)}); "
            f"choose another cache.name / cache.uri or delete it"
        )

    want = {i: shard_record(settings, [c.conv_id for c in shard]) for i, shard in enumerate(shards)}
    with CacheLock(storage, uri) as lock:
        done = published_stats(fs, root)
        check_resume(uri, done, want)
        stats = {i: st for i, (st, _) in done.items()}
        todo = [i for i in range(len(shards)) if i not in stats]
        log_fn(
            f"[cache] {uri}: {len(convs)} conversations in {len(shards)} shards, {len(stats)} already published; "
            f"layers {layers}, codec {cc.codec}"
        )
        if todo:
            _build_shards(cfg, uri, storage, layers, settings, shards, todo, stats, tracker, log_fn)
        manifest.shards = [stats[i] for i in range(len(shards))]
        lock.check()
        _put_atomic(fs, f"{root}/{MANIFEST}", manifest.to_json().encode(), f"{root}/_tmp")
        if fs.get_file_info(f"{root}/_tmp").type == pafs.FileType.Directory:
            fs.delete_dir(f"{root}/_tmp")  # leftovers of writers that crashed mid-file (no other builder runs)
    log_fn(
        f"[cache] published {uri}/{MANIFEST}: {manifest.rows} rows, {manifest.tokens:,} tokens, "
        f"{manifest.bytes / 2**20:.1f} MiB ({manifest.bytes / max(manifest.tokens, 1):,.0f} bytes/token)"
        + (f"; {manifest.skipped_turns} turns {TOO_LONG}" if manifest.skipped_turns else "")
    )
    return manifest


def _build_shards(
    cfg: Config,
    uri: str,
    storage: Storage,
    layers: list[int],
    settings: dict,
    shards: list,
    todo: list[int],
    stats: dict[int, ShardStats],
    tracker,
    log_fn,
) -> None:
    """Build the shards `todo` on a Ray Data actor pool; their stats land in `stats` as they finish."""
    import ray

    cc = cfg.cache
    items = [{"shard_id": i, "conversations": [c.to_json() for c in shards[i]]} for i in todo]
    quiet_ray_data()
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(
        ShardBuilder,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=cc.num_actors),
        num_gpus=cc.num_gpus_per_actor or None,
        num_cpus=1 if not cc.num_gpus_per_actor else None,
        fn_constructor_kwargs={
            "cfg_json": cfg.model_dump_json(),
            "cache_uri": uri,
            "layers": layers,
            "storage": storage,
            "settings": settings,
        },
    )
    t0 = time.perf_counter()
    rows = tokens = nbytes = 0
    for row in ds.iter_rows():
        s = ShardStats(**row["stats"])
        stats[s.shard_id] = s
        rows, tokens, nbytes = rows + s.rows, tokens + s.tokens, nbytes + s.bytes
        dt = time.perf_counter() - t0
        log_fn(
            f"[cache] shard {s.shard_id:5d} ({len(stats)}/{len(shards)}): {s.rows} rows, {s.tokens:,} tokens, "
            f"{s.bytes / 2**20:.1f} MiB in {row['seconds']:.1f}s | total {rows / dt:.2f} rows/s, "
            f"{tokens / dt:,.0f} tokens/s, {nbytes / 2**20:.1f} MiB written"
            + (f"; {s.skipped_turns} turns {TOO_LONG}" if s.skipped_turns else "")
        )
        if tracker:
            tracker.metrics(
                {
                    "cache.rows": rows,
                    "cache.tokens": tokens,
                    "cache.bytes": nbytes,
                    "cache.rows_per_s": rows / dt,
                    "cache.tokens_per_s": tokens / dt,
                },
                len(stats),
            )


def _law(generation: dict) -> dict:
    """The generation settings that fix the law of a cache's answers: all but the seed (and where a joined
    cache's rows came from), so caches sampled alike with other seeds join."""
    return {k: v for k, v in generation.items() if k not in ("seed", "transcoded_from")}


def _seeds(generations: list[dict]) -> dict:
    """A joined cache's seed: the sources' one, or each source's in order when they differ (a joined source
    contributes its list)."""
    seeds = [x for g in generations for x in (g["seed"] if isinstance(g.get("seed"), list) else [g.get("seed")])]
    return {} if len(set(seeds)) == 1 else {"seed": seeds}


def transcode(srcs: list[Cache], dst_uri: str, codec: str, layers: list[int] | None = None, log_fn=print) -> Manifest:
    """A cache derived from existing ones without re-running the target: the shards of `srcs` one after
    another (caches of one target, tap set and generation settings but the seed: more data without
    regenerating what is there, or more answers to the same prompts), in another codec (e.g. fp8) and/or
    with a subset of the tapped layers. Shard by shard, each
    published atomically, manifest last; shards already derived (with these settings, from these source
    shards) are skipped. A shard whose codec and layers stay is copied as it is; every source shard is
    verified as it is read."""
    for src in srcs:
        if Storage.same_place(src.uri, dst_uri):
            raise UserError(
                f"cache.source_uri and the destination are the same cache ({dst_uri}): set cache.name "
                f"or cache.uri to a new cache"
            )
    uris = [src.uri for src in srcs]
    again = sorted({u for u in uris if sum(Storage.same_place(u, v) for v in uris) > 1})
    if again:
        raise UserError(f"cache.source_uri names a cache more than once: {', '.join(again)}")
    m = srcs[0].manifest
    for src in srcs[1:]:  # rows of other targets, taps or sampling do not belong in one cache
        a, b = settings_of(src.manifest), settings_of(m)
        a["generation"], b["generation"] = _law(a["generation"]), _law(b["generation"])
        for key in ("target", "tokenizer_sha256", "layers", "hidden_size", "codec", "generation"):
            if a[key] != b[key]:
                raise UserError(
                    f"cache.source_uri: {src.uri} and {srcs[0].uri} differ in {key} ({a[key]!r:.60} and {b[key]!r:.60})"
                )
    layers = list(layers or m.layers)
    missing = [i for i in layers if i not in m.layers]
    if missing:
        raise UserError(f"cache.layers: {missing} are not in the source cache (it has {m.layers})")
    keep = [m.layers.index(i) for i in layers]
    copy = codec == m.codec and layers == m.layers
    fs, root = srcs[0].storage.pyarrow_fs(dst_uri)
    fs.create_dir(root, recursive=True)
    out = Manifest(
        target=m.target,
        tokenizer_sha256=m.tokenizer_sha256,
        layers=layers,
        hidden_size=m.hidden_size,
        codec=codec,
        generation={
            **m.generation,
            **_seeds([src.manifest.generation for src in srcs]),
            "transcoded_from": uris[0] if len(uris) == 1 else uris,
        },
        corpus_sha256=(
            m.corpus_sha256 if len(srcs) == 1 else sha256_of(" ".join(s.manifest.corpus_sha256 for s in srcs).encode())
        ),
    )
    todo = [(src, s) for src in srcs for s in src.manifest.shards]  # new shard id: the position in this list
    want = {i: {**settings_of(out), "source_sha256": s.sha256} for i, (_, s) in enumerate(todo)}
    with CacheLock(srcs[0].storage, dst_uri) as lock:
        done = published_stats(fs, root)
        check_resume(dst_uri, done, want)
        stats = {i: st for i, (st, _) in done.items()}
        for i, (src, s) in enumerate(todo):
            if i in stats:
                continue
            if copy or not s.rows:  # an empty shard (every turn skipped) has nothing to re-encode
                stats[i] = _publish(fs, root, replace(s, shard_id=i, file=shard_name(i)), shard_bytes(src, s), want[i])
                log_fn(f"[cache] copied {src.shard_uri(s)} as {shard_name(i)}")
                continue
            table = read_shard(src, s).read()
            rows = {k: table.column(k).to_pylist() for k in table.column_names}
            dec = decode_batch(rows, m)
            feats, last = [], []
            for r, n in enumerate(rows["num_tokens"]):
                feats.append(codecs.encode(dec["features"][r, :n][:, keep], codec))
                last.append(codecs.encode(dec["last_hidden"][r, :n], codec))
            rows["features"], rows["last_hidden"] = feats, last
            stats[i] = publish_shard(fs, root, i, rows, want[i], s.skipped_turns)
            log_fn(f"[cache] transcoded {src.shard_uri(s)}: {s.bytes / 2**20:.1f} -> {stats[i].bytes / 2**20:.1f} MiB")
        out.shards = [stats[i] for i in range(len(todo))]
        lock.check()
        _put_atomic(fs, f"{root}/{MANIFEST}", out.to_json().encode(), f"{root}/_tmp")
    return out
