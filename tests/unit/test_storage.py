import pyarrow.fs as pafs

from dspark.config import load_config
from dspark.storage import Storage


def test_uri_forms_resolve(tmp_path):
    assert Storage.path_of("s3://bucket/a/b/") == "bucket/a/b"
    assert Storage.path_of(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    assert Storage.path_of("rel/x").endswith("/rel/x")
    assert Storage.join("s3://b/p", "c", "d.parquet") == "s3://b/p/c/d.parquet"
    assert Storage.join(str(tmp_path), "c") == str(tmp_path / "c")
    assert Storage.join(f"file://{tmp_path}/", "c", "d") == f"file://{tmp_path}/c/d"  # a storage.root of file://
    assert Storage.path_of(Storage.join(f"file://{tmp_path}", "c")) == f"{tmp_path}/c"


def test_settings_come_from_config_then_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    s = Storage.from_config(load_config().storage)
    assert s.endpoint_url == "http://127.0.0.1:9" and s.region == "eu-west-1"
    s = Storage.from_config(load_config(overrides=["storage.endpoint_url=http://127.0.0.1:7"]).storage)
    assert s.endpoint_url == "http://127.0.0.1:7"


def test_filesystems_for_each_scheme(tmp_path):
    s = Storage(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    fs, path = s.pyarrow_fs("s3://bucket/prefix")
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/prefix"
    fs, path = s.pyarrow_fs(f"file://{tmp_path}")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path)
    s.check(str(tmp_path))  # local paths need no check


def test_upload_of_a_local_folder_onto_itself_keeps_it(tmp_path):
    """download_dir of a local URI is the folder itself; uploading it back (train_dspark, quickstart)
    must neither fail nor lose a file."""
    s = Storage()
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights")
    local = s.download_dir(f"file://{d}", tmp_path / "unused")
    assert local == d
    (local / "calibration.json").write_text("{}")
    s.upload_dir(local, f"file://{d}")
    s.upload_dir(str(tmp_path / "." / "drafter"), str(d))
    assert sorted(p.name for p in d.iterdir()) == ["calibration.json", "model.safetensors"]
    assert (d / "model.safetensors").read_bytes() == b"weights"
    s.upload_dir(d, str(tmp_path / "copy"))  # another folder: copied
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["calibration.json", "model.safetensors"]
    assert Storage.same_place("s3://b/p/", "s3://b/p") and not Storage.same_place("s3://b/p", "/b/p")
