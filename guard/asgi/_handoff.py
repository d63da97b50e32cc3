"""The ``handoff`` verdict over HTTP: the request goes to the policy's LLM target and its answer to the client.

The answer is the target's own OpenAI ``chat.completion`` object, or, when the client asked for a stream
(``"stream": true`` in a JSON body or ``Accept: text/event-stream``), its ``chat.completion.chunk`` events relayed as
server-sent events as they arrive, ending with ``data: [DONE]``. A target that fails before answering gives a 502;
one that fails mid-stream ends the stream with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import Receive, Send

from guard.asgi._responses import HANDOFF_FAILED, HeaderList, send_json
from guard.asgi.handoff import HandoffClient, HandoffTarget
from guard.errors import HandoffError
from guard.policy import Policy
from guard.subject import HttpSubject
from guard.verdict import Verdict

__all__ = ["respond_with_handoff", "wants_stream"]

_SSE_HEADERS: HeaderList = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_TOLD = {
    "timeout": "The handoff target did not answer in time.",
    "unavailable": "The handoff target is unavailable.",
    "malformed": "The handoff target sent a malformed answer.",
    "unknown_target": "The policy names a handoff target this gateway does not have.",
}
logger = logging.getLogger("guard.asgi")


def wants_stream(subject: HttpSubject) -> bool:
    """The client asked for a stream: ``"stream": true`` in a JSON object body or ``Accept: text/event-stream``."""
    body = subject.body
    if isinstance(body, dict) and body.get("stream") is True:
        return True
    return "text/event-stream" in subject.headers.get("accept", "")


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def _told(exc: HandoffError) -> str:
    """What the client is told of a failed handoff: its kind, never the target's address or its error text (a
    provider's error can name keys, organisations and internal hosts); the whole error is logged."""
    logger.warning("handoff failed: %s", exc)
    if exc.reason.startswith("http_"):
        return "The handoff target answered with an error."
    return _TOLD.get(exc.reason, "The handoff target could not answer.")


async def _failed(send: Send, exc: HandoffError, verdict: Verdict, headers: HeaderList) -> None:
    await send_json(send, 502, {
        "code": HANDOFF_FAILED, "message": _told(exc), "reason": exc.reason, "target": exc.target,
        "policy": verdict.policy_id, "rule": verdict.rule, "decision_id": verdict.decision_id,
    }, headers)


async def _until_disconnect(receive: Receive) -> None:
    """Read ``receive`` (the request body already read) until ``http.disconnect``."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond_with_handoff(
    client: HandoffClient, policy: Policy, verdict: Verdict, subject: HttpSubject, send: Send, headers: HeaderList,
    receive: Receive | None = None,
) -> str:
    """Answer the request with the LLM target's answer. Returns the outcome for the counters: ``answered``,
    ``streamed``, ``failed`` or ``client_gone``.

    With ``receive`` (called only after the whole body was read), the call to the target is cancelled, and its
    connection closed, when the client leaves (``http.disconnect``): uvicorn's ``send`` returns quietly once the client
    has gone, so the answer would otherwise be read to its end (a stream for up to ``stream_timeout``) for nobody.
    """
    answering = asyncio.ensure_future(_answer(client, policy, verdict, subject, send, headers))
    if receive is None:
        return await answering
    watching = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((answering, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request is cancelled: the call to the target goes down with it
        answering.cancel()
        watching.cancel()
        await asyncio.gather(answering, watching, return_exceptions=True)
    if answering.cancelled():
        watching.result()  # an error of receive() itself
        return "client_gone"
    return answering.result()


async def _answer(
    client: HandoffClient, policy: Policy, verdict: Verdict, subject: HttpSubject, send: Send, headers: HeaderList
) -> str:
    try:
        target: HandoffTarget = client.resolve(verdict.handoff, policy.handoff_targets)
    except HandoffError as exc:
        await _failed(send, exc, verdict, headers)
        return "failed"
    headers = [*headers, (b"x-guard-handoff", target.name.encode("latin-1", "replace"))]
    # the messages redact the secret-named fields of the whole body (a regular expression per key): on a thread
    messages = await asyncio.to_thread(client.messages_for, verdict, subject, target=target)
    if not wants_stream(subject):
        try:
            reply = await client.acomplete(target, messages)
        except HandoffError as exc:
            await _failed(send, exc, verdict, headers)
            return "failed"
        await send_json(send, 200, reply.raw, headers)
        return "answered"
    stream = client.astream(target, messages)
    try:
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        except HandoffError as exc:
            await _failed(send, exc, verdict, headers)
            return "failed"
        await send({"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, *headers]})
        if first is not None:
            await send({"type": "http.response.body", "body": _event(first.data), "more_body": True})
            try:
                async for chunk in stream:
                    await send({"type": "http.response.body", "body": _event(chunk.data), "more_body": True})
            except HandoffError as exc:
                error = {"error": {"code": HANDOFF_FAILED, "reason": exc.reason, "message": _told(exc)}}
                await send({"type": "http.response.body", "body": _event(error), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return "streamed"
    except OSError:  # the client went away mid-stream (uvicorn's ClientDisconnected)
        return "client_gone"
    finally:
        await stream.aclose()
