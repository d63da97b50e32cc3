"""A degenerate System One server: the backend that always says "no" (for canary and health tests)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def always_no_app(calls: list[int] | None = None) -> Starlette:
    """A System One server that answers "false" (or the first option) with certainty to every question; each request
    appends to ``calls`` when given."""

    async def systemone(request: Request) -> JSONResponse:
        if calls is not None:
            calls.append(1)
        body = await request.json()
        answers = {}
        for qid, q in body["questions"].items():
            if q["type"] == "noul":
                answers[qid] = {"type": "noul", "noul": 0.0, "confidence": 1.0,
                                "probabilities": {"true": 0.0, "false": 1.0}}  # fmt: skip
            else:
                options = list(q["criteria"]) if q["type"] == "choice" else [str(i) for i in range(len(q["criteria"]))]
                probabilities = {o: float(i == 0) for i, o in enumerate(options)}
                answers[qid] = {"type": q["type"], "probabilities": probabilities, "confidence": 1.0,
                                **({"choice": options[0]} if q["type"] == "choice" else {"score": 0.0})}  # fmt: skip
        return JSONResponse({"model": body["model"], "answers": answers, "usage": {"input_tokens": 9}})

    return Starlette(routes=[Route("/v1/systemone", systemone, methods=["POST"])])
