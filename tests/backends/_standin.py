"""A local stand-in of Cloudflare Workers AI's Clef endpoint, served by uvicorn, with scripted failure scenarios.

The account id in the path picks the scenario (``/client/v4/accounts/<scenario>/ai/run/@cf/cloudflare/<model>``);
every call is recorded so tests can count attempts and read the headers and body the client sent.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

PATH = "/client/v4/accounts/{scenario}/ai/run/@cf/cloudflare/{model}"
HTML_ERROR = "<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body><h1>Bad gateway</h1></body></html>"


#: An answer of 8 MiB that is all empty arrays (``{"answers":[[],[],...]}``).
LISTS = b'{"answers":[' + b"[]," * (8 * 1024 * 1024 // 3 - 8) + b"[]]}"
#: Answers of 8 MiB that hold two arrays and objects beside millions of scalars, by scenario.
SCALARS = {
    "floats-200": b'{"answers":{},"x":[' + b"0.5," * (8 * 1024 * 1024 // 4 - 8) + b"0.5]}",
    "ints-200": b'{"answers":{},"x":[' + b"0," * (8 * 1024 * 1024 // 2 - 16) + b"0]}",
    "keys-200": b'{"answers":{},"x":{' + b",".join(b'"%x":0' % i for i in range(900_000)) + b"}}",
}


def answers_for(body: dict[str, Any], *, decimals: int = 4) -> dict[str, Any]:
    """A valid System One ``answers`` object for a request body (first option favoured)."""
    answers: dict[str, Any] = {}
    for qid, question in body["questions"].items():
        if question["type"] == "noul":
            answers[qid] = {"type": "noul", "noul": 0.7}
            continue
        options = (
            list(question["criteria"])
            if question["type"] == "choice"
            else [str(i) for i in range(len(question["criteria"]))]
        )
        rest = round(0.4 / (len(options) - 1), decimals)
        probabilities = {option: (0.6 if i == 0 else rest) for i, option in enumerate(options)}
        if question["type"] == "choice":
            answers[qid] = {"type": "choice", "choice": options[0], "confidence": 0.6, "probabilities": probabilities}
        else:
            score = sum(i * p for i, p in enumerate(probabilities.values()))
            legend = {str(i): c for i, c in enumerate(question["criteria"])}
            answers[qid] = {
                "type": "score",
                "score": round(score, decimals),
                "confidence": 0.6,
                "legend": legend,
                "probabilities": probabilities,
            }
    return answers


def envelope(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


def failure(message: str, code: int) -> dict[str, Any]:
    return {"result": {}, "success": False, "errors": [{"message": message, "code": code}], "messages": []}


class WorkersAIStandIn:
    """Scenarios (the account id): ``ok``, ``unwrapped``, ``rejected`` (400/5006), ``success-false`` (200 with
    ``success: false``), ``busy-then-ok`` (429 + ``Retry-After: 1``, then ok), ``busy-no-header`` (two 429/3040 without
    ``Retry-After``, then ok), ``always-busy``, ``busy-long`` (429 + ``Retry-After: 30``), ``flaky-5xx`` (503 then ok),
    ``always-500``, ``html-502``, ``huge-503`` (a 9 MiB error page), ``html-200``,
    ``html-type-answer`` and ``no-type-answer`` (a valid answer as ``text/html`` or with no ``Content-Type``),
    ``status-203`` and ``status-299`` (a valid answer under that status), ``choice-list`` and ``choice-object`` (a
    choice that is a JSON array or object), ``oversized`` (a valid answer padded to 9 MiB), ``gzip`` (a valid
    answer, gzip-compressed), ``truncated`` (also naming a model revision), ``long-revision`` (a valid answer naming
    a model revision of 600 characters), ``other-model`` (a valid answer naming another model), ``list-model`` (naming it as a list), ``missing-answer``, ``nan``, ``bad-sum``,
    ``two-decimals`` (probabilities rounded to 2 dp, summing to 0.99), ``unprocessable`` (422), ``slow`` (sleeps 3 s),
    ``wrong-choice`` (the choice is the least probable option), ``wrong-score`` (score 3 where the probabilities give
    0.8), ``success-false-with-answers`` (``success: false`` beside valid ``answers``), ``echo-422`` (FastAPI's
    validation error, which repeats the request's ``state`` as its ``input`` and in its ``ctx``, and the whole request
    as ``body``, as FastAPI's documented handler adds it), ``lists-200`` and ``lists-500`` (:data:`LISTS` under that
    status), ``short-lists-200`` (its last 30 KB), ``floats-200``, ``ints-200`` and ``keys-200`` (:data:`SCALARS`), ``extras`` (a valid answer indented,
    non-ASCII escaped, with fields a provider may add to the body and to each answer).
    """

    def __init__(self) -> None:
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.app = Starlette(routes=[Route(PATH, self.run, methods=["POST"])])

    async def run(self, request: Request) -> Response:
        scenario = request.path_params["scenario"]
        self.calls[scenario] += 1
        n = self.calls[scenario]
        body = json.loads(await request.body())
        self.requests.append((scenario, dict(request.headers), body))
        result = {
            "model": body["model"],
            "answers": answers_for(body),
            "usage": {"input_tokens": 42, "output_tokens": 0},
        }
        if scenario == "ok":
            return JSONResponse(envelope(result), headers={"cf-ai-req-id": "standin"})
        if scenario == "unwrapped":
            return JSONResponse(result)
        if scenario == "long-revision":
            return JSONResponse(envelope(result), headers={"x-guard-model-revision": "r" * 600})
        if scenario == "rejected":
            message = "required properties at '/' are 'model,state,questions'"
            return JSONResponse(failure(message, 5006), status_code=400)
        if scenario == "success-false":
            return JSONResponse(failure("Clef inference failed", 5012))
        if scenario == "busy-then-ok" and n == 1:
            return JSONResponse(
                failure("Capacity temporarily exceeded", 3040), status_code=429, headers={"retry-after": "1"}
            )
        if scenario == "busy-no-header" and n <= 2:
            return JSONResponse(failure("Capacity temporarily exceeded", 3040), status_code=429)
        if scenario == "always-busy":
            return JSONResponse(failure("Capacity temporarily exceeded", 3040), status_code=429)
        if scenario == "busy-long":
            return JSONResponse(
                failure("Daily allocation exhausted", 4006), status_code=429, headers={"retry-after": "30"}
            )
        if scenario == "flaky-5xx" and n == 1:
            return JSONResponse(failure("upstream unavailable", 7001), status_code=503)
        if scenario == "always-500":
            return Response("Internal Server Error", status_code=500)
        if scenario == "html-502":
            return Response(HTML_ERROR, status_code=502, media_type="text/html")
        if scenario == "huge-503":  # an error page past what a client reads of an answer
            return Response(HTML_ERROR + " " * (9 << 20), status_code=503, media_type="text/html")
        if scenario == "html-200":
            return Response(HTML_ERROR, media_type="text/html")
        if scenario == "html-type-answer":  # a valid answer's JSON, served as a page
            return Response(json.dumps(envelope(result)), media_type="text/html")
        if scenario == "no-type-answer":
            return Response(json.dumps(envelope(result)))
        if scenario in ("status-203", "status-299"):  # a valid answer under a 2xx that is not 200
            return JSONResponse(envelope(result), status_code=int(scenario.removeprefix("status-")))
        if scenario in ("choice-list", "choice-object"):  # the choice as a JSON array or object
            for answer in result["answers"].values():
                if answer["type"] == "choice":
                    answer["choice"] = [answer["choice"]] if scenario == "choice-list" else {answer["choice"]: 1}
            return JSONResponse(envelope(result))
        if scenario == "oversized":  # a valid answer padded past what a client reads
            text = json.dumps(envelope({**result, "padding": " " * (9 * 1024 * 1024)})).encode()
            return Response(text, media_type="application/json")
        if scenario == "gzip":
            text = json.dumps(envelope(result)).encode()
            return Response(gzip.compress(text), media_type="application/json", headers={"content-encoding": "gzip"})
        if scenario == "truncated":
            return Response(json.dumps(envelope(result))[:-25], media_type="application/json",
                            headers={"x-guard-model-revision": "from-a-broken-answer"})
        if scenario == "other-model":
            return JSONResponse(envelope({**result, "model": "some-other-model"}))
        if scenario == "list-model":
            return JSONResponse(envelope({**result, "model": ["clef-flash"]}))
        if scenario == "missing-answer":
            result["answers"].popitem()
            return JSONResponse(envelope(result))
        if scenario == "nan":
            first = next(iter(result["answers"].values()))
            first["noul"] = "__NAN__"
            return Response(json.dumps(envelope(result)).replace('"__NAN__"', "NaN"), media_type="application/json")
        if scenario == "bad-sum":
            for answer in result["answers"].values():
                if "probabilities" in answer:
                    first_option = next(iter(answer["probabilities"]))
                    answer["probabilities"][first_option] = 0.4
            return JSONResponse(envelope(result))
        if scenario == "two-decimals":
            result["answers"] = answers_for(body, decimals=2)
            return JSONResponse(envelope(result))
        if scenario == "wrong-choice":
            for answer in result["answers"].values():
                if answer["type"] == "choice":
                    answer["choice"] = list(answer["probabilities"])[-1]
            return JSONResponse(envelope(result))
        if scenario == "wrong-score":
            for answer in result["answers"].values():
                if answer["type"] == "score":
                    answer["score"] = len(answer["probabilities"]) - 1
            return JSONResponse(envelope(result))
        if scenario == "success-false-with-answers":
            return JSONResponse({**result, **failure("Clef inference failed", 5012)} | {"answers": result["answers"]})
        if scenario == "unprocessable":
            return JSONResponse(failure("Unknown field 'extra'", 5012), status_code=422)
        if scenario == "echo-422":  # pydantic's error (input, and ctx quoting it) and FastAPI's documented body echo
            state = body.get("state")
            detail = [{"type": "value_error", "loc": ["body", "state"], "msg": "Input should be a valid string",
                       "input": state, "ctx": {"error": f"ValueError('bad state {json.dumps(state)}')"}}]
            return JSONResponse({"detail": detail, "body": body}, status_code=422)
        if scenario == "slow":
            await asyncio.sleep(3)
            return JSONResponse(envelope(result))
        if scenario == "latin1-header":  # a valid answer under a header value that is not ASCII (a CDN's)
            return Response(json.dumps(envelope(result)), media_type="application/json",
                            headers={"x-served-by": "cdn-é"})
        if scenario == "huge-error":
            return JSONResponse(failure("E" * 2_000_000, 5006), status_code=400)
        if scenario in SCALARS:
            return Response(SCALARS[scenario], media_type="application/json")
        if scenario == "extras":
            for answer in result["answers"].values():
                answer |= {"logits": [-0.1, -2.3], "token_ids": [4521, 880], "raw": "<answer>" + "x" * 200 + "</answer>"}
            result |= {"id": "chatcmpl-" + "a" * 40, "timings": {"queue_ms": 1.5, "forward_ms": 20.25},
                       "warnings": ["state cut to fit max_length"], "system_fingerprint": "fp_" + "b" * 60}
            return Response(json.dumps(envelope(result), indent=4), media_type="application/json")
        if scenario == "short-lists-200":  # 30 KB: within a small request's size, past its arrays and objects
            return Response(LISTS[:12] + LISTS[-30_000:], media_type="application/json")
        if scenario in ("lists-200", "lists-500"):  # 8 MiB of empty arrays: 2.8 million lists for json to build
            return Response(LISTS, media_type="application/json", status_code=int(scenario.removeprefix("lists-")))
        return JSONResponse(envelope(result))


@contextmanager
def socket_that_resets(answer: bytes = b"") -> Iterator[str]:
    """A TCP listener that accepts each connection, reads a little, sends ``answer`` (nothing by default; a
    malformed HTTP head, say) and closes it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection:
                connection.settimeout(1)
                try:
                    connection.recv(1024)
                    connection.sendall(answer)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(5)
