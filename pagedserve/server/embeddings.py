"""/v1/embeddings: OpenAI's embeddings over a pooling engine (`--runner pooling`).

`input` is a string, a list of strings, a list of token ids or a list of those; each is one
engine request with PoolingParams (prefill only, through the same scheduler and KV cache as
generation), answered together. `encoding_format` float (lists of numbers) or base64 (the
little-endian float32 bytes, what the openai client asks for by default); `dimensions` only
where the model allows (the engine refuses it otherwise). A generating server answers 400
naming the flag.
"""
from __future__ import annotations

import base64
import logging
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedserve.errors import InvalidRequestError
from pagedserve.pooling_params import PoolingParams
from pagedserve.server.errors import bad_request, parse_body
from pagedserve.server.protocol import Int, OpenAIModel
from pagedserve.server.serving import Serving, completion_prompts
from pagedserve.server.state import ServerState

logger = logging.getLogger(__name__)


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    truncate_prompt_tokens: Int | None = None
    cache_salt: str | None = None


class EmbeddingServing(Serving):
    """One /v1/embeddings request: Serving's submit, wait and abort, with pooling requests."""
    id_prefix = "embd"
    prompt_param = "input"

    def __init__(self, state: ServerState, body: EmbeddingRequest, raw: Request) -> None:
        # Serving.__init__ reads a sampling request's fields; an embedding request has none of them.
        self.start_request(state, body, raw)
        self.n = 1

    def log_start(self, items: list) -> None:
        if self.state.log_requests:
            logger.info("request %s: %d input(s) of %s tokens to embed", self.id, len(items),
                                     "/".join(str(len(ids)) for _, ids, _ in items))

    async def create(self) -> JSONResponse:
        if not self.state.pooling:
            raise bad_request("this server generates: embeddings need a pooling model, started with --runner "
                              "pooling (or --convert embed)", "model")
        body = self.body
        try:
            params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                                   truncate_prompt_tokens=body.truncate_prompt_tokens)
        except InvalidRequestError as e:
            raise bad_request(e.message, e.param) from None
        inputs = completion_prompts(body.input)
        if not inputs:
            raise bad_request("input must not be empty", "input")
        self.state.prompts.check_num_prompts(len(inputs), "input")
        texts = [p for p in inputs if isinstance(p, str)]
        encoded = iter(await self.state.prompts.encode(texts, "input"))
        items = []
        for p in inputs:
            text, ids = (p, next(encoded)) if isinstance(p, str) else (None, list(p))
            items.append((text, ids, params))
        finals = await self.final_outputs(await self.submit(items))
        data = [{"object": "embedding", "index": i, "embedding": _encode(out.embedding, body.encoding_format)}
                for i, out in enumerate(finals)]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        return JSONResponse({"id": self.id, "object": "list", "created": self.created, "model": self.model,
                             "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


def _encode(embedding: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
    return embedding


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(raw: Request) -> Any:
        body = await parse_body(raw, EmbeddingRequest)
        return await EmbeddingServing(state, body, raw).create()
