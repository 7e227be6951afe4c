"""Cache format without Ray: codecs, shards written by the builder's own functions, validation,
the size estimator, read-back against a fresh target forward, checksums verified on read, and
transcodes that must not overwrite their source or reuse shards built with other settings."""

import json
import logging
import shutil

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from dspark import target as targets
from dspark.cache import codec as codecs
from dspark.cache.build import build_cache, make_rows, publish_shard, regenerate, transcode, turn_rows
from dspark.cache.format import MANIFEST, SCHEMA, Manifest, estimate_bytes
from dspark.cache.lock import CacheLock
from dspark.cache.read import CacheError, check_shards, decode_batch, iter_local, open_cache
from dspark.config import load_config
from dspark.corpus.conversations import Conversation
from dspark.corpus.examples import split_examples
from dspark.corpus.sources import Corpus
from dspark.errors import UserError
from dspark.storage import Storage
from dspark.target.taps import default_layers, extract, resolve_layers

LAYERS = [1, 2, 3]


def test_default_layers_match_the_paper_and_validate():
    assert default_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_layers(6, 3) == [1, 3, 5]  # the built-in target: spread to its top layer
    assert default_layers(30, 3) == [1, 14, 27]  # SmolLM2-135M
    assert default_layers(1, 3) == [0]
    with pytest.raises(Exception, match=r"cache.layers: layer ids \[6\] out of range"):
        resolve_layers(6, [1, 6], 3)
    with pytest.raises(Exception, match="distinct and increasing"):
        resolve_layers(6, [3, 1], 3)


def test_extract_reads_the_targets_own_hidden_states():
    """The tapped layers' outputs and the final norm's, as the target's own forward computes them (extract
    skips the LM head over all but the last token: its logits are not read)."""
    model = targets.load("builtin").model
    ids = list(range(10, 40))
    feats, last = extract(model, ids, LAYERS)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert feats.shape == (len(ids), len(LAYERS), model.config.hidden_size)
    for j, i in enumerate(LAYERS):
        torch.testing.assert_close(feats[:, j], out.hidden_states[i + 1][0])
    torch.testing.assert_close(last, out.hidden_states[-1][0])


def test_codecs_roundtrip_and_fp8_error_bound():
    x = torch.randn(50, 3, 256) * torch.logspace(-3, 2, 50)[:, None, None]
    bf = codecs.decode(codecs.encode(x, "bf16"), "bf16", 256).reshape(x.shape)
    assert torch.equal(bf, x.to(torch.bfloat16).float())  # bit-exact bf16
    f8 = codecs.decode(codecs.encode(x, "fp8"), "fp8", 256).reshape(x.shape)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((f8 - x).abs() <= 2**-4 * x.abs() + amax * 2**-10 / 448 + 1e-12).all()
    assert len(codecs.encode(x, "fp8")) == 150 * (256 + 4) and len(codecs.encode(x, "bf16")) == 150 * 512
    with pytest.raises(ValueError, match="not a whole number"):
        codecs.decode(b"\x00" * 7, "bf16", 256)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two shards (bf16 and fp8 copies) of real rows from the built-in target."""
    tgt = targets.load("builtin")
    cfg = load_config(overrides=["cache.max_new_tokens=24"])
    exs = split_examples(Corpus.load(cfg.corpus), "code", "heldout", cfg.corpus)[:6]
    convs = [Conversation(e.example_id, e.domain, (e.prompt,)) for e in exs]
    turns = regenerate(tgt.model, tgt.tokenizer, convs, cfg.cache, 0, tgt.eos_token_ids)
    ids, _, seqs, n_prompt = turn_rows(convs, turns)
    out = {}
    for codec in ("bf16", "fp8"):
        root = tmp_path_factory.mktemp(codec)
        fs = pafs.LocalFileSystem()
        stats = [
            publish_shard(
                fs,
                str(root),
                i,
                make_rows(
                    tgt.model,
                    LAYERS,
                    codec,
                    ids[3 * i : 3 * i + 3],
                    ["code"] * 3,
                    seqs[3 * i : 3 * i + 3],
                    n_prompt[3 * i : 3 * i + 3],
                ),
            )
            for i in range(2)
        ]
        m = Manifest(
            target={"name": "builtin", "weights_sha256": tgt.weights_sha256},
            tokenizer_sha256="",
            layers=LAYERS,
            hidden_size=tgt.config.hidden_size,
            codec=codec,
            generation={},
            corpus_sha256="",
            shards=stats,
        )
        (root / MANIFEST).write_text(m.to_json())
        out[codec] = str(root)
    return tgt, seqs, n_prompt, out


def _rows(cache):
    fs, root = cache.fs_root
    tables = [pq.read_table(f"{root}/{s.file}", filesystem=fs) for s in cache.manifest.shards]
    return {k: sum((t.column(k).to_pylist() for t in tables), []) for k in tables[0].column_names}


def test_read_back_equals_a_fresh_forward(built):
    tgt, seqs, n_prompt, roots = built
    for codec in ("bf16", "fp8"):
        cache = open_cache(
            roots[codec], Storage(), expect={"layers": LAYERS, "target.weights_sha256": tgt.weights_sha256}
        )
        batch = decode_batch(_rows(cache), cache.manifest)
        for r, ids in enumerate(seqs):
            feats, last = extract(tgt.model, ids, LAYERS)  # fresh forward, one sequence
            n = len(ids)
            assert batch["input_ids"][r, :n].tolist() == ids
            assert batch["loss_mask"][r, :n].sum() == n - n_prompt[r] and not batch["valid"][r, n:].any()
            got_f, got_l = batch["features"][r, :n], batch["last_hidden"][r, :n]
            if codec == "bf16":
                assert torch.equal(got_f, feats.to(torch.bfloat16).float())
                assert torch.equal(got_l, last.to(torch.bfloat16).float())
            else:
                amax = feats.abs().amax(-1, keepdim=True)
                assert ((got_f - feats).abs() <= 2**-4 * feats.abs() + amax * 2**-10 / 448 + 1e-6).all()


def test_estimator_within_five_percent(built):
    _, _, _, roots = built
    for codec in ("bf16", "fp8"):
        m = open_cache(roots[codec], Storage()).manifest
        est = estimate_bytes(m.hidden_size, len(m.layers), m.tokens, codec, rows=m.rows)
        assert abs(est - m.bytes) / m.bytes < 0.05, (codec, est, m.bytes)


def test_manifest_mismatch_names_the_field(built):
    _, _, _, roots = built
    with pytest.raises(CacheError, match=r"layers is \[1, 2, 3\], expected \[1, 3, 5\]"):
        open_cache(roots["bf16"], Storage(), expect={"layers": [1, 3, 5]})
    with pytest.raises(CacheError, match="target.weights_sha256"):
        open_cache(roots["bf16"], Storage(), expect={"target.weights_sha256": "0" * 64})
    with pytest.raises(CacheError, match="manifest.json not found"):
        open_cache(roots["bf16"] + "/nope", Storage())


def test_damaged_shards_are_named_or_skipped_with_a_count(built, tmp_path, caplog):
    _, _, _, roots = built
    root = tmp_path / "copy"
    shutil.copytree(roots["bf16"], root)
    cache = open_cache(str(root), Storage())
    assert len(check_shards(cache, verify_checksums=True)) == 2
    s1 = root / "shard-00001.parquet"
    data = bytearray(s1.read_bytes())
    data[len(data) // 2] ^= 0xFF  # corrupt the middle: same size, footer intact
    s1.write_bytes(bytes(data))
    check_shards(cache)  # cheap checks cannot see it...
    with pytest.raises(CacheError, match=r"shard .*shard-00001.parquet is damaged: sha256"):
        check_shards(cache, verify_checksums=True)  # ...the checksum does
    s0 = root / "shard-00000.parquet"
    s0.write_bytes(s0.read_bytes()[:-100])  # truncated
    with pytest.raises(CacheError, match=r"shard-00000.parquet is damaged: size"):
        check_shards(cache)
    with caplog.at_level(logging.WARNING):
        good = check_shards(cache, skip_bad=True)
    assert [s.file for s in good] == ["shard-00001.parquet"]
    assert "skipped 1 bad shard(s) of 2: shard-00000.parquet" in caplog.text


def test_undecodable_row_names_row_and_shard(built):
    _, _, _, roots = built
    cache = open_cache(roots["bf16"], Storage())
    rows = _rows(cache)
    rows["features"][1] = rows["features"][1][:-3]
    rows["path"] = ["shard-00000.parquet"] * len(rows["seq_id"])
    with pytest.raises(CacheError, match=r"row '.*' of shard shard-00000.parquet cannot be decoded"):
        decode_batch(rows, cache.manifest)


def test_tensor_columns_have_no_dictionary_encoding(built):
    _, _, _, roots = built
    meta = pq.read_metadata(f"{roots['bf16']}/shard-00000.parquet")
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    for name in ("features", "last_hidden"):
        col = meta.row_group(0).column(names.index(name))
        assert "RLE_DICTIONARY" not in col.encodings and "PLAIN_DICTIONARY" not in col.encodings
    assert np.isclose(estimate_bytes(256, 3, 1000, "bf16"), 1000 * (4 * 512 + 5))


def _corrupt_copy(root: str, dest) -> str:
    """A copy of the cache whose shard-00001 has one byte flipped mid-file: same size, footer intact."""
    shutil.copytree(root, dest)
    s1 = dest / "shard-00001.parquet"
    data = bytearray(s1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    s1.write_bytes(bytes(data))
    return str(dest)


def test_reading_rows_verifies_each_shards_checksum(built, tmp_path):
    _, _, _, roots = built
    cache = open_cache(_corrupt_copy(roots["bf16"], tmp_path / "bad"), Storage())
    check_shards(cache)  # the cheap checks at the start of training cannot see it
    with pytest.raises(CacheError, match=r"shard .*/bad/shard-00001.parquet is damaged: sha256 differs"):
        list(iter_local(cache, batch_size=2))
    with pytest.raises(CacheError, match=r"shard .*/bad/shard-00001.parquet is damaged: sha256 differs"):
        transcode([cache], str(tmp_path / "fp8"), "fp8")
    assert sum(len(b["input_ids"]) for b in iter_local(open_cache(roots["bf16"], Storage()), batch_size=2)) == 6


def test_transcode_onto_its_source_is_refused(built):
    _, _, _, roots = built
    src = open_cache(roots["bf16"], Storage())
    for dst in (roots["bf16"], f"file://{roots['bf16']}/"):
        with pytest.raises(UserError) as e:
            transcode([src], dst, "fp8")
        assert "cache.source_uri and the destination are the same cache" in str(e.value) and "\n" not in str(e.value)
    assert open_cache(roots["bf16"], Storage()).manifest.codec == "bf16"  # the source is untouched


def test_a_second_builder_on_one_cache_is_refused(built, tmp_path):
    _, _, _, roots = built
    src = open_cache(roots["bf16"], Storage())
    dst = tmp_path / "fp8"
    dst.mkdir()
    with CacheLock(Storage(), str(dst)):  # another builder is at work on it
        with pytest.raises(UserError, match=f"cache {dst} is being built by another builder"):
            transcode([src], str(dst), "fp8")
    assert transcode([src], str(dst), "fp8").rows == 6 and sorted(p.name for p in dst.iterdir()) == [
        "_shards",
        "_tmp",
        MANIFEST,
        "shard-00000.parquet",
        "shard-00001.parquet",
    ]


def test_resumed_transcode_with_other_settings_is_refused_naming_the_keys(built, tmp_path):
    _, _, _, roots = built
    src = open_cache(roots["bf16"], Storage())
    dst = tmp_path / "small"
    first = transcode([src], str(dst), "fp8", [1, 3])
    (dst / MANIFEST).unlink()  # the first run died before its manifest
    with pytest.raises(
        UserError,
        match=r"holds shards built with other settings: codec: 'fp8' there, 'bf16' now; "
        r"layers: \[1, 3\] there, \[1, 2, 3\] now; rerun with the settings",
    ):
        transcode([src], str(dst), "bf16")
    assert not (dst / MANIFEST).exists()
    again = transcode([src], str(dst), "fp8", [1, 3], log_fn=pytest.fail)  # same settings: every shard reused
    assert again.shards == first.shards and open_cache(str(dst), Storage()).manifest.codec == "fp8"


def test_caches_built_alike_join_into_one_whose_shards_are_theirs(built, tmp_path):
    _, _, _, roots = built
    more = str(shutil.copytree(roots["bf16"], tmp_path / "more"))  # another cache built with the same settings
    srcs = [open_cache(roots["bf16"], Storage()), open_cache(more, Storage())]
    dst = tmp_path / "both"
    logged: list[str] = []
    m = transcode(srcs, str(dst), "bf16", log_fn=logged.append)
    assert [s.shard_id for s in m.shards] == [0, 1, 2, 3] and m.rows == 12 and len(logged) == 4
    assert [s.sha256 for s in m.shards] == [s.sha256 for c in srcs for s in c.manifest.shards]  # copied as they are
    joined = open_cache(str(dst), Storage())
    assert joined.manifest.generation["transcoded_from"] == [c.uri for c in srcs]
    assert _rows(joined)["seq_id"] == _rows(srcs[0])["seq_id"] * 2
    assert sum(len(b["input_ids"]) for b in iter_local(joined, batch_size=4)) == 12  # every shard verifies

    (dst / MANIFEST).unlink()  # the first run died after its third shard
    (dst / "shard-00003.parquet").unlink()
    (dst / "_shards" / "shard-00003.parquet.json").unlink()
    logged.clear()
    assert transcode(srcs, str(dst), "bf16", log_fn=logged.append).shards == m.shards
    assert logged == [f"[cache] copied {srcs[1].shard_uri(srcs[1].manifest.shards[1])} as shard-00003.parquet"]

    small = transcode(srcs, str(tmp_path / "small"), "fp8", [1, 3], log_fn=logged.append)
    assert small.rows == 12 and open_cache(str(tmp_path / "small"), Storage()).manifest.layers == [1, 3]


def test_a_shard_whose_turns_were_all_skipped_reads_and_transcodes(built, tmp_path):
    """Every turn of a shard's conversations too long for the target: an empty shard, counted in the manifest,
    that a read passes over and a transcode to another codec and tap set keeps."""
    _, _, _, roots = built
    root = shutil.copytree(roots["bf16"], tmp_path / "with-empty")
    m = open_cache(str(root), Storage()).manifest
    m.shards.append(publish_shard(pafs.LocalFileSystem(), str(root), 2, {f.name: [] for f in SCHEMA}, None, 3))
    (root / MANIFEST).write_text(m.to_json())
    cache = open_cache(str(root), Storage())
    assert cache.manifest.skipped_turns == 3 and cache.manifest.rows == 6
    assert sum(len(b["input_ids"]) for b in iter_local(cache, batch_size=4)) == 6
    small = transcode([cache], str(tmp_path / "small"), "fp8", [1, 3], log_fn=lambda _: None)
    assert small.rows == 6 and small.skipped_turns == 3 and [s.rows for s in small.shards] == [3, 3, 0]


def _resampled(root: str, dst, **generation) -> str:
    """A copy of the cache at root whose manifest states other generation settings (as if built with them)."""
    out = shutil.copytree(root, dst)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["generation"].update(generation)
    (out / MANIFEST).write_text(json.dumps(manifest))
    return str(out)


def test_answers_sampled_with_another_seed_join_and_the_joined_cache_names_both_seeds(built, tmp_path):
    _, _, _, roots = built
    law = {"temperature": 0.8, "top_p": 0.95}
    first, second, third = (
        open_cache(_resampled(roots["bf16"], tmp_path / f"seed{i}", seed=i, **law), Storage()) for i in range(3)
    )
    m = transcode([first, second], str(tmp_path / "both"), "bf16", log_fn=lambda _: None)
    assert m.rows == 2 * first.manifest.rows
    both = open_cache(str(tmp_path / "both"), Storage())
    assert both.manifest.generation == {**law, "seed": [0, 1], "transcoded_from": [first.uri, second.uri]}
    # a joined cache joins again (its own sources named, every seed listed in order)
    m = transcode([both, third], str(tmp_path / "all"), "bf16", log_fn=lambda _: None)
    assert m.rows == 3 * first.manifest.rows
    assert open_cache(str(tmp_path / "all"), Storage()).manifest.generation["seed"] == [0, 1, 2]
    hotter = open_cache(_resampled(roots["bf16"], tmp_path / "hot", seed=3, temperature=1.5), Storage())
    with pytest.raises(UserError, match=r"differ in generation"):  # another law of answers does not join
        transcode([first, hotter], str(tmp_path / "mixed"), "bf16")


def test_joining_caches_built_otherwise_or_one_cache_twice_is_refused(built, tmp_path):
    _, _, _, roots = built
    bf16, fp8 = open_cache(roots["bf16"], Storage()), open_cache(roots["fp8"], Storage())
    with pytest.raises(
        UserError, match=rf"cache.source_uri: {fp8.uri} and {bf16.uri} differ in codec \('fp8' and 'bf16'\)"
    ):
        transcode([bf16, fp8], str(tmp_path / "mixed"), "bf16")
    with pytest.raises(UserError, match=f"cache.source_uri names a cache more than once: {bf16.uri}"):
        transcode([bf16, open_cache(f"file://{roots['bf16']}", Storage())], str(tmp_path / "twice"), "bf16")
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "twice").exists()


def test_a_damaged_manifest_is_one_line_naming_it(tmp_path):
    cfg = load_config(overrides=[f"storage.root={tmp_path}", "cache.max_examples=4", "mlflow.enabled=false"])
    root = tmp_path / "caches" / "builtin"
    root.mkdir(parents=True)
    for text in (b"{", b"[]", b"null", b'{"shards": [1]}', b'{"shards": "none"}', b"\xff\xfe"):
        (root / MANIFEST).write_bytes(text)
        with pytest.raises(CacheError) as e:
            open_cache(str(root), Storage())
        assert str(e.value).startswith(f"{root}/{MANIFEST} is not a valid manifest (") and "\n" not in str(e.value)
    with pytest.raises(CacheError) as e:  # the builder reads it the same way, before any work
        build_cache(cfg)
    assert str(e.value).startswith(f"{root}/{MANIFEST} is not a valid manifest (")
    assert (root / MANIFEST).read_bytes() == b"\xff\xfe"  # nothing overwritten
