"""Fresh ``TORCHTPU_CACHE_DIR``s for child processes that test the compilation caches.

A fresh cache directory would also hold a fresh build of the C++ extension (``runtime/native.py``
builds it under ``<cache_dir>/ext``): 20-40 s of compiler time per child, paid again by every
test that starts one, for a build these tests do not test. The directory's ``ext`` is a link to
this session's build instead (``tests/test_native_hooks.py`` tests the build itself).
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtpu.config import config


def fresh_cache_dir(path) -> Path:
    """``path``, created, as a cache directory whose C++ extension build is this session's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ext = Path(config.cache_dir) / "ext"
    if config.cache_dir and ext.is_dir() and not (path / "ext").exists():
        os.symlink(ext, path / "ext", target_is_directory=True)
    return path
