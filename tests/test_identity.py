"""The model file's identity (store/fingerprint.py) from the save directory's identity cache: a start does not
hash an unchanged file again, and never takes a cached hash for a file that changed since, on the real file
system."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slotkeeper.store import fingerprint
from slotkeeper.store.fingerprint import IDENTITY_CACHE_FILES, IDENTITY_CACHE_NAME, model_identity

SIZE = 10 * 1024 * 1024  # head and tail both read


@pytest.fixture
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files count as settled as soon as they are written (the tests' files are all fresh)."""
    monkeypatch.setattr(fingerprint, "SETTLED_NS", 0)


def model_file(tmp_path: Path, name: str = "m.gguf", seed: int = 1) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes([seed]) * 16 + os.urandom(SIZE - 16))
    return path


def cached(save_dir: Path) -> dict[str, list]:
    return json.loads((save_dir / IDENTITY_CACHE_NAME).read_text())["files"]


def test_an_unchanged_model_file_is_not_hashed_again(tmp_path, settled_at_once):
    model, save_dir = model_file(tmp_path), tmp_path
    first = model_identity(str(model), save_dir)
    assert first == model_identity(str(model))  # the same identity as an uncached reading
    files = cached(save_dir)
    assert files[str(model)][-1] == first["model_sha256"]
    files[str(model)][-1] = "c" * 32  # what the next start finds is what it uses: the file is not read
    (save_dir / IDENTITY_CACHE_NAME).write_text(json.dumps({"files": files}))
    assert model_identity(str(model), save_dir)["model_sha256"] == "c" * 32


def test_a_model_file_changed_in_place_is_hashed_again(tmp_path, settled_at_once):
    """Same size, mtime set back (as cp -p or rsync -t leave it): the ctime still says it changed."""
    model, save_dir = model_file(tmp_path), tmp_path
    before = os.stat(model)
    first = model_identity(str(model), save_dir)
    with open(model, "r+b") as f:
        f.write(b"\xff" * 16)
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = model_identity(str(model), save_dir)
    assert after["model_sha256"] != first["model_sha256"]
    assert after == model_identity(str(model))
    assert cached(save_dir)[str(model)][-1] == after["model_sha256"]


def test_a_replaced_model_file_is_hashed_again(tmp_path, settled_at_once):
    """A new download of the same name (another inode), even of the same size."""
    model, save_dir = model_file(tmp_path), tmp_path
    first = model_identity(str(model), save_dir)
    os.replace(model_file(tmp_path, "new.gguf", seed=2), model)
    assert model_identity(str(model), save_dir)["model_sha256"] != first["model_sha256"]


def test_a_file_changed_just_now_is_hashed_but_not_remembered(tmp_path):
    """A change within the same clock tick might keep the ctime: a file that changed in the last two seconds
    is hashed every time."""
    model, save_dir = model_file(tmp_path), tmp_path
    assert model_identity(str(model), save_dir) == model_identity(str(model))
    assert not (save_dir / IDENTITY_CACHE_NAME).exists()


@pytest.mark.parametrize("damage", [b"", b"not json", b'{"files": 3}', b'{"files": {"x": 1}}', b"[1, 2]"])
def test_a_damaged_cache_is_replaced(tmp_path, settled_at_once, damage):
    model, save_dir = model_file(tmp_path), tmp_path
    (save_dir / IDENTITY_CACHE_NAME).write_bytes(damage)
    assert model_identity(str(model), save_dir) == model_identity(str(model))
    assert str(model) in cached(save_dir)
    assert sorted(p.name for p in save_dir.iterdir()) == sorted([IDENTITY_CACHE_NAME, model.name])


def test_the_cache_keeps_the_last_files_and_never_blocks_a_start(tmp_path, settled_at_once):
    models = [model_file(tmp_path, f"m{i}.gguf", seed=i) for i in range(IDENTITY_CACHE_FILES + 2)]
    for model in models:
        model_identity(str(model), tmp_path)
    assert list(cached(tmp_path)) == [str(m) for m in models[-IDENTITY_CACHE_FILES:]]
    gone = tmp_path / "no-such-dir"  # a cache that cannot be written costs a hash, nothing else
    assert model_identity(str(models[0]), gone) == model_identity(str(models[0]))
    assert not gone.exists()
