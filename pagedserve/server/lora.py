"""The server's LoRA adapters (vLLM's interface): `--lora-modules name=path` (or vLLM's JSON
form), each adapter a model name clients pick with the request's `model` field, listed in
/v1/models with the base model as `parent`, and, when $VLLM_ALLOW_RUNTIME_LORA_UPDATING is
true, loaded and unloaded at run time by POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(behind the API key like every /v1 route).

An adapter is checked against the base model when it is loaded (a bad one is a 400 and changes
nothing); the engine checks it again, once, at its first request. Unloading removes the name:
requests already running with it finish with it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import Response
from typing import Annotated

from pydantic import BaseModel, Field

from pagedserve.lora.adapter import LoRAAdapterError, read_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.server.errors import APIError, bad_request, parse_body

logger = logging.getLogger("pagedserve.server")

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
            return str(d["name"]), str(d["path"]), d.get("base_model_name")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules {text!r}: not name=path nor JSON with name and path ({e})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or JSON")
    return name, path, None


class ServerLoRAs:
    """Adapter names -> LoRARequests (ids 1, 2, ... in order of loading, never reused)."""

    def __init__(self, modules: list[str] | None = None) -> None:
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        for text in modules or ():
            self.add(*parse_lora_module(text))

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.adapters:
            raise bad_request(f"the LoRA adapter {name!r} has already been loaded", "lora_name")
        try:
            lora = LoRARequest(name, self._next_id, path, base_model_name)
        except ValueError as e:
            raise bad_request(str(e), "lora_path" if name and name.isprintable() else "lora_name") from None
        self._next_id += 1
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name", "model_not_found")
        return lora


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


async def check_adapter(state, lora: LoRARequest) -> None:
    """A 400 if the adapter cannot be served over this base model (where the engine runs in this
    process; behind data-parallel replicas the engine's own check at the first request decides)."""
    args = getattr(state.llm, "model_args", None)
    if args is None:
        return
    try:
        await asyncio.to_thread(read_adapter, lora.lora_path, lora.lora_name, args, state.llm.config.max_lora_rank)
    except LoRAAdapterError as e:
        raise bad_request(e.message, "lora_path") from None


async def check_startup_adapters(state) -> None:
    """The --lora-modules adapters, once the engine is ready: a bad one is logged and dropped."""
    for name, lora in list(state.loras.adapters.items()):
        try:
            await check_adapter(state, lora)
        except APIError as e:
            logger.error("--lora-modules %r: %s; not served", name, e.message)
            del state.loras.adapters[name]


class LoadLoRARequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, state) -> None:
    """The runtime load and unload routes, only when $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true
    (otherwise they do not exist: 404, as in vLLM)."""
    if state.loras is None or not runtime_updates_allowed():
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> Response:
        body = await parse_body(raw, LoadLoRARequest)
        if body.lora_name in state.loras.adapters or body.lora_name in state.served_model_names:
            raise bad_request(f"the LoRA adapter {body.lora_name!r} has already been loaded", "lora_name")
        try:
            lora = LoRARequest(body.lora_name, 1, body.lora_path)     # the check's; add assigns the id
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        await check_adapter(state, lora)
        state.loras.add(body.lora_name, body.lora_path)
        logger.info("loaded LoRA adapter %r from %r", body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> Response:
        body = await parse_body(raw, UnloadLoRARequest)
        state.loras.remove(body.lora_name)
        logger.info("unloaded LoRA adapter %r", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def lora_cards(state) -> list:
    """/v1/models entries of the adapters: id its name, root its path, parent the base model."""
    from pagedserve.server.protocol import ModelCard
    if state.loras is None:
        return []
    return [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or state.model_name,
                      max_model_len=state.llm.max_model_len) for name, lora in state.loras.adapters.items()]
