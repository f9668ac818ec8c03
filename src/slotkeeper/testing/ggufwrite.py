"""Writing a test GGUF (a tiny model, a tiny projector) so that no reader ever sees half a file.

The file is written under a temporary name in the same directory and moved into place with `os.replace`: a
llama-server another test starts meanwhile sees the old file or the whole new one. Needs `gguf` (tests only).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_gguf(
    path: str | os.PathLike[str], arch: str, add_keys: Callable[[Any], None], tensors: Iterable[tuple[str, Any]]
) -> Path:
    """Write a GGUF of `arch` with the keys `add_keys(writer)` adds and these tensors; return its path.
    Missing parent directories are created."""
    import gguf

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            add_keys(writer)
            for name, arr in tensors:
                writer.add_tensor(name, arr)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a model file is not a secret
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest
