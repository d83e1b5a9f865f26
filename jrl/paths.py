"""Paths a run reads and writes: local paths as before, and URLs (gs://, ...) through etils.epath.

    workdir = paths.resolve(workdir)      # local: os.path.abspath; a URL: kept as it is
    paths.check_url("--workdir", workdir, WORKDIR_SCHEMES)  # ValueError naming key and package
    with paths.open_file(os.path.join(workdir, "config.json"), "w") as f: ...

A URL is `scheme://...`; anything else is a local path, which every function here hands to the
os module, open and shutil exactly as jrl did before URLs. etils.epath (etils 1.x) serves four
schemes, gs://, s3://, az:// and hf://, through fsspec and the scheme's package (gcsfs, s3fs,
adlfs, huggingface_hub), or through TensorFlow's tf.io.gfile when tensorflow is installed (and
EPATH_USE_TF is not false). Where a URL may be used:

- data files (data.path, data.eval_path) and exports (--export-hf, --export-peft): any of the
  four (an export is written locally, then uploaded file by file: upload_directory);
- a workdir: gs:// only, because it holds the checkpoints and Orbax writes arrays through
  TensorStore to local paths and gs:// only (any other URL is a relative local path to it),
  and lists a bucket's steps with google-cloud-storage (check_checkpoint_listing);
- model.path: local only (the weights are memory-mapped).

An object store has no rename, lock or append: jrl.pipeline.loop.workdir says what a gs:// workdir
does not guarantee, and jrl.metrics.writers.JsonlWriter rewrites metrics.jsonl whole.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import re
import shutil
from typing import IO

EPATH_SCHEMES = ("gs", "s3", "az", "hf")
WORKDIR_SCHEMES = ("gs",)
# The fsspec protocol etils.epath opens each scheme with, and the package that provides it.
_FSSPEC = {"gs": ("gcs", "gcsfs"), "s3": ("s3", "s3fs"), "az": ("az", "adlfs"),
           "hf": ("hf", "huggingface_hub")}
# Orbax marks a finished step on an object store with this file (atomicity.CommitFileTemporary
# Path) instead of renaming its temporary folder, as it does on a local disk.
ORBAX_COMMIT_FILE = "commit_success.txt"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(path: str | os.PathLike | None) -> str | None:
    """"gs" for "gs://bucket/run"; None for a local path (or None)."""
    if path is None:
        return None
    match = _URL.match(os.fspath(path))
    return match.group(1).lower() if match else None


def is_url(path: str | os.PathLike | None) -> bool:
    return url_scheme(path) is not None


def _label(key: str, path: str) -> str:
    """How an error names where the path came from: a flag ("--workdir 'x'") or a config key
    ("data.path='x'")."""
    return f"{key} {path!r}" if key.startswith("-") else f"{key}={path!r}"


def check_scheme(key: str, path: str | None, allowed: tuple[str, ...] = EPATH_SCHEMES) -> None:
    """ValueError naming `key` when `path` is a URL whose scheme is not in `allowed` (a local
    path or None passes). Needs nothing installed, so configs check it when they load."""
    scheme = url_scheme(path)
    if scheme is None or scheme in allowed:
        return
    if allowed == WORKDIR_SCHEMES and scheme in EPATH_SCHEMES:
        raise ValueError(f"{_label(key, path)}: a workdir URL must be gs://: it holds the run's "
                         "checkpoints, which Orbax writes (through TensorStore) to local paths "
                         "and gs:// only; use a gs:// or a local workdir")
    raise ValueError(f"{_label(key, path)}: jrl reads and writes URLs of "
                     f"{', '.join(s + '://' for s in allowed)} (etils.epath); {scheme}:// is not "
                     "one of them")


def _tensorflow_serves_urls() -> bool:
    """etils.epath's own choice (etils.epath.gpath._is_tf_installed): with tensorflow installed
    and EPATH_USE_TF not false, URLs go through tf.io.gfile instead of fsspec."""
    if os.environ.get("EPATH_USE_TF", "").lower() in ("false", "no", "f", "0"):
        return False
    return importlib.util.find_spec("tensorflow") is not None


def check_backend(key: str, path: str | None) -> None:
    """ValueError naming `key` and the package to install when the filesystem package that
    etils.epath needs for the URL `path` is missing (a local path or None passes)."""
    scheme = url_scheme(path)
    if scheme is None or scheme not in _FSSPEC or _tensorflow_serves_urls():
        return
    import fsspec
    protocol, package = _FSSPEC[scheme]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        raise ValueError(f"{_label(key, path)}: {scheme}:// paths need the {package} package "
                         f"(etils.epath opens them with fsspec and {package}, or with "
                         "tf.io.gfile where tensorflow is installed), which is not installed: "
                         f"pip install {package}") from None


def check_checkpoint_listing(key: str, path: str | None) -> None:
    """ValueError naming `key` when `path` is a gs:// checkpoint directory and
    google-cloud-storage is missing: Orbax (0.12) asks the bucket's API whether it has a
    hierarchical namespace before it lists the steps there (gcsfs depends on the package, so
    `pip install gcsfs` brings both; tf.io.gfile does not)."""
    if url_scheme(path) != "gs":
        return
    try:
        found = importlib.util.find_spec("google.cloud.storage") is not None
    except ImportError:      # no google.cloud namespace at all
        found = False
    if not found:
        raise ValueError(f"{_label(key, path)}: checkpoints on gs:// need the "
                         "google-cloud-storage package (Orbax lists a bucket's checkpoint steps "
                         "with it), which is not installed: pip install google-cloud-storage "
                         "(gcsfs brings it)")


def check_url(key: str, path: str | None, allowed: tuple[str, ...] = EPATH_SCHEMES) -> None:
    """check_scheme, then check_backend: what a URL needs before a run writes anything."""
    check_scheme(key, path, allowed)
    check_backend(key, path)


def resolve(path: str | os.PathLike) -> str:
    """A local path made absolute (os.path.abspath); a URL as it is, less a trailing slash."""
    path = os.fspath(path)
    if not is_url(path):
        return os.path.abspath(path)
    scheme_end = path.index("://") + 3
    return path[:scheme_end] + path[scheme_end:].rstrip("/")


def as_epath(path: str | os.PathLike):
    """An etils.epath.Path of `path` (Orbax takes these, and a URL's string would also do)."""
    from etils import epath
    return epath.Path(os.fspath(path))


# ------------------------------------------------------------------------------------------------
# File operations: the os module for a local path, etils.epath for a URL.

def exists(path: str) -> bool:
    return as_epath(path).exists() if is_url(path) else os.path.exists(path)


def require_path(key: str, path: str | None) -> str:
    """Raises FileNotFoundError naming the config key when a configured path (local, or a URL)
    does not exist."""
    if not path or not exists(path):
        raise FileNotFoundError(f"{key}={path!r}: no such file or directory; set it with "
                                f"--set {key}=/local/path")
    return path


def isdir(path: str) -> bool:
    return as_epath(path).is_dir() if is_url(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    p = as_epath(path)
    return p.exists() and not p.is_dir()


def listdir(path: str) -> list[str]:
    """The entry names of directory `path`. A URL with nothing under it lists as empty (an
    object store has no empty directories: one exists once an object is written in it)."""
    if not is_url(path):
        return os.listdir(path)
    p = as_epath(path)
    return [child.name for child in p.iterdir()] if p.is_dir() else []


def makedirs(path: str) -> None:
    """Creates directory `path` and its parents; an existing one is fine."""
    if is_url(path):
        as_epath(path).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def rmtree(path: str) -> None:
    if is_url(path):
        as_epath(path).rmtree()
    else:
        shutil.rmtree(path)


def remove(path: str) -> None:
    if is_url(path):
        as_epath(path).unlink()
    else:
        os.remove(path)


def rename(source: str, target: str) -> None:
    """os.rename; on an object store a copy of every object, then their deletion (not atomic)."""
    if is_url(source):
        as_epath(source).rename(target)
    else:
        os.rename(source, target)


def open_file(path: str, mode: str = "r", **kwargs) -> IO:
    """open(); a URL's file is written when it is closed (modes "r", "w", "rb", "wb")."""
    if not is_url(path):
        return builtins.open(path, mode, **kwargs)
    return as_epath(path).open(mode, **kwargs)     # UTF-8 only


def write_text_atomic(path: str, text: str) -> None:
    """Writes `text` so that a reader sees the old file or the new one whole: a local file via a
    temporary one renamed into place; a URL as one object write (atomic on an object store)."""
    if is_url(path):
        as_epath(path).write_text(text)
        return
    with builtins.open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def upload_directory(local: str, url: str) -> None:
    """Copies the files of local directory `local` (no subdirectories) into directory `url`; on
    a failure removes what it copied (an object store has no atomic directory rename, so an
    interrupted upload can leave a partial directory only if that removal fails too)."""
    target = as_epath(url)
    target.mkdir(parents=True, exist_ok=True)
    try:
        for name in sorted(os.listdir(local)):
            with builtins.open(os.path.join(local, name), "rb") as source:
                (target / name).write_bytes(source.read())
    except BaseException:
        try:
            target.rmtree()
        except Exception:   # noqa: BLE001 - the upload's own error is the one to raise
            pass
        raise


def intact_checkpoint_steps(directory: str | None) -> list[int]:
    """The finished Orbax steps in `directory`, ascending ([] when there is none or it cannot
    be read). A local step is finished once its temporary folder is renamed to its number; an
    object store's once it holds ORBAX_COMMIT_FILE."""
    if not directory:
        return []
    if not is_url(directory):
        try:
            return sorted(int(name) for name in os.listdir(directory) if name.isdigit())
        except OSError:
            return []
    try:
        return sorted(int(name) for name in listdir(directory) if name.isdigit()
                      and exists(os.path.join(directory, name, ORBAX_COMMIT_FILE)))
    except Exception:   # noqa: BLE001 - a store's client errors are not OSErrors
        return []
