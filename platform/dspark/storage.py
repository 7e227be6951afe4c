"""One storage settings object for every job: `s3://bucket/prefix`, `file://path` and plain paths
resolve to pyarrow and fsspec filesystems.

Endpoint, credentials and region come from the config or the standard AWS environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION). Both clients retry with
the AWS "standard" strategy so a short object-store outage does not kill a job.

Note: pyarrow's S3FileSystem drops its retry strategy when pickled (e.g. shipped to Ray workers);
code that runs remotely should carry a `Storage` (which pickles its settings) and build the
filesystem where it runs.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

from dspark.errors import UserError


@dataclass(frozen=True)
class Storage:
    endpoint_url: str | None = None
    region: str | None = None
    retry_attempts: int = 10
    access_key: str | None = field(default=None, repr=False)  # credentials never show in reprs or logs
    secret_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg) -> "Storage":
        """`cfg` is a dspark.config.StorageConfig; unset fields fall back to the environment."""
        env = os.environ
        return cls(
            endpoint_url=cfg.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
            region=cfg.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            retry_attempts=cfg.retry_attempts,
            access_key=env.get("AWS_ACCESS_KEY_ID"),
            secret_key=env.get("AWS_SECRET_ACCESS_KEY"),
        )

    # -- URIs
    @staticmethod
    def is_remote(uri: str) -> bool:
        return uri.startswith("s3://")

    @staticmethod
    def path_of(uri: str) -> str:
        """The filesystem path: "bucket/prefix" for s3://, an absolute local path otherwise."""
        if uri.startswith("s3://"):
            return uri[len("s3://") :].rstrip("/")
        if uri.startswith("file://"):
            return urlparse(uri).path
        return str(Path(uri).resolve())

    @staticmethod
    def join(uri: str, *parts: str) -> str:
        """A URI stays a URI (a path would turn file:///x into file:/x, a relative folder)."""
        if Storage.is_remote(uri) or uri.startswith("file://"):
            return posixpath.join(uri.rstrip("/"), *parts)
        return str(Path(uri, *parts))

    # -- filesystems
    def pyarrow_fs(self, uri: str) -> tuple[pafs.FileSystem, str]:
        if not self.is_remote(uri):
            return pafs.LocalFileSystem(), self.path_of(uri)
        kwargs = dict(
            region=self.region,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=self.retry_attempts),
            connect_timeout=5,
            request_timeout=30,
        )
        if self.access_key and self.secret_key:
            kwargs.update(access_key=self.access_key, secret_key=self.secret_key)
        if self.endpoint_url:
            u = urlparse(self.endpoint_url)
            kwargs.update(endpoint_override=u.netloc, scheme=u.scheme or "https")
        return pafs.S3FileSystem(**kwargs), self.path_of(uri)

    def fsspec_fs(self, uri: str):
        import fsspec

        if not self.is_remote(uri):
            return fsspec.filesystem("file"), self.path_of(uri)
        import s3fs

        fs = s3fs.S3FileSystem(
            key=self.access_key,
            secret=self.secret_key,
            endpoint_url=self.endpoint_url,
            client_kwargs={"region_name": self.region},
            config_kwargs={
                "retries": {"max_attempts": self.retry_attempts, "mode": "standard"},
                "connect_timeout": 5,
                "read_timeout": 30,
            },
            skip_instance_cache=True,
        )
        return fs, self.path_of(uri)

    @staticmethod
    def same_place(a: str, b: str) -> bool:
        """Whether two URIs name the same folder (local paths compared after resolving links)."""
        if Storage.is_remote(a) or Storage.is_remote(b):
            return Storage.is_remote(a) and Storage.is_remote(b) and Storage.path_of(a) == Storage.path_of(b)
        return Path(Storage.path_of(a)).resolve() == Path(Storage.path_of(b)).resolve()

    def upload_dir(self, local: str | Path, uri: str) -> None:
        """Copy a local folder's files to uri (a local path or s3:// prefix); nothing to do when uri is
        that folder (a local storage root hands out its own folders, see download_dir)."""
        import shutil

        if not self.is_remote(uri):
            if not self.same_place(str(local), uri):
                shutil.copytree(local, self.path_of(uri), dirs_exist_ok=True)
            return
        fs, path = self.fsspec_fs(uri)
        for f in sorted(Path(local).iterdir()):
            if f.is_file():
                fs.put_file(str(f), f"{path}/{f.name}")

    def download_dir(self, uri: str, dest: str | Path, only: tuple[str, ...] = ()) -> Path:
        """A local folder holding uri's files (`only`: just these names, where present): the folder
        itself when uri is local."""
        if not self.is_remote(uri):
            if not Path(self.path_of(uri)).is_dir():
                raise UserError(f"folder not found: {uri}")
            return Path(self.path_of(uri))
        # pyarrow, not s3fs: inside a running event loop (a Serve replica loading its drafter) s3fs's finalizer
        # closes its session on that loop instead of its own and prints an unretrieved-task traceback
        fs, path = self.pyarrow_fs(uri)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        found = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        files = [f for f in found if f.type == pafs.FileType.File and (not only or f.base_name in only)]
        if not files and not only:
            raise UserError(f"nothing found at {uri}")
        local = pafs.LocalFileSystem()
        for f in files:
            pafs.copy_files(f.path, str(dest / f.base_name), source_filesystem=fs, destination_filesystem=local)
        return dest

    def check(self, uri: str) -> None:
        """Fail fast, with one line naming the endpoint or bucket, if `uri` cannot be used."""
        if not self.is_remote(uri):
            return
        bucket = self.path_of(uri).split("/")[0]
        quick = Storage(self.endpoint_url, self.region, 1, self.access_key, self.secret_key)
        fs, _ = quick.pyarrow_fs(uri)
        where = self.endpoint_url or "AWS S3"
        try:
            info = fs.get_file_info(bucket)
        except OSError as e:
            msg = str(e)
            if "ACCESS_DENIED" in msg or "InvalidAccessKeyId" in msg or "SignatureDoesNotMatch" in msg or "403" in msg:
                raise UserError(
                    f"object store {where} rejected the credentials (AWS_ACCESS_KEY_ID) for bucket '{bucket}'"
                ) from None
            raise UserError(f"object store {where} is unreachable for {uri}: {msg.splitlines()[0]}") from None
        if info.type == pafs.FileType.NotFound:
            raise UserError(f"bucket '{bucket}' does not exist on object store {where}")
