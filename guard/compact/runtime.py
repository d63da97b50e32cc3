"""ONNX Runtime for the catalog model's encoder at serving time, in int8 (the default) or float32.

The whole encoder stack of a catalog checkpoint (all-MiniLM-L6-v2's embeddings and frozen lower layers, then the
checkpoint's fine-tuned top layers) is exported from the torch modules to one ONNX graph in float32 and run with
ONNX Runtime's CPU provider, which fuses GELU and layer norms and has less per-operation overhead than eager torch.
The heads stay in torch (float32). Training never uses this path.

``onnx-int8``, what ``runtime="auto"`` serves with (:func:`choose`), quantizes that graph with ONNX Runtime's dynamic
quantization (``quantize_dynamic``): the matrix products' weights in int8 with one scale per output channel, the
embedding tables in int8, activations quantized on each call. It runs the stack about 2x faster than float32 and
torch bf16 (a 128-token request's ``Guard.evaluate`` p50 11.8-14.2 ms against 22-26 ms on a 2-core AVX512-VNNI VM,
``bench/compact_latency.py``); the leave-one-source-group-out AUROCs move by at most 0.01 and single answers by 0.02
on average (``docs/compact-model.md#int8``). ``onnx`` (float32) and ``torch`` (the encoder's dtype: bf16 where the CPU
has it) give answers closer to training's, for those who name them (``$GUARD_COMPACT_RUNTIME``).

Graphs are exported once per checkpoint and cached on disk as ``<key>.onnx`` and ``<key>.int8.onnx`` in
``$XDG_CACHE_HOME/guard/compact/onnx`` (``~/.cache`` when the variable is unset; never inside the repository), keyed
by a hash of every exported weight, their dtype, the torch (exporter) and ONNX Runtime (quantizer) versions, so a
changed checkpoint, encoder or library gets a new graph. Exporting takes a few seconds; later loads read the file.
Graphs no load has used for :data:`CACHE_DAYS` days are removed from that folder on each load. guard creates its
cache folders ``0700``, reads a graph only through folders this user owns and no one else can write to, and only as
a private regular file of this user's (:func:`~guard.compact._cache.check_private`, :func:`_drop_untrusted`). Where the folder cannot be
written, belongs to another user or others may write to it, each load exports into a private temporary directory and
removes it once the session has read the graph (with a warning naming the cause)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from guard.compact._cache import DEFAULT_CACHE_DIR, check_private, is_private_file, private_folders
from guard.compact.encoder import attention_bias

__all__ = ["CACHE_DAYS", "DEFAULT_ONNX_DIR", "OPSET", "RUNTIMES", "OnnxStack", "choose", "quantize"]

logger = logging.getLogger("guard.compact")

DEFAULT_ONNX_DIR = DEFAULT_CACHE_DIR / "onnx"
#: ONNX opset of the exported graph.
OPSET = 17
#: Graphs in the default cache that no load has used for this many days are removed (:func:`_prune`).
CACHE_DAYS = 30
#: Cached graph names: ``<key>.onnx``, ``<key>.int8.onnx`` and the earlier ``<key>.ort<version>.int8.onnx``.
_GRAPH_FILE = re.compile(r"[0-9a-f]{32}(\.ort[\w.+-]+)?(\.int8)?\.onnx")
#: An export's staging folder in the cache (removed when the export ends; left behind only by a killed process).
_STAGING = "staging-"
_STAGING_SECONDS = 86400
#: What a catalog model's encoder stack may run on.
RUNTIMES = ("auto", "onnx", "onnx-int8", "torch")


def choose(runtime: str) -> str:
    """``"onnx"``, ``"onnx-int8"`` or ``"torch"`` for a requested ``runtime`` (one of :data:`RUNTIMES`): ``"auto"`` is
    ONNX Runtime int8, the fastest of the three on every CPU measured (``docs/compact-model.md#latency``).

    Raises:
        ValueError: an unknown runtime.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {list(RUNTIMES)}, got {runtime!r}")
    return "onnx-int8" if runtime == "auto" else runtime


class _Stack(nn.Module):
    """Embeddings, the frozen lower layers and the fine-tuned top layers as one float32 module: ``(ids, mask)`` ->
    states."""

    def __init__(self, model: nn.Module, top: Sequence[nn.Module]) -> None:
        super().__init__()
        self.embeddings = copy.deepcopy(model.embeddings).float()  # type: ignore[attr-defined]
        frozen = model.encoder.layer[: len(model.encoder.layer) - len(top)]  # type: ignore[attr-defined]
        self.layers = nn.ModuleList([*(copy.deepcopy(layer).float() for layer in frozen),
                                     *(copy.deepcopy(layer).float() for layer in top)])

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids=ids)
        bias = attention_bias(mask, hidden.dtype)
        for layer in self.layers:
            out = layer(hidden, attention_mask=bias)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


class OnnxStack:
    """An ONNX Runtime session over the encoder stack: ``stack(ids, mask)`` -> ``(N, L, 384)`` float32 states.

    Args:
        path: the exported ``.onnx`` file.
        threads: intra-op threads (default: torch's current ``get_num_threads()``, so ``torch.set_num_threads`` and
            ``--threads`` settings carry over).
    """

    def __init__(self, path: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # idle workers sleep instead of spinning: on shared cores spinning threads took the time the next call needed
        # (p50 3-5x slower with other jobs running, bench/compact_latency.py)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.path = path
        #: ``"onnx-int8"`` for a quantized graph (:func:`quantize`), else ``"onnx"``.
        self.runtime = "onnx-int8" if path.name.endswith(".int8.onnx") else "onnx"
        # read here, so a file removed meanwhile (another process pruning the cache) is an OSError, as an unreadable
        # cache is
        self.session = ort.InferenceSession(path.read_bytes(), options, providers=["CPUExecutionProvider"])

    @classmethod
    def export(cls, model: nn.Module, top: Sequence[nn.Module], *, directory: Path | None = None,
               threads: int | None = None, int8: bool = False) -> OnnxStack:
        """The session for ``model`` (a transformers ``BertModel``) with ``top`` as its top layers (in place of as
        many of its own), exporting the graph into ``directory`` (default :data:`DEFAULT_ONNX_DIR`) unless a file for
        these weights is there; ``int8``: the graph quantized (:func:`quantize`), also cached.

        In the default directory, graphs no load has used for :data:`CACHE_DAYS` days are then removed
        (:func:`_prune`); a directory the caller names is left as it is. When the default directory cannot be written
        (a container user without a home, a read-only file system), belongs to another user or others may write to
        it (:func:`~guard.compact._cache.check_private`), the graph is exported into a private temporary directory (``mkdtemp``: readable by
        this user only, never one another user could have prepared), loaded, and the directory removed; a warning
        names the cause. Every load then exports again (a few seconds).

        Raises:
            OSError: ``directory`` was given and cannot be written, belongs to another user or others may write to
                it, or no temporary directory can be written.
        """
        stack = _Stack(model, top).eval()
        key = _key(model, top, stack)
        if directory is not None:
            return cls(_graph(stack, directory, key, int8), threads)
        try:
            session = cls(_graph(stack, DEFAULT_ONNX_DIR, key, int8), threads)
        except OSError as exc:
            logger.warning("cannot use the ONNX cache %s (%s); exporting the graph to a temporary directory, again on "
                           "every load (XDG_CACHE_HOME can name a folder of this user's)", DEFAULT_ONNX_DIR, exc)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own errors: a cached graph it cannot load
            logger.warning("the cached ONNX graph for these weights cannot be loaded (%s: %s); it is removed (the next "
                           "load exports it again) and this load exports to a temporary directory",
                           type(exc).__name__, exc)
            for stale in DEFAULT_ONNX_DIR.glob(f"{key}*.onnx"):
                with contextlib.suppress(OSError):
                    stale.unlink()
        else:
            with contextlib.suppress(OSError):  # a cache that cannot be listed keeps its files; the load stands
                _prune(DEFAULT_ONNX_DIR)
            return session
        with tempfile.TemporaryDirectory(prefix="guard-onnx-") as private:
            return cls(_graph(stack, Path(private), key, int8), threads)  # the session holds the graph in memory

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` int64 ids and bool mask (real positions first) -> ``(N, L, 384)`` float32 states of the last
        layer. The int8 graph quantizes activations with one scale per tensor and call, so there each window runs in
        a call of its own, cut to its length: its states (zeros at padding) do not depend on the windows beside it."""
        if self.runtime != "onnx-int8":
            (states,) = self.session.run(None, {"ids": ids.numpy(), "mask": mask.numpy()})
            return torch.from_numpy(states)
        rows = []
        for row_ids, row_mask in zip(ids, mask, strict=True):
            n = int(row_mask.sum())
            (states,) = self.session.run(None, {"ids": row_ids[None, :n].numpy(), "mask": row_mask[None, :n].numpy()})
            rows.append(torch.nn.functional.pad(torch.from_numpy(states[0]), (0, 0, 0, ids.shape[1] - n)))
        return torch.stack(rows)


def _graph(stack: nn.Module, root: Path, key: str, int8: bool) -> Path:
    """The graph file of ``stack`` under ``root`` (``<key>.onnx``, or its int8 version), exported unless there.

    Raises:
        OSError: ``root`` cannot be created or written; ``PermissionError``: it, or a cache folder above it, is not
            this user's or others may write to it (:func:`~guard.compact._cache.check_private`).
    """
    for folder in private_folders(root, DEFAULT_ONNX_DIR.parent.parent):
        check_private(folder)
    path = root / f"{key}.onnx"
    _touch(path)  # before the check, so a concurrent prune sees a graph about to be read as used
    _drop_untrusted(path)
    if not path.exists():
        ids = torch.full((2, 8), 100, dtype=torch.long)
        mask = torch.ones(2, 8, dtype=torch.bool)
        # the tracer warns about shape checks in transformers' attention (``q_length > 1``) and torch about the
        # TorchScript exporter; the graph is checked against torch (tests/compact/test_runtime.py)
        with tempfile.TemporaryDirectory(prefix=_STAGING, dir=root) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            staged = Path(tmp) / path.name
            torch.onnx.export(stack, (ids, mask), str(staged), input_names=["ids", "mask"],
                              output_names=["states"], opset_version=OPSET, dynamo=False,
                              dynamic_axes={"ids": {0: "n", 1: "l"}, "mask": {0: "n", 1: "l"},
                                            "states": {0: "n", 1: "l"}})
            os.chmod(staged, 0o600)
            os.replace(staged, path)  # atomic: a concurrent loader sees no half-written file
    return quantize(path) if int8 else path


def _touch(path: Path) -> None:
    """Mark a cached graph as used now (its modification time), so :func:`_prune` keeps it; nothing when the file is
    not there, or when this process cannot write the cache (a read-only image layer: the graph is read as it is)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def _prune(root: Path) -> None:
    """Remove from the cache folder ``root`` the graphs no load has used for :data:`CACHE_DAYS` days (graphs of older
    checkpoints or library versions; about 110 MB for a float32 graph and its int8 one) and staging folders a killed
    export left (older than a day). Only regular files named like graphs and folders named like staging folders are
    removed; links and anything else are left alone.

    A process that loads a graph marks it as used before reading it (:func:`_graph`); if a prune removes it in between,
    the read is an ``OSError`` and that load exports into a temporary directory (:meth:`OnnxStack.export`)."""
    now = time.time()
    for path in root.iterdir():
        with contextlib.suppress(OSError):  # another process may have removed it first
            info = path.lstat()
            graph = _GRAPH_FILE.fullmatch(path.name) and stat.S_ISREG(info.st_mode)
            staging = path.name.startswith(_STAGING) and stat.S_ISDIR(info.st_mode)
            if graph and info.st_mtime < now - CACHE_DAYS * 86400:
                path.unlink()
            elif staging and info.st_mtime < now - _STAGING_SECONDS:
                shutil.rmtree(path)


def _drop_untrusted(path: Path) -> None:
    """Remove the cached graph ``path`` unless it is a regular file of this user's that no one else can write to (one
    planted, or written while the folder was open to others, is exported again instead of read)."""
    try:
        if is_private_file(path):
            return
    except FileNotFoundError:
        return
    logger.warning("the cached ONNX graph %s is not a private file of this user's; it is removed and exported again",
                   path)
    path.unlink()


def quantize(path: Path) -> Path:
    """The int8 graph of the float32 graph at ``path``, written next to it as ``<stem>.int8.onnx`` unless there (the
    stem's key holds the ONNX Runtime version, so another quantizer writes another file): ONNX Runtime's dynamic
    quantization, int8 weights with one scale per output channel (``per_channel``), which moved answers a third as
    much as one scale per tensor on the test split."""
    out = path.with_name(f"{path.stem}.int8.onnx")
    _touch(out)
    _drop_untrusted(out)
    if not out.exists():
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory(prefix=_STAGING, dir=path.parent) as tmp, _quiet_root_logger():
            staged = Path(tmp) / out.name
            quantize_dynamic(str(path), str(staged), weight_type=QuantType.QInt8, per_channel=True)
            os.chmod(staged, 0o600)
            os.replace(staged, out)
    return out


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """While quantizing: the quantizer logs a hint to pre-process the graph with symbolic shape inference (which fails
    on this graph: its attention shapes are data-dependent; the quantized graph is checked against float32 in tests)
    through ``logging.warning``, which would also install a root handler (``basicConfig``) in an application that has
    none. A handler that drops records is attached for the time, and a filter keeps the hint from the application's
    own handlers."""
    root = logging.getLogger()
    hint, sink = _DropLogged("pre-processing before quantization"), logging.NullHandler()
    root.addFilter(hint)
    root.addHandler(sink)
    try:
        yield
    finally:
        root.removeHandler(sink)
        root.removeFilter(hint)


class _DropLogged(logging.Filter):
    """Drops log records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _key(model: nn.Module, top: Sequence[nn.Module], stack: nn.Module) -> str:
    """Hash of the weights as loaded (dtype included), the torch and ONNX Runtime versions (exporter and quantizer) and
    the opset."""
    import onnxruntime

    digest = hashlib.sha256(f"{torch.__version__}|{onnxruntime.__version__}|{OPSET}|"
                            f"{next(model.parameters()).dtype}|"
                            f"{next(top[0].parameters()).dtype}|{len(top)}".encode())
    for name, tensor in stack.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]
