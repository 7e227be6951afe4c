"""The cache pipeline for real: Ray Data actors build shards through s3:// on the local object store,
a streaming Ray Data read decodes them (and verifies their checksums), a build killed mid-way
finishes on rerun, a rerun with other settings is refused, the builder's lock works on S3, and the
user's JSONL conversations on s3:// are regenerated turn by turn by a non-built-in target with its
own chat template."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest
import torch
import transformers
from conftest import SMALL_CACHE, wait_for
from tiny_models import TINY

from dspark import target as targets
from dspark.cache.build import build_cache, cache_uri
from dspark.cache.format import MANIFEST
from dspark.cache.lock import CacheLock
from dspark.cache.read import check_shards, dataset, decode_batch, open_cache
from dspark.config import load_config
from dspark.corpus.conversations import parse_jsonl
from dspark.corpus.tokenizer import chat_ids
from dspark.errors import UserError
from dspark.services import BUCKET
from dspark.storage import Storage
from dspark.target.taps import extract

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _cfg(name, *extra):
    """The shared small cache's settings (conftest.SMALL_CACHE) for cache `name`, then `extra`."""
    return load_config(overrides=[*SMALL_CACHE, "mlflow.enabled=false", f"cache.name={name}", *extra])


def test_build_then_stream_back_bit_exact(small_cache):
    cfg, m = small_cache
    assert m.rows == 16 and len(m.shards) == 4 and m.layers == [1, 3, 5]
    storage = Storage.from_config(cfg.storage)
    cache = open_cache(cache_uri(cfg), storage, expect={"hidden_size": 256})
    assert len(check_shards(cache, verify_checksums=True)) == 4
    tgt = targets.load("builtin")
    seen = []
    for batch in dataset(cache).iter_batches(batch_size=4, batch_format="numpy"):
        t = decode_batch(batch, cache.manifest)
        for r in range(len(batch["seq_id"])):
            n = int(batch["num_tokens"][r])
            ids = t["input_ids"][r, :n].tolist()
            feats, last = extract(tgt.model, ids, m.layers)
            assert torch.equal(t["features"][r, :n], feats.to(torch.bfloat16).float())
            assert torch.equal(t["last_hidden"][r, :n], last.to(torch.bfloat16).float())
            seen.append(batch["seq_id"][r])
    assert len(seen) == 16 == len(set(seen))
    again = build_cache(cfg)  # complete: nothing rebuilt
    assert again.created == m.created


def _builders(ray_head) -> set[psutil.Process]:
    """The head's cache-builder actor processes."""
    found = set()
    for p in psutil.Process(ray_head.pid).children(recursive=True):
        try:
            if "ShardBuilder" in " ".join(p.cmdline()):
                found.add(p)
        except psutil.Error:
            pass
    return found


def test_killed_build_resumes_without_partial_or_duplicate_rows(ray_driver, ray_head, tmp_path):
    """jobs/build_cache.py on the Ray head is killed, driver and builder actor, once 2 of its 8 shards
    are published; the rerun publishes the others and the manifest."""
    settings = ["cache.max_examples=24", "cache.shard_rows=3"]
    cfg = _cfg("resume", *settings)
    storage = Storage.from_config(cfg.storage)
    fs, root = storage.pyarrow_fs(cache_uri(cfg))
    args = [sys.executable, str(ROOT / "jobs" / "build_cache.py")]
    for o in [
        *SMALL_CACHE,
        "mlflow.enabled=false",
        "cache.name=resume",
        *settings,
        f"ray.address={ray_head.env['DSPARK_RAY_GCS']}",
    ]:
        args += ["--set", o]
    others = _builders(ray_head)  # of earlier builds, if still exiting
    log = open(tmp_path / "build.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy())
    try:
        wait_for(
            lambda: (
                proc.poll() is not None
                or len(fs.get_file_info(pafs.FileSelector(f"{root}/_shards", allow_not_found=True))) >= 2
            ),
            300,
            "2 published shards",
            0.1,
        )
        assert proc.poll() is None, (tmp_path / "build.log").read_text()[-3000:]
        builders = _builders(ray_head) - others
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the build dies: its driver (Ray restarts no actor of a dead driver)...
        proc.wait()
    for p in builders:  # ...and its actor, now rather than when Ray gets to it
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert len(builders) == 1 and psutil.wait_procs(builders, timeout=60)[1] == []
    assert fs.get_file_info(f"{root}/manifest.json").type == pafs.FileType.NotFound  # not a cache yet
    sidecars = {i.base_name.removesuffix(".json") for i in fs.get_file_info(pafs.FileSelector(f"{root}/_shards"))}
    before = {i.base_name: i.mtime for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name in sidecars}
    assert 2 <= len(before) < 8  # a shard written without its sidecar yet is not published: it is built again
    logs = []
    m = build_cache(cfg, log_fn=logs.append)
    assert f"in 8 shards, {len(before)} already published" in logs[0]
    assert m.rows == 24 and len(m.shards) == 8
    cache = open_cache(cache_uri(cfg), storage)
    assert len(check_shards(cache, verify_checksums=True)) == 8
    ids = dataset(cache).select_columns(["seq_id"]).to_pandas()["seq_id"].tolist()
    assert len(ids) == 24 == len(set(ids))  # exact row count, no duplicates
    after = {i.base_name: i.mtime for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name in before}
    assert after == before  # finished shards were not rewritten
    leftovers = fs.get_file_info(pafs.FileSelector(f"{root}/_tmp", allow_not_found=True))
    assert leftovers == []


def _copy(storage: Storage, src_uri: str, dst_uri: str) -> None:
    """Every object under src_uri, copied under dst_uri (server-side on S3)."""
    fs, src = storage.pyarrow_fs(src_uri)
    dst = storage.pyarrow_fs(dst_uri)[1]
    for info in fs.get_file_info(pafs.FileSelector(src, recursive=True)):
        if info.type == pafs.FileType.File:
            fs.copy_file(info.path, dst + info.path[len(src) :])


def test_rerun_with_other_settings_is_refused_and_a_damaged_shard_stops_the_read(small_cache):
    """On a copy of the shared cache whose build "died" before its manifest: every shard is published."""
    cfg = _cfg("settings")
    storage = Storage.from_config(cfg.storage)
    fs, root = storage.pyarrow_fs(cache_uri(cfg))
    _copy(storage, cache_uri(small_cache[0]), cache_uri(cfg))
    first = open_cache(cache_uri(cfg), storage).manifest
    fs.delete_file(f"{root}/{MANIFEST}")  # the build died before its manifest: every shard is published
    for extra, named in (
        (["cache.codec=fp8"], "codec: 'bf16' there, 'fp8' now"),
        (["cache.temperature=0"], "generation.temperature: 0.8 there, 0.0 now"),
        (["cache.shard_rows=2"], "which examples each shard holds"),
    ):
        with pytest.raises(UserError, match="holds shards built with other settings") as e:
            build_cache(_cfg("settings", *extra))
        assert named in str(e.value) and "\n" not in str(e.value)
    again = build_cache(cfg, log_fn=lambda line: None)  # the original settings: finished without rebuilding
    assert again.shards == first.shards and again.codec == "bf16"

    with fs.open_input_stream(f"{root}/shard-00001.parquet") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF  # same size, footer intact: only the checksum can tell
    with fs.open_output_stream(f"{root}/shard-00001.parquet") as f:
        f.write(bytes(data))
    cache = open_cache(cache_uri(cfg), storage)
    with pytest.raises(Exception, match=r"shard s3://dspark/it/caches/settings/shard-00001.parquet is damaged: sha256"):
        for _ in dataset(cache).iter_batches(batch_size=4, batch_format="numpy"):
            pass


def test_the_lock_is_exclusive_on_the_object_store(object_store):
    storage = Storage.from_config(load_config().storage)
    uri = f"s3://{BUCKET}/it/caches/locked"
    with CacheLock(storage, uri) as lock:
        with pytest.raises(UserError, match=f"cache {uri} is being built by another builder"):
            CacheLock(storage, uri).acquire()
        with pytest.raises(OSError, match="pre-conditions"):  # the server honours If-None-Match (a 412)...
            with lock.fs.open(lock.path, "xb") as f:
                f.write(b"{}")
        lock.check()  # ...and the create overwrote nothing
    assert not lock.fs.exists(lock.path)


CHATML = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama target folder with the built-in tokenizer, a chat template unlike the built-in
    format (no BOS, newlines) and no pad token of its own (so pad is its EOS, as for SmolLM2)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tok = targets.tokenizer_for("builtin")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": 4, "max_position_embeddings": 512, "vocab_size": len(tok)},
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.chat_template, tok.pad_token = CHATML, None
    tok.save_pretrained(str(folder))
    return str(folder)


def test_jsonl_conversations_from_s3_on_a_tiny_llama(ray_driver, tiny_llama):
    """cache.sources = a JSONL file on s3:// in two formats, one conversation multi-turn: one row per
    assistant turn, each prompt the target's chat template over the conversation so far with the
    target's own earlier answers, each answer ending at its first EOS (pad == EOS). A prompt longer than the
    target's context (512 positions) is skipped and counted, and the build goes on."""
    records = [
        {"turns": ["Write a loop.", "Now in reverse."]},
        {
            "messages": [
                {"role": "system", "content": "terse"},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "dropped"},
            ]
        },
        {"prompt": "Bye"},
        {"prompt": "long " * 600},
    ]
    text = "\n".join(json.dumps(r) for r in records) + "\n"
    storage = Storage.from_config(load_config().storage)
    fs, path = storage.pyarrow_fs(f"s3://{BUCKET}/it/data/chats.jsonl")
    with fs.open_output_stream(path) as f:
        f.write(text.encode())
    cfg = _cfg(
        "tiny-llama",
        f"target.name_or_path={tiny_llama}",
        f"cache.sources=[s3://{BUCKET}/it/data/chats.jsonl]",
        "cache.shard_rows=2",
        "cache.max_new_tokens=6",
        "cache.temperature=1.0",
        "cache.layers=[1,3]",
    )
    logs = []
    m = build_cache(cfg, log_fn=logs.append)
    assert m.skipped_turns == 1 and [s.skipped_turns for s in m.shards] == [0, 1]
    assert "1 turns skipped: their prompts leave no room in the target's context" in logs[-1]
    assert m.rows == 4 and len(m.shards) == 2 and m.layers == [1, 3] and m.hidden_size == TINY["hidden_size"]
    tok = targets.tokenizer_from_config(cfg.target)
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos
    rows = dataset(open_cache(cache_uri(cfg), storage)).to_pandas().set_index("seq_id")
    assert sorted(rows.index) == ["chats:1", "chats:1/turn2", "chats:2", "chats:3"]
    answers = {}
    for conv in parse_jsonl(text, "chats.jsonl", "chats")[0][:3]:
        for t in range(len(conv.turns)):
            row = rows.loc[conv.conv_id if t == 0 else f"{conv.conv_id}/turn{t + 1}"]
            ids, mask = list(row["input_ids"]), list(row["loss_mask"])
            n = mask.index(1)
            assert ids[:n] == chat_ids(tok, conv.messages(answers.get(conv.conv_id, [])))  # the target's template
            assert not any(mask[:n]) and all(mask[n:])
            resp = ids[n:]
            assert (resp[-1] == eos and eos not in resp[:-1]) or (len(resp) == 6 and eos not in resp)
            answers.setdefault(conv.conv_id, []).append(tok.decode(resp, skip_special_tokens=True))
