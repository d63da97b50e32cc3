"""All the text a message carries, wherever it sits: the part of a message that model input, model output and tool
result policies judge.

``BaseMessage.text`` joins only ``text`` blocks, but a message can carry text the reader (a client, the next model)
sees in other places: ``reasoning`` blocks, provider-native blocks (Anthropic ``thinking``, OpenAI ``summary``),
``non_standard`` blocks, citations, and provider extras in ``additional_kwargs`` (``reasoning_content``, ``refusal``).
A policy that judges only ``.text`` lets those through unjudged. :func:`message_text` collects every string in the
message instead, leaving out only

* tool calls (``tool_call``, ``tool_call_chunk``, ``invalid_tool_call`` blocks, Anthropic ``tool_use``, OpenAI
  ``function_call``, and ``additional_kwargs["tool_calls"]``): their arguments are judged by the tool-call policy;
* values that are not text: ids, indexes, signatures, encrypted reasoning, base64 data and MIME types
  (:data:`OPAQUE_KEYS`), the image an OpenAI ``image_generation_call`` drew (its ``result``); and guard's own
  ``lc_source`` / ``lc_data`` metadata. A ``json`` block (a tool's structured
  output, which integrations send as its JSON text) is read whole, as canonical JSON, keys and all: its keys are the
  data's, not a block's, so none of them is opaque. Data that is text is read
  (:func:`_text_payload`): an Anthropic plain-text document (``source: {type: text, media_type: text/plain,
  data}``), LangChain's ``text-plain`` block with ``base64``, any ``data`` / ``base64`` of a text, JSON, XML or YAML
  media type (base64 decoded as UTF-8), and the payload of any other block whose bytes are text whatever type it
  declares, so a document block cannot carry instructions past the check.

Anything else, whatever its shape (a stray or unknown block included), is walked; a value that is not a string,
list or mapping is skipped, so odd content never raises and never switches the check off.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.messages import BaseMessage

from guard import _json as strict_json
from guard.agents._arguments import canonical_json

__all__ = [
    "OPAQUE_KEYS",
    "TOOL_CALL_BLOCKS",
    "ServerBlock",
    "call_ids",
    "call_positions",
    "calls_by_id",
    "input_text",
    "message_text",
    "server_blocks",
    "unread_media",
]

TOOL_CALL_BLOCKS = frozenset(
    {"tool_call", "tool_call_chunk", "invalid_tool_call", "tool_use", "function_call", "input_json_delta"}
)
"""Content block types that hold a tool call (judged by the tool-call policy, not as text)."""
OPAQUE_KEYS = frozenset(
    {"type", "id", "index", "signature", "encrypted_content", "base64", "data", "mime_type", "media_type", "file_id",
     "call_id", "source_type"}
)
"""Keys whose values are identifiers or binary/encrypted payloads, never text a reader sees."""
_SKIPPED_KWARGS = frozenset({"tool_calls", "function_call", "lc_source", "lc_data", "__openai_role__"})


def _is_call_block(block: Mapping[Any, Any]) -> bool:
    """Whether ``block`` is a tool call block (:data:`TOOL_CALL_BLOCKS`; a ``type`` of any value allowed)."""
    kind = block.get("type")
    return isinstance(kind, str) and kind in TOOL_CALL_BLOCKS


_URL_KEYS = frozenset({"url", "image_url", "file_data", "file_url"})
"""Keys whose ``data:`` URL a provider decodes (an image, a file), not shows as text."""
_NOT_WALKED = OPAQUE_KEYS | {"json", "guard_content"}
#: Block type -> its key that holds media the provider made from the model's own request, not text from outside:
#: OpenAI's ``image_generation_call`` ``result`` (a base64 image of megabytes), never read as text.
_MADE_MEDIA = {"image_generation_call": "result"}
"""Keys :func:`_strings` does not walk: opaque values, and the two it reads whole."""


def _strings(value: Any) -> list[str]:
    """Every string inside ``value`` in document order (iterative, so deep nesting cannot overflow the stack), and the
    text a provider would read out of it: a ``json`` value as one canonical JSON string, text carried as data
    (:func:`_text_payload`), base64 ``data:`` URLs read as their bytes too (:func:`_data_url_text`), raw bytes whose
    bytes are text.

    Raises:
        ValueError: a ``json`` value nested deeper than the recursion limit allows.
    """
    found: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            text = _data_url_text(item)
            if text:
                found.append(text)
        elif isinstance(item, (bytes, bytearray, memoryview)):
            decoded = _raw_text(bytes(item))
            if decoded:
                found.append(decoded)
        elif isinstance(item, Mapping):
            if "json" in item:  # free-form data that converters send whole: no key of it is opaque
                found.append(canonical_json(item["json"]))
            if "guard_content" in item:  # Bedrock's guarded text, sent as text whatever types it holds
                found += _every_string(item["guard_content"])
            if _is_call_block(item):
                continue  # the call itself is judged as a call
            walked: list[Any] = []
            kind = item.get("type")
            made = _MADE_MEDIA.get(kind) if isinstance(kind, str) else None
            for key, entry in item.items():
                if key in _NOT_WALKED or key == made:
                    continue
                if key in _URL_KEYS and isinstance(entry, str) and _DATA_URL.match(entry):
                    decoded = _data_url_text(entry, as_url=True)  # a URL the provider decodes: its bytes alone
                    if decoded:
                        found.append(decoded)
                else:
                    walked.append(entry)
            stack.extend(reversed(walked))
            payload = _text_payload(item)
            if payload:
                found.append(payload)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found


def _text_payload(block: Mapping[Any, Any]) -> str | None:
    """The text ``block`` carries as data (its ``data`` and ``base64`` values, each read: converters send one or the
    other), or ``None`` when it carries none.

    * A block that says it is text (``type`` ``text`` or ``text-plain``, a ``media_type`` / ``mime_type`` that is
      ``text/*``, JSON, XML or YAML, or one with a ``charset``): its data, decoded in its charset (UTF-8 by default,
      undecodable bytes replaced) from base64 when it is base64 (the ``base64`` key, ``type`` / LangChain v0
      ``source_type`` ``base64``), and under ``data`` both as written and decoded when it is strict base64 of text.
    * Any other block: its payload when the payload's bytes are text (:func:`_sniffed_text`), whatever the block
      declares: providers read ``application/x-javascript``, ``application/rtf`` or ``application/x-ndjson`` files
      as text, so a declared type cannot carry instructions past the check. Images, PDFs and other binary data are
      not text and give ``None``; a declared image, audio or video counts as text only when its first 4 KiB are valid
      UTF-8 (a real image's metadata chunks are not read).
    * Raw bytes (``bytes``, ``bytearray``, ``memoryview``) are read as the decoded bytes of base64 are.
    """
    media = block.get("media_type") or block.get("mime_type")
    media = media if isinstance(media, str) else ""
    kind = block.get("type")
    codec = _charset(media)
    says_text = kind in ("text", "text-plain") or _is_text_media(media) or codec is not None
    strict = media.lower().startswith(_MEDIA_PREFIXES) or kind in ("image", "audio", "video")
    base64_data = kind == "base64" or block.get("source_type") == "base64"
    texts: list[str] = []
    for key in ("data", "base64"):
        value = block.get(key)
        text: str | None = None
        if isinstance(value, (bytes, bytearray, memoryview)):
            text = _decode_text(bytes(value), codec) if says_text else _raw_text(bytes(value), strict=strict)
        elif isinstance(value, str) and value.strip():
            if not says_text:
                text = _sniffed_text(value, strict=strict, codec=codec)
            elif key == "base64" or base64_data:
                text = _from_base64(value, codec)
            else:
                decoded = _strict_base64_text(value, codec)
                text = f"{value}\n{decoded}" if decoded else value
        if text:
            texts.append(text)
    return "\n".join(texts) or None


def _sniffed_text(payload: str, *, strict: bool = False, codec: str | None = None) -> str | None:
    """A payload of a block that does not say it is text, read if its bytes are text (:func:`_is_text` on its first
    4 KiB, base64 decoded; ``strict``: valid UTF-8 only): base64 of binary data gives ``None``; base64 of text its
    text; a string that is not base64 (:func:`_is_base64_text`) itself, and its lenient decoding too when that is
    text. Padding inside the payload is read the ways decoders read it (:func:`_padded_readings`)."""
    sample = payload[: 2 * _SNIFF_CHARS]
    head = _lenient_base64(sample)
    base64_only = _is_base64_text(payload)
    whole = len(payload) <= len(sample) and len(head) <= _SNIFF_BYTES
    texts = [_decode_text(raw, codec) for raw in _padded_readings(sample, payload)
             if _is_text(raw[:_SNIFF_BYTES], whole=len(raw) <= _SNIFF_BYTES, strict=strict)]
    if _is_text(head[:_SNIFF_BYTES], whole=whole, strict=strict):
        texts.insert(0, _decode_text(_lenient_base64(payload), codec))
    if not base64_only:
        texts.insert(0, payload)  # a string that is no base64 is read as written too
    return "\n".join(texts) or None


def _is_base64_text(payload: str) -> bool:
    """Whether ``payload`` is base64 in either alphabet, padding and line breaks allowed anywhere, and of a length
    padding explains (never 1 more than a multiple of 4); other white space, or any other character, says it is text.
    Linear and in C (a 5 MB image in milliseconds)."""
    try:
        raw = payload.encode("ascii")
    except UnicodeEncodeError:
        return False
    if raw.translate(None, _BASE64_BYTES):
        return False
    return (len(raw) - raw.count(b"\n") - raw.count(b"\r")) % 4 != 1


_BASE64_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_\r\n"


def _padded_readings(sample: str, payload: str) -> list[bytes]:
    """The other readings of base64 with padding before its end (``sample`` holds the first characters): decoders
    differ there. Python's and Node's stop at the first padding, GNU ``base64 -d`` and OpenSSL decode each padded
    chunk on its own; :func:`_lenient_base64` drops the padding and reads on. ``[]`` when padding only ends it."""
    if "=" not in sample.rstrip().rstrip("=").rstrip():
        return []
    chunks = [chunk for chunk in re.split(r"=+", payload) if chunk.strip()]
    return [_lenient_base64(chunks[0]), b"".join(_lenient_base64(chunk) for chunk in chunks)] if chunks else []


def _strict_base64_text(value: str, codec: str | None = None) -> str | None:
    """``value`` decoded when it is strict base64 (the standard alphabet, padded, line breaks allowed) of text, else
    ``None``."""
    compact = value.replace("\r", "").replace("\n", "")
    if len(compact) < 8 or len(compact) % 4 or _STRICT_BASE64.fullmatch(compact) is None:
        return None
    raw = base64.b64decode(compact)
    return _decode_text(raw, codec) if codec or _is_text(raw[:_SNIFF_BYTES], whole=len(raw) <= _SNIFF_BYTES) else None


def _every_string(value: Any) -> list[str]:
    """Every non-blank string value inside ``value`` (keys and block types aside), in document order."""
    found: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.strip():
                found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found


def _charset(media: str) -> str | None:
    """The text codec a media type's ``charset`` parameter names (``None`` when it names none, or a codec that is not
    a text encoding, such as ``hex`` or ``rot13``)."""
    for parameter in media.split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            try:
                info = codecs.lookup(value.strip().strip('"'))
            except (LookupError, ValueError):  # an unknown name, or one holding NUL or lone surrogates
                return None
            return info.name if getattr(info, "_is_text_encoding", True) else None
    return None


def _raw_text(raw: bytes, *, strict: bool = False) -> str | None:
    """Raw bytes as text when they are text (:func:`_is_text` on the first 4 KiB), else ``None``."""
    return _decode_text(raw) if _is_text(raw[:_SNIFF_BYTES], whole=len(raw) <= _SNIFF_BYTES, strict=strict) else None


_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*);base64,", re.IGNORECASE)


def _data_url_text(value: str, *, as_url: bool = False) -> str | None:
    """The text a model reads in a string (``None`` when blank): the string as written, and for a base64 ``data:``
    URL the text its bytes carry too (``data:text/plain;base64,...``, or any media type whose bytes are text,
    :func:`_text_payload`). ``as_url``: the string sits where a provider decodes the URL (an image's or a file's
    ``url``), so a URL whose rest is all base64 (:func:`_is_base64_text`) is read only as its bytes (``None`` for an
    image's)."""
    match = _DATA_URL.match(value)
    if match is None:
        return value if value.strip() else None
    payload = value[match.end():]
    decoded = _text_payload({"mime_type": match.group(1) + match.group(2), "base64": payload})
    if as_url and _is_base64_text(payload):
        return decoded
    return "\n".join(text for text in (value, decoded) if text)


_STRICT_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_MEDIA_PREFIXES = ("image/", "audio/", "video/", "application/pdf")
"""Declared types whose bytes count as text only when valid UTF-8: a provider reads them as media or as a PDF,
never as plain text, and a real file's metadata (a PNG chunk, a PDF's cross-reference table) is not text to judge."""


_SNIFF_CHARS = 5464
"""Base64 characters (4 KiB of data) that tell a text payload from binary data, so an image is not decoded whole."""
_SNIFF_BYTES = 4098
"""The bytes :data:`_SNIFF_CHARS` base64 characters decode to."""
_MOST_UNREADABLE = 0.2
"""Largest share of unreadable characters (U+FFFD from undecodable bytes, C0 controls but white space) in the first
4 KiB of a payload that is not valid UTF-8 and is still read as text. Random bytes (compressed images, archives)
decode to about 60 %, a PNG's 8-byte signature to 25 %; text with a few stray bytes to a few per cent."""
_UNREADABLE = re.compile("[\ufffd\x00-\x08\x0e-\x1f]")
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _is_text(head: bytes, *, whole: bool, strict: bool = False) -> bool:
    """Whether a payload whose first bytes are ``head`` (all of it when ``whole``) is text: a byte-order mark (UTF-8,
    -16, -32), valid UTF-8 (a character cut at the end of ``head`` allowed), or, unless ``strict``, at most
    :data:`_MOST_UNREADABLE` unreadable when decoded as UTF-8 with undecodable bytes replaced."""
    if head.startswith(tuple(bom for bom, _ in _BOMS)):
        return True
    try:
        head.decode("utf-8")
        return True
    except UnicodeDecodeError as exc:
        if not whole and exc.start >= len(head) - 3 and exc.reason == "unexpected end of data":
            return True
    if strict:
        return False
    text = head.decode("utf-8", "replace")
    return len(_UNREADABLE.findall(text)) <= _MOST_UNREADABLE * len(text)


def _decode_text(raw: bytes, codec: str | None = None) -> str:
    """Text bytes as a string: by their byte-order mark, else as UTF-8, undecodable bytes replaced. A ``codec`` a
    block declares is read too (both readings, when they differ: a reader may honour it or not), unless it cannot
    decode at all."""
    for bom, marked in _BOMS:  # UTF-32 LE's mark starts with UTF-16 LE's: the longer marks are tried first
        if raw.startswith(bom):
            try:
                return raw.decode(marked)
            except UnicodeDecodeError:
                break
    text = raw.decode("utf-8", "replace")
    if codec is None or codec == "utf-8":
        return text
    try:
        declared = raw.decode(codec, "replace")
    except (UnicodeError, LookupError, ValueError):
        return text
    return text if declared == text else f"{declared}\n{text}"


def _lenient_base64(payload: str) -> bytes:
    """``payload`` decoded as base64 the way a lenient decoder reads it: either alphabet, every other character
    (padding included) dropped, the last group padded (``b""`` when nothing is left)."""
    compact = _NOT_BASE64.sub("", payload.replace("-", "+").replace("_", "/"))
    if len(compact) % 4 == 1:  # a lone last character holds no whole byte
        compact = compact[:-1]
    return base64.b64decode(compact + "=" * (-len(compact) % 4))


_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/]")

def _is_text_media(media: str) -> bool:
    name = media.split(";", 1)[0].strip().lower()
    return name.startswith("text/") or name.endswith(("/json", "+json", "/xml", "+xml", "/yaml", "/x-yaml"))


def _from_base64(encoded: str, codec: str | None = None) -> str:
    """A text block's base64 data as text (:func:`_decode_text`), with each padded chunk's reading too when padding
    sits before the end (:func:`_padded_readings`); the string itself when it is not base64."""
    try:
        raw = base64.b64decode(encoded, validate=False)
    except (binascii.Error, ValueError):
        return encoded  # not base64 after all: judged as the text it is
    return "\n".join([_decode_text(raw, codec), *(_decode_text(other, codec)
                                                    for other in _padded_readings(encoded, encoded)[1:])])


def message_text(message: BaseMessage) -> str:
    """Every piece of text in ``message`` (content blocks of any type, then ``additional_kwargs``), joined with
    newlines; ``""`` when it has none.

    Args:
        message: any LangChain message (its ``content`` a string or a list of strings and blocks).

    Returns:
        The text a policy judges: ``message.text`` for a plain string message; for block content, the strings of
        every block that is not a tool call, without identifiers, signatures or binary data.
    """
    parts = _strings(message.content)
    extras = {key: value for key, value in (message.additional_kwargs or {}).items() if key not in _SKIPPED_KWARGS}
    parts += _strings(extras)
    return "\n".join(parts)


#: Content block types a provider shows the model as media (or fetches: a remote URL, a file id), never as text.
_MEDIA_BLOCKS = frozenset({"image", "image_url", "input_image", "audio", "input_audio", "video", "file", "input_file"})
#: A media type's ``type/subtype`` (RFC 6838 names), at most :data:`MAX_MEDIA_NAME_CHARS` characters in all.
_MEDIA_TYPE_NAME = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")
#: Most characters of a media type named in a log line, a verdict's message and what the model is told.
MAX_MEDIA_NAME_CHARS = 60
#: What names an unread part whose media type is none: its block type, or ``data URL``.
_MEDIA_KINDS = _MEDIA_BLOCKS | {"document", "data URL"}


def _media_name(media: str, kind: str) -> str:
    """How an unread part is named (``media``: its declared media type, lower-case; ``kind``: its block type, or
    ``data URL``): the media type without its parameters when it is one (``image/png``) of at most
    :data:`MAX_MEDIA_NAME_CHARS` characters, else the kind when it is one of :data:`_MEDIA_KINDS`, else ``media``.
    What a tool wrote there (a line break, a forged log line, a megabyte) never reaches a log or a message."""
    essence = media.partition(";")[0].strip()
    if len(essence) <= MAX_MEDIA_NAME_CHARS and _MEDIA_TYPE_NAME.fullmatch(essence):
        return essence
    return kind if kind in _MEDIA_KINDS else "media"


def unread_media(message: BaseMessage) -> list[str]:
    """What of ``message``'s content a model reads that guard cannot (:func:`_unread`); ``[]`` when there is none."""
    return _unread(message.content)


def _unread(content: Any) -> list[str]:
    """What of ``content`` (a message's content, or a block) a model reads that guard cannot: each media block (an
    image, audio, video or file block, inline, remote or by file id, unless it carries text inline under a text media
    type, which is judged; a block declaring an image, audio, video or PDF type whatever its bytes look like: a PDF's
    text is extracted from compressed streams; a ``document`` whose source is not text; a ``file_id`` in a mapping of
    no block type, but not in one of another type, such as a citation or Anthropic's ``container_upload``, which
    names a file and holds none of it) and each
    ``data:`` URL of binary data, each named as :func:`_media_name` says. Providers
    extract a PDF's text and show images to the model, so instructions inside them reach it unjudged."""
    found: list[str] = []
    stack: list[Any] = [content]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, Mapping) and not _is_call_block(item):
            kind = item.get("type") if isinstance(item.get("type"), str) else ""  # a dict there is no block type
            media = item.get("media_type") or item.get("mime_type")
            media = media.lower() if isinstance(media, str) else ""
            source = item.get("source")
            text_source = isinstance(source, Mapping) and source.get("type") in ("text", "content")
            inline_text = _is_text_media(media) and any(item.get(key) for key in ("data", "base64", "text"))
            by_id = "file_id" in item and not kind  # a typed block other than media only refers to a file by id
            if not inline_text and (kind in _MEDIA_BLOCKS or media.startswith(_MEDIA_PREFIXES) or by_id
                                    or (kind == "document" and not text_source)):
                found.append(_media_name(media, kind))
                continue
            for key, entry in item.items():
                if key in _URL_KEYS and isinstance(entry, str) and (url := _DATA_URL.match(entry)) and not \
                        _data_url_text(entry, as_url=True):
                    found.append(_media_name(url.group(1).lower(), "data URL"))
                elif key not in _NOT_WALKED and isinstance(entry, (list, tuple, Mapping)):
                    stack.append(entry)
    return found


def _call_blocks(value: Any) -> list[Mapping[Any, Any]]:
    """Every tool call block (:data:`TOOL_CALL_BLOCKS`) inside ``value``, at any depth (inside a ``non_standard``
    block's ``value`` too), in document order."""
    found: list[Mapping[Any, Any]] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if _is_call_block(item):
                found.append(item)
            else:
                stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found


def _calls(message: BaseMessage) -> list[Any]:
    """Every tool call ``message`` holds, in any form: ``tool_calls``, ``invalid_tool_calls``, tool call blocks at any
    depth of the content, and ``additional_kwargs`` ``tool_calls`` (a list) and ``function_call``."""
    calls: list[Any] = [*getattr(message, "tool_calls", ()), *getattr(message, "invalid_tool_calls", ())]
    calls += _call_blocks(message.content)
    raw = message.additional_kwargs.get("tool_calls")
    calls += raw if isinstance(raw, list) else [raw]
    calls.append(message.additional_kwargs.get("function_call"))
    return [call for call in calls if call]


def calls_by_id(message: BaseMessage) -> dict[str, Any]:
    """Call id -> call for every tool call ``message`` holds (:func:`_calls`: ``id``, or ``call_id`` for OpenAI's
    blocks; a later form of one id wins), each call as written."""
    out: dict[str, Any] = {}
    for call in _calls(message):
        if isinstance(call, Mapping):
            for key in ("id", "call_id"):
                if call.get(key) is not None:
                    out[str(call[key])] = call
    return out


def call_ids(message: BaseMessage) -> set[str]:
    """The ids of every tool call ``message`` holds (:func:`calls_by_id`)."""
    return set(calls_by_id(message))


def input_text(message: BaseMessage) -> str:
    """All the text a model reads in ``message`` when it is judged as model input: its ``name``, then
    :func:`message_text`, then each of its tool calls as JSON, keys and values (:func:`_calls`). A client that
    writes an assistant message speaks for the model, its calls included, so none of its text is left out;
    :func:`message_text` leaves calls to the tool-call policy, which judges the calls the agent's own model makes."""
    as_json = [canonical_json(call) for call in _calls(message)]
    return "\n".join(text for text in (message.name, message_text(message), *as_json) if text)


# Provider (server-side) tools ----------------------------------------------------------------------------------------

#: Block types of a tool call a provider ran itself (LangChain's standard ``server_tool_call``, Anthropic's
#: ``server_tool_use`` and ``mcp_tool_use``, Google's ``executable_code``).
_SERVER_CALLS = frozenset({"server_tool_call", "server_tool_call_chunk", "server_tool_use", "mcp_tool_use",
                           "executable_code"})
#: Block types that hold a server call and its result though their type does not end in ``_call``: OpenAI Responses'
#: ``mcp_list_tools`` (the tools an MCP server lists, with the descriptions the server wrote).
_LISTED_CALLS = frozenset({"mcp_list_tools"})
#: Block types of a reply that are neither a tool's call nor its result: the model's own text, reasoning and media in
#: LangChain's and the providers' forms (OpenAI Responses' ``message`` of ``output_text``, Bedrock's
#: ``citations_content``, whose text is the model's answer), OpenAI's ``mcp_approval_request`` (a call waiting for the
#: client's approval) and ``program`` (the code the model wrote for programmatic tool calling; its
#: ``program_output`` is a result), and Anthropic's ``container_upload`` (a file the model put in the code execution
#: container, by id). Any other type is read as a server tool's result (:func:`server_blocks`).
_MODEL_BLOCKS = frozenset({"text", "text-plain", "output_text", "message", "reasoning", "reasoning_content", "thinking",
                           "redacted_thinking", "refusal", "compaction", "citation", "citations_content",
                           "non_standard_annotation", "mcp_approval_request", "program", "container_upload",
                           *_MEDIA_BLOCKS})  # fmt: skip
#: Block types ending in ``_call`` that are client tool calls (run by the agent's tools, judged as calls), not a
#: provider's.
_CLIENT_CALLS = frozenset({"function_call", "tool_call", "custom_tool_call", "invalid_tool_call"})
#: Keys of an OpenAI Responses ``*_call`` block (``web_search_call``, ``mcp_call`` ...) that hold what the tool was
#: asked, and those that hold what it gave back.
_CALL_KEYS = ("action", "queries", "code", "arguments", "input", "args", "server_label")
_OUTPUT_KEYS = ("output", "outputs", "results", "result", "error", "tools")


@dataclass(frozen=True)
class ServerBlock:
    """A tool call a provider ran itself, or its result, inside a model's reply.

    Attributes:
        kind: ``call`` or ``result``.
        id: the call's id (a result names the call it answers); ``<type>#<position>`` when the block has none.
        name: the tool's name (for a result, its call's when the reply holds it; else the block type).
        value: a call's arguments (a mapping), or a result's text (:func:`_strings`, as a policy reads a tool result).
        position: the block's index in the reply's content (``-1`` for ``additional_kwargs["tool_outputs"]``).
        unread: for a result, what of it the model reads that guard cannot (:func:`_server_unread`), named as
            :func:`unread_media` names it; ``()`` when it has none.
    """

    kind: Literal["call", "result"]
    id: str
    name: str
    value: Any
    position: int
    unread: tuple[str, ...] = ()


#: What names the ``encrypted_content`` of a server result (Anthropic's ``web_search_result``): text the provider
#: decrypts for the model and guard cannot read.
ENCRYPTED = "encrypted content"


def _server_unread(result: Any) -> tuple[str, ...]:
    """What of a server tool's result guard cannot read: its media (:func:`_unread`: a fetched PDF or image) and, for
    each block at any depth that holds an ``encrypted_content`` string, :data:`ENCRYPTED`."""
    found = _unread(result)
    stack: list[Any] = [result]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if isinstance(item.get("encrypted_content"), str) and item["encrypted_content"]:
                found.append(ENCRYPTED)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return tuple(found)


def _server_arguments(value: Any) -> dict[str, Any]:
    """A server call's arguments as a mapping: as they are, parsed when JSON text (:func:`guard._json.loads`, strict),
    else ``{"input": value}``."""
    if isinstance(value, str):
        try:
            value = strict_json.loads(value)
        except ValueError:
            return {"input": value}
    return dict(value) if isinstance(value, Mapping) else {"input": value}


def _unwrapped(block: Any) -> Any:
    """``block`` without LangChain's ``non_standard`` wrappers (the provider block it does not know, kept under
    ``value``)."""
    while isinstance(block, Mapping) and block.get("type") == "non_standard" and isinstance(block.get("value"), Mapping):
        block = block["value"]
    return block


def server_blocks(message: BaseMessage) -> list[ServerBlock]:
    """The server tool calls and results in ``message``'s content (and ``additional_kwargs["tool_outputs"]``, where
    older LangChain OpenAI integrations keep the Responses API's), in order, each block read inside any
    ``non_standard`` wrapper. A call: a LangChain ``server_tool_call``, an Anthropic ``server_tool_use`` /
    ``mcp_tool_use``, Google's ``executable_code``, or an OpenAI Responses ``*_call`` block other than a client call
    (``web_search_call``, ``file_search_call``, ``code_interpreter_call``, ``mcp_call``, ``computer_call`` ...) or
    ``mcp_list_tools``, which also holds its result (``output``, ``outputs``, ``results``, the listed ``tools``; not an
    ``image_generation_call``'s image, which the provider drew from the model's own prompt). A result:
    ``server_tool_result``, any ``*_tool_result`` (Anthropic's ``web_search_tool_result``, ``web_fetch_tool_result``,
    ``code_execution_tool_result``, ``mcp_tool_result`` ...), Google's ``code_execution_result``, OpenAI's
    ``tool_search_output`` (but one the client ran), and a block of any type that is neither a call nor the model's own
    (:data:`_MODEL_BLOCKS`): a provider's new tool result is read as one, not passed unread."""
    content = message.content if isinstance(message.content, list) else []
    outputs = message.additional_kwargs.get("tool_outputs")
    items = [(-1, block) for block in (outputs if isinstance(outputs, list) else [])] + list(enumerate(content))
    found: list[ServerBlock] = []
    names: dict[str, str] = {}
    for position, wrapped in items:
        block = _unwrapped(wrapped)
        kind = block.get("type") if isinstance(block, Mapping) else None
        if not isinstance(kind, str) or kind in _MODEL_BLOCKS or kind in _CLIENT_CALLS or _is_call_block(block):
            continue
        block_id = next((str(block[key]) for key in ("id", "tool_use_id", "tool_call_id", "call_id")
                         if isinstance(block.get(key), (str, int))), f"{kind}#{position}")  # fmt: skip
        extras = block.get("extras")
        named = block.get("name") or (extras.get("tool_name") if isinstance(extras, Mapping) else None)
        if kind in _SERVER_CALLS:
            name = str(named or ("code_execution" if kind == "executable_code" else kind))
            arguments = next((block[key] for key in ("args", "input", "executable_code", "code") if key in block), {})
            if not arguments and isinstance(block.get("partial_json"), str):
                arguments = block["partial_json"]  # a streamed call's chunks, merged: the input is only this text
            names[block_id] = name
            found.append(ServerBlock("call", block_id, name, _server_arguments(arguments), position))
        elif kind.endswith("_call") or kind in _LISTED_CALLS:
            name = str(named or kind.removesuffix("_call"))
            asked = {key: block[key] for key in _CALL_KEYS if key in block}
            names[block_id] = name
            found.append(ServerBlock("call", block_id, name, _server_arguments(asked.get("arguments", asked)),
                                     position))  # fmt: skip
            output = [block[key] for key in _OUTPUT_KEYS if block.get(key) and key != _MADE_MEDIA.get(kind)]
            if output:
                found.append(ServerBlock("result", block_id, name, "\n".join(_strings(output)), position,
                                         _server_unread(output)))  # fmt: skip
        elif kind != "tool_search_output" or block.get("execution") != "client":
            reply_to = next((str(block[key]) for key in ("tool_use_id", "tool_call_id", "call_id", "id")
                             if isinstance(block.get(key), (str, int))), block_id)  # fmt: skip
            if kind == "code_execution_result" and reply_to == block_id:  # Google's: answers the code just before it
                reply_to = next((b.id for b in reversed(found) if b.kind == "call" and b.name == "code_execution"),
                                block_id)  # fmt: skip
            result = {key: value for key, value in block.items() if key not in ("tool_use_id", "tool_call_id")}
            found.append(ServerBlock("result", reply_to, names.get(reply_to, kind), "\n".join(_strings(result)),
                                     position, _server_unread(result)))  # fmt: skip
    return found


def call_positions(message: BaseMessage) -> dict[str, int]:
    """Call id -> index in ``message``'s content of the block that holds that tool call (a ``tool_use``,
    ``function_call`` or ``tool_call`` block); calls kept outside the content (``tool_calls`` only) are left out."""
    content = message.content if isinstance(message.content, list) else []
    positions: dict[str, int] = {}
    for position, block in enumerate(content):
        if isinstance(block, Mapping) and _is_call_block(block):
            for key in ("id", "call_id"):
                if block.get(key) is not None:
                    positions.setdefault(str(block[key]), position)
    return positions
