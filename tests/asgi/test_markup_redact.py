"""HTML and XML bodies through the real middleware: judged as written and as a parser reads them (character
references decoded, CDATA unwrapped), sent on as written. A ``redact`` verdict masks the text as sent and nothing
else; a span only the parser's reading holds cannot be masked in place, so the request or response is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from guard.asgi.limits import BodyLimits
from guard.engine.verdicts import UNMASKABLE
from tests.asgi._apps import client_for
from tests.asgi.test_respond import rules_only

pytestmark = pytest.mark.anyio

POLICY = r"""
policies:
  - id: keys-in
    version: 1
    match: {http: {methods: [POST], paths: ["/in/**"]}}
    state: {text: request_text}
    rules:
      - id: keys
        when: 'state.text.matches("sk-")'
        action: redact
        redact: {patterns: {api_key: 'sk-[A-Za-z0-9]{8,}'}}
  - id: leaks
    version: 1
    match: {http: {paths: ["/out/**"], response: {}}}
    state: {text: body_text}
    rules:
      - {id: secret, when: 'state.text.contains("SECRET-PLAN")', action: block}
      - id: keys
        when: 'state.text.matches("sk-")'
        action: redact
        redact: {patterns: {api_key: 'sk-[A-Za-z0-9]{8,}'}}
"""
MEDIA = ["text/html", "application/xml"]
#: The application escaped what a user wrote; the key is in clear: masked where it is, the rest sent as written.
ESCAPED = "<p>you wrote: &lt;img src=x onerror=alert(1)&gt; key sk-abcdefgh1234</p>"
ESCAPED_MASKED = "<p>you wrote: &lt;img src=x onerror=alert(1)&gt; key [REDACTED:api_key]</p>"
#: Keys that only the parser's reading holds whole: no span of the text as written masks them.
UNMASKABLE_KEYS = [
    "<p>your key: sk-&#97;bcdefgh1234</p>",  # a reference inside the key
    "<p>your key: sk-abcdefgh&#49;&#50;&#51;&#52;</p>",  # the text holds sk-abcdefgh; its end is only read
    "<a>your key: sk-abcd<![CDATA[efgh1234]]></a>",
]


async def _seen(request: Request) -> Response:
    return Response(await request.body(), media_type="text/plain")


@pytest.mark.parametrize("media", MEDIA)
async def test_a_redacted_markup_request_reaches_the_app_as_sent_with_only_the_key_masked(media: str) -> None:
    """The app got the body re-encoded from guard's judged text: the written text, a line break, then the parsed
    copy (``<img ...>`` live markup; the key's written copy unmasked where it was spelled with references)."""
    guard, app = rules_only(POLICY, [Route("/in/x", _seen, methods=["POST"])])
    async with client_for(app) as client:
        masked = await client.post("/in/x", content=ESCAPED.encode(), headers={"content-type": media})
        refused = [await client.post("/in/x", content=body.encode(), headers={"content-type": media})
                   for body in UNMASKABLE_KEYS]
    await guard.aclose()
    assert masked.status_code == 200 and masked.text == ESCAPED_MASKED
    assert masked.headers["content-length"] == str(len(ESCAPED_MASKED))
    for response in refused:
        assert response.status_code == 422 and response.json()["message"] == UNMASKABLE, response.text


@pytest.mark.parametrize("media", MEDIA)
async def test_a_redacted_markup_response_is_sent_as_written_with_only_the_key_masked(media: str) -> None:
    bodies = [ESCAPED, *UNMASKABLE_KEYS]

    async def page(request: Request) -> Response:
        return Response(bodies[int(request.path_params["i"])], media_type=media)

    guard, app = rules_only(POLICY, [Route("/out/{i:int}", page)])
    async with client_for(app) as client:
        masked, *refused = [await client.get(f"/out/{i}") for i in range(len(bodies))]
    await guard.aclose()
    assert masked.status_code == 200 and masked.text == ESCAPED_MASKED
    for response in refused:
        assert response.status_code == 403 and response.json()["message"] == UNMASKABLE, response.text
        assert "bcdefgh" not in response.text and "efgh1234" not in response.text


@pytest.mark.parametrize(("chunks", "status", "sent"), [
    (["<p>the plan is SECRET&#45;PLAN</p>"], 403, None),
    (["<a>SECRET<![CDATA[-PLAN]]></a>"], 403, None),
    (["<p>your key: sk-&#97;bcdefgh1234</p>"], 403, UNMASKABLE),
    (["<p>your key: sk-&#9", "7;bcdefgh1234</p>"], 403, UNMASKABLE),  # a reference cut by a flush
    (["<p>your key: sk-abcdefgh&#49;&#50;&#51;&#52;</p>"], 403, UNMASKABLE),
    ([ESCAPED], 200, ESCAPED_MASKED),
])  # fmt: skip
@pytest.mark.parametrize("media", MEDIA)
async def test_streamed_markup_is_judged_as_a_parser_reads_it(chunks: list[str], status: int, sent: str | None,
                                                               media: str) -> None:
    """A streamed HTML or XML window is read as a whole body is: ``SECRET&#45;PLAN`` and a key spelled with a
    reference passed as sent (streamed, guard judged only the markup)."""
    async def body() -> AsyncIterator[bytes]:
        for i, chunk in enumerate(chunks):
            if i:
                await asyncio.sleep(0.2)  # past stream_flush_s: what is held is judged as it stands
            yield chunk.encode()

    async def stream(request: Request) -> Response:
        return StreamingResponse(body(), media_type=media)

    guard, app = rules_only(POLICY, [Route("/out/x", stream)], limits=BodyLimits(stream_flush_s=0.05))
    async with client_for(app) as client:
        response = await client.get("/out/x")
    await guard.aclose()
    assert response.status_code == status, response.text
    if status == 200:
        assert response.text == sent
    else:
        assert "bcdefgh" not in response.text and "PLAN" not in response.text
        assert sent is None or response.json()["message"] == sent


@pytest.mark.parametrize("media", MEDIA)
async def test_a_numeric_reference_of_thousands_of_digits_is_read_not_a_500(media: str) -> None:
    """``html.unescape`` calls ``int()`` on a reference's digits, which raises past 4,300 of them: a 4 KB body was
    a 500 with a traceback and no decision. Leading zeros are dropped first (``&#000...65;`` is ``A``, as browsers
    read it); more digits than any character has read as U+FFFD."""
    padded = "<p>the plan is SECRET&#" + "0" * 4400 + "45;PLAN</p>"
    huge = "<p>hi &#" + "9" * 4400 + "; there</p>"
    guard, app = rules_only(POLICY, [Route("/in/x", _seen, methods=["POST"])])
    async with client_for(app) as client:
        read = await client.post("/in/x", content=huge.encode(), headers={"content-type": media})
    await guard.aclose()

    async def page(request: Request) -> Response:
        return Response(padded, media_type=media)

    guard, app = rules_only(POLICY, [Route("/out/x", page)])
    async with client_for(app) as client:
        blocked = await client.get("/out/x")
    await guard.aclose()
    assert (read.status_code, read.text) == (200, huge)
    assert blocked.status_code == 403 and "SECRET" not in blocked.text


@pytest.mark.parametrize("body", [
    b'data={"note": "my key \\u0073k-abcdefgh1234"}',  # a field the application reads with json.loads
    b'{"note": "my key \\u0073k-abcdefgh1234"}',  # a form body that is JSON: request.json() reads it
])  # fmt: skip
async def test_a_form_whose_json_spells_a_key_is_refused_not_passed_unmasked(body: bytes) -> None:
    """The key is judged as the JSON in the form decodes (``sk-...``), but no span of the form as written is it: the
    request is refused (422) rather than passed on with the key the application decodes."""
    guard, app = rules_only(POLICY, [Route("/in/x", _seen, methods=["POST"])])
    async with client_for(app) as client:
        response = await client.post("/in/x", content=body,
                                     headers={"content-type": "application/x-www-form-urlencoded"})
    await guard.aclose()
    assert response.status_code == 422 and response.json()["message"] == UNMASKABLE, response.text
