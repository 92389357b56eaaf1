"""ServerConfig: the settings of `pagedserve serve` that are not the engine's (EngineConfig).
cli.py makes each field a flag, as it does EngineConfig's."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pagedserve.config import ROUTING_POLICIES, positive_float, setting
from pagedserve.server import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from pagedserve.server.reasoning import REASONING_PARSERS

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TOOL_CALL_PARSERS = ("hermes",)


def _api_key_from_env() -> str | None:
    return os.environ.get("PAGEDSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on; 0.0.0.0 listens on all interfaces")
    port: int = setting(8000, "port to listen on")
    api_key: str | None = setting(default_factory=_api_key_from_env, show_default=False,
                                  help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY or "
                                       "$VLLM_API_KEY)")
    served_model_name: list[str] | None = setting(None, "model name(s) clients use; the first is returned in "
                                                        "responses (default: the model argument)")
    shutdown_timeout: float = setting(5.0, "seconds requests in flight get to finish after SIGTERM before they "
                                           "are aborted")
    max_waiting_requests: int = setting(DEFAULT_MAX_WAITING_REQUESTS, "requests that may wait for the engine; "
                                                                      "beyond it new ones get 503 (<= 0: no limit)")
    max_request_body_bytes: int = setting(DEFAULT_MAX_REQUEST_BODY_BYTES, "largest request body accepted; larger "
                                                                          "ones get 413 (<= 0: no limit)")
    log_stats_interval: float = setting(10.0, "seconds between engine stat lines")
    disable_log_stats: bool = setting(False, "no periodic engine stat lines")
    disable_log_requests: bool = setting(False, "no per-request log lines (id, prompt length, sampling "
                                                "parameters, finish reason, refusals)")
    disable_uvicorn_access_log: bool = setting(False, "no access log line per HTTP request")
    uvicorn_log_level: str = setting("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    # CORS: off unless origins are given (a browser page on another origin may then call the API).
    allowed_origins: list[str] = setting(default_factory=list, help="CORS origins allowed to call the API, or "
                                                                    "'*' (default: none, CORS off)")
    allowed_methods: list[str] = setting(default_factory=lambda: ["*"], help="CORS methods allowed")
    allowed_headers: list[str] = setting(default_factory=lambda: ["*"], help="CORS request headers allowed")
    allow_credentials: bool = setting(False, "CORS: allow cookies and Authorization with cross-origin requests")
    metrics_prefix: str = setting("pagedserve:", "prefix of the Prometheus metric names; vllm: makes vLLM's "
                                                 "Grafana dashboards work")
    kv_snapshot_interval: float = setting(0.5, "seconds between KV snapshots sent to open /dashboard pages",
                                          parse=positive_float)
    # Tool calling: tool_choice "auto" needs both (server/tools.py).
    enable_auto_tool_choice: bool = setting(False, 'let tool_choice "auto" (the default with tools) find calls in '
                                                   "the output; needs --tool-call-parser")
    tool_call_parser: str | None = setting(None, "the format of tool calls in the output for tool_choice auto "
                                                 "(hermes: <tool_call>{...}</tool_call>)", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = setting(None, "split the output's <think>...</think> block into the chat "
                                                 "message's reasoning_content (qwen3: where the output opens "
                                                 "one; deepseek_r1: the output starts inside it)",
                                           choices=REASONING_PARSERS)
    # Data parallelism: this many engine replicas as Ray actors behind one router
    # (pagedserve/cluster/), which sends each request to one of them by `routing_policy`. The
    # serving topology, not an engine setting: each replica runs the same EngineConfig.
    data_parallel_size: int = setting(1, "serve: engine replicas (Ray actors) behind this endpoint",
                                      aliases=("-dp",))
    routing_policy: str = setting("kv_aware", "with data_parallel_size > 1: how a request's replica is chosen",
                                  choices=ROUTING_POLICIES)
    ray_address: str | None = setting(None, "join this Ray cluster ('auto': the one this node is in); default: "
                                            "start a local one")

    # vLLM's server flags of the API surface (issue 33).
    max_log_len: int | None = setting(None, "most prompt characters or token ids a request log line shows "
                                            "(pagedserve's request lines show lengths, not prompts: accepted)")
    disable_fastapi_docs: bool = setting(False, "no /docs, /redoc or /openapi.json")
    response_role: str = setting("assistant", "the role of the message in chat responses (add_generation_prompt)")
    return_tokens_as_token_ids: bool = setting(False, "logprobs name tokens as 'token_id:N' (tokens that are not "
                                                      "valid UTF-8 on their own stay identifiable)")
    enable_responses_api_store: bool = setting(
        default_factory=lambda: os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "") not in ("", "0"),
        show_default=False,
        help="/v1/responses keeps responses created with store=true in memory for previous_response_id, "
             "GET /v1/responses/{id} and cancel (default: off, or $VLLM_ENABLE_RESPONSES_API_STORE)")
    responses_api_store_size: int = setting(1000, "most responses the store keeps (the oldest go first)")
    responses_api_store_bytes: int = setting(64 * 1024**2, "most bytes (their JSON) the responses store keeps "
                                                           "(the oldest go first)")
    # Multi-LoRA (server/lora.py): adapters served by name; needs --enable-lora.
    lora_modules: list[str] | None = setting(None, "LoRA adapters as name=path or JSON {\"name\": ..., \"path\": "
                                                   "..., \"base_model_name\": ...}; the model field picks one")

    # Several models behind one server (server/models_manager.py): the set, and when they load and unload.
    models_dir: str | None = setting(None, "serve every .gguf file and HF directory in this folder, named by its file "
                                           "or directory name, loaded on first request (settings per model: "
                                           "NAME.json or models.json / models.yaml there)")
    keep_alive: str = setting("5m", "with several models: how long a model stays loaded after its last request "
                                    "(a duration: 30s, 5m, 1h; 0: unload at once; -1: keep); a request's "
                                    "keep_alive overrides it")
    max_loaded_models: int = setting(4, "with several models: most models loaded at once; loading one more unloads "
                                        "the least recently used idle one (<= 0: no limit)")
    max_memory: str | None = setting(None, "with several models: the process memory models may fill (a size: 8GiB, "
                                           "or a share of the machine's RAM: 80%); a load past it unloads the least "
                                           "recently used idle model first, or is refused with 503")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}; got "
                             f"{self.routing_policy!r}")
