"""Command line: pagedserve generate | chat | serve."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pagedserve.config import (ATTENTION_BACKENDS, DEVICES, DISTRIBUTED_EXECUTOR_BACKENDS, DTYPES, KV_ALLOCATORS,
                               PREEMPTION_MODES)
from pagedserve.server import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as `vllm serve` names them."""
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-allocator", default="paged", choices=KV_ALLOCATORS,
                   help="paged, or a baseline reserving one contiguous region per request")
    p.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
    p.add_argument("--swap-space", type=int, default=0, help="bytes of host memory for swapped blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help=f"{' | '.join(DEVICES)} (default: cuda when available)")
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                   help="default: triton on cuda, cpu (the C++ kernel) on cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="without --kv-cache-memory on CUDA: share of free GPU memory for weights + KV cache")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (processes), each holding its shard")
    p.add_argument("--distributed-executor-backend", default=None, choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                   help="mp: processes on this machine (default); ray: Ray actors on a Ray cluster")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch/OpenMP threads per rank (default: the cores / --tensor-parallel-size)")
    p.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="seconds a tensor-parallel collective waits for a rank before the engine fails")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, kv_allocator=args.kv_allocator,
                preemption_mode=args.preemption_mode,
                swap_space=args.swap_space, seed=args.seed, device=args.device,
                attention_backend=args.attention_backend, gpu_memory_utilization=args.gpu_memory_utilization,
                tensor_parallel_size=args.tensor_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend,
                threads_per_rank=args.threads_per_rank, distributed_timeout=args.distributed_timeout)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from pagedserve import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve import LLM
    start = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt or ["The capital of France is"]
    outs = llm.generate(prompts, sampling_params(args), use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(f"--- prompt: {out.prompt!r}")
        print(out.outputs[0].text)
    llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"--- {len(outs)} prompt(s), {n} tokens generated, {elapsed:.1f}s including model load", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    messages = args.message or None
    while True:
        if messages is not None:
            if not messages:
                return 0
            text = messages.pop(0)
            print(f"> {text}")
        else:
            try:
                text = input("> ")
            except EOFError:
                return 0
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        history.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineConfig
    from pagedserve.server.app import run_server
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    model = args.model_tag or args.model
    config = EngineConfig(model=model, **engine_kwargs(args))
    return run_server(config, host=args.host, port=args.port, served_model_names=args.served_model_name,
                      api_key=args.api_key, shutdown_timeout=args.shutdown_timeout,
                      max_waiting_requests=args.max_waiting_requests,
                      max_request_body_bytes=args.max_request_body_bytes,
                      log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                      access_log=not args.disable_uvicorn_access_log, log_level=args.uvicorn_log_level)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None,
                   help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is returned in responses")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds requests in flight get to finish after SIGTERM before they are aborted")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests that may wait for the engine; beyond it new ones get 503 (<= 0: no limit)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="largest request body accepted; larger ones get 413 (<= 0: no limit)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between engine stat lines")
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"])
    add_engine_args(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts offline")
    gen.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    chat.add_argument("--model", default=None)
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--message", action="append", help="send these messages instead of reading stdin")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
