"""Clef runtime: a faithful re-implementation of Cloudflare's reference ``joint_schema_model.py``.

Modules (the Clef runtime spec): :mod:`~guard.clef.encoding` (§2 prompt, spans, truncation, collation),
:mod:`~guard.clef.processor` (§1.6 tokenizer and media), :mod:`~guard.clef.head` (§3 joint schema head),
:mod:`~guard.clef.model` (§1.8 loading, §4 readout) and :mod:`~guard.clef.tiny` (a tiny random checkpoint).

Example:
    >>> from guard.clef import ClefModel  # doctest: +SKIP
    >>> model = ClefModel.from_pretrained("/models/clef-flash", device="cuda")  # doctest: +SKIP
    >>> model.systemone({"model": "clef-flash", "state": "...", "questions": {...}}).to_json()  # doctest: +SKIP
"""

from __future__ import annotations

from guard.clef.encoding import EncodedQuestion, EncodedRecord, collate, encode_record, render
from guard.clef.head import EvidenceRoutingLayer, JointHeadConfig, JointSchemaHead
from guard.clef.model import ClefModel, checkpoint_revision
from guard.clef.processor import ClefProcessor, EncodedMedia
from guard.clef.tiny import TinyConfig, write_tiny_checkpoint

__all__ = [
    "ClefModel",
    "ClefProcessor",
    "EncodedMedia",
    "EncodedQuestion",
    "EncodedRecord",
    "EvidenceRoutingLayer",
    "JointHeadConfig",
    "JointSchemaHead",
    "TinyConfig",
    "checkpoint_revision",
    "collate",
    "encode_record",
    "render",
    "write_tiny_checkpoint",
]
