"""A disk cache of encoder token states, so training reads each text through the frozen encoder once.

Entries are keyed by :func:`~guard.compact.encoder.text_key` (encoder name, window settings and the text) and stored
as float16 ``(n, 384)`` tensors in ``safetensors`` shards under the cache directory (default
``$XDG_CACHE_HOME/guard/compact``, ``~/.cache/guard/compact`` when that variable is unset; never inside the
repository). A cache only ever adds shards; delete the folder to clear it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from guard.compact.encoder import TextEncoder, text_key

__all__ = ["DEFAULT_CACHE_DIR", "EmbeddingCache"]


def _user_cache() -> Path:
    """``$XDG_CACHE_HOME`` when it is an absolute path (the XDG base directory spec ignores a relative one), else
    ``~/.cache``."""
    configured = os.environ.get("XDG_CACHE_HOME", "")
    return Path(configured) if os.path.isabs(configured) else Path(os.path.expanduser("~")) / ".cache"


#: guard's compact-model caches, read once at import: ``$XDG_CACHE_HOME/guard/compact`` (default ``~/.cache``).
DEFAULT_CACHE_DIR = _user_cache() / "guard" / "compact"
#: Texts encoded per encoder call while filling the cache (longer texts take several windows each).
_FILL_BATCH = 32


class EmbeddingCache:
    """Token states of texts, computed once and kept on disk.

    Args:
        encoder: the frozen encoder.
        directory: where shards live; ``None`` keeps everything in memory only.
    """

    def __init__(self, encoder: TextEncoder, directory: Path | None = DEFAULT_CACHE_DIR) -> None:
        self.encoder = encoder
        self.directory = directory
        self._entries: dict[str, torch.Tensor] = {}
        if directory is not None and directory.exists():
            from safetensors.torch import load_file

            for shard in sorted(directory.glob("shard-*.safetensors")):
                self._entries.update(load_file(str(shard)))

    def get(self, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Float16 token states for each text, encoding (and storing) the missing ones.

        Args:
            texts: the texts.
            progress: called with the number of texts just encoded (for a progress bar).
        """
        keys = [text_key(text, self.encoder.config) for text in texts]
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts, strict=True):
            if key not in self._entries:
                missing.setdefault(key, text)
        if missing:
            items = sorted(missing.items(), key=lambda item: len(item[1]))
            fresh: dict[str, torch.Tensor] = {}
            for start in range(0, len(items), _FILL_BATCH):
                chunk = items[start : start + _FILL_BATCH]
                for (key, _), encoded in zip(chunk, self.encoder.encode([t for _, t in chunk]), strict=True):
                    fresh[key] = encoded.states.to(torch.float16).contiguous()
                if progress is not None:
                    progress(len(chunk))
            self._entries.update(fresh)
            self._write(fresh)
        return [self._entries[key] for key in keys]

    def _write(self, fresh: dict[str, torch.Tensor]) -> None:
        if self.directory is None or not fresh:
            return
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        index = len(list(self.directory.glob("shard-*.safetensors")))
        target = self.directory / f"shard-{index:05d}-{os.getpid()}.safetensors"
        tmp = target.with_suffix(".tmp")
        save_file(fresh, str(tmp))
        tmp.replace(target)
