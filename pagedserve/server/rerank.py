"""Scoring with an embedding model (a pooling engine, `--runner pooling`): /v1/rerank, /rerank and
/v2/rerank (Jina's and Cohere's request shape: `query`, `documents`, `top_n`, `return_documents`)
and vLLM's /score (`text_1` and `text_2`: one against many, or pairwise). The score is the cosine
of the two texts' embeddings, as vLLM scores with a model that is not a cross-encoder; the texts
are embedded together in one /v1/embeddings-style request (EmbeddingServing)."""
from __future__ import annotations

import json
import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedserve.server.embeddings import EmbeddingRequest, EmbeddingServing
from pagedserve.server.errors import bad_request, parse_body
from pagedserve.server.protocol import Int, OpenAIModel, random_id
from pagedserve.server.state import ServerState


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: Int | None = None
    return_documents: bool = True
    max_tokens_per_doc: Int | None = None      # Cohere's: accepted, the model's context applies


class ScoreRequest(OpenAIModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


def _document_text(doc: str | dict[str, Any], i: int) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc.get("text"), str):
        return doc["text"]
    raise bad_request(f"documents[{i}] must be a string or an object with text", "documents")


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


async def _embed(state: ServerState, raw: Request, model: str | None, texts: list[str]) -> tuple[list, int, str]:
    """The texts' embeddings, the prompt tokens, the model name."""
    serving = EmbeddingServing(state, EmbeddingRequest(model=model, input=texts), raw)
    data = json.loads((await serving.create()).body)
    return [d["embedding"] for d in data["data"]], data["usage"]["prompt_tokens"], serving.model


def add_rerank_routes(app: FastAPI, state: ServerState) -> None:
    async def rerank(raw: Request) -> JSONResponse:
        req = await parse_body(raw, RerankRequest)
        texts = [_document_text(d, i) for i, d in enumerate(req.documents)]
        if not texts:
            raise bad_request("documents must not be empty", "documents")
        if req.top_n is not None and req.top_n < 1:
            raise bad_request(f"top_n must be >= 1, got {req.top_n}", "top_n")
        vectors, tokens, model = await _embed(state, raw, req.model, [req.query, *texts])
        results = [{"index": i, "relevance_score": cosine(vectors[0], v)} for i, v in enumerate(vectors[1:])]
        results.sort(key=lambda r: -r["relevance_score"])
        results = results[:req.top_n] if req.top_n else results
        if req.return_documents:
            for r in results:
                r["document"] = {"text": texts[r["index"]]}
        return JSONResponse({"id": random_id("rerank"), "model": model, "usage": {"total_tokens": tokens},
                             "results": results})

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    async def score(raw: Request) -> JSONResponse:
        req = await parse_body(raw, ScoreRequest)
        first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not first or not second:
            raise bad_request("text_1 and text_2 must not be empty", "text_1")
        if len(first) != 1 and len(first) != len(second):
            raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                              f"as text_2 (scored pairwise)", "text_1")
        vectors, tokens, model = await _embed(state, raw, req.model, [*first, *second])
        left, right = vectors[:len(first)], vectors[len(first):]
        pairs = [(left[0] if len(left) == 1 else left[i], r) for i, r in enumerate(right)]
        return JSONResponse({"id": random_id("score"), "object": "list", "created": int(time.time()), "model": model,
                             "data": [{"index": i, "object": "score", "score": cosine(a, b)}
                                      for i, (a, b) in enumerate(pairs)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
