"""Command line: pagedserve generate | chat | serve."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import types
import typing

from pagedserve.config import EngineConfig
from pagedserve.models.presets import is_preset
from pagedserve.models.gguf_reader import GGUFFileError
from pagedserve.models.resolve import ModelNotFoundError, resolve_model
from pagedserve.server.config import ServerConfig

# vLLM options pagedserve does not implement, for a clearer refusal than "unrecognized arguments".
VLLM_ONLY_OPTIONS = (
    "--speculative-config", "--pipeline-parallel-size", "-pp", "--kv-cache-dtype", "--cpu-offload-gb",
    "--limit-mm-per-prompt", "--mm-processor-kwargs", "--guided-decoding-backend",
    "--rope-scaling", "--rope-theta", "--tokenizer-mode", "--task", "--config",
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an option we do not have is refused as not supported (naming vLLM's
    options that pagedserve lacks), not as "unrecognized arguments"."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        unknown = [a.split("=", 1)[0] for a in extras if a.startswith("-")]
        if unknown:
            vllm = [a for a in unknown if a in VLLM_ONLY_OPTIONS]
            what = "vLLM option(s) pagedserve does not implement" if vllm else "unknown option(s)"
            self.exit(2, f"{self.prog}: error: {', '.join(unknown)}: not supported ({what}; "
                         f"`{self.prog} --help` lists the options)\n")
        if extras:
            self.error(f"unexpected arguments: {' '.join(extras)}")
        return parsed


def _flag_type(hint) -> tuple[type, bool]:
    """(the element type, is it a list) of a field's type hint: int, int | None, list[str] ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] \
        if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    base = args[0]
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], True
    return base, False


def _json_list(values: list[str]) -> list[str]:
    """vLLM takes lists as JSON ('["*"]'); ours as words (* or a b): both are accepted."""
    if len(values) == 1 and values[0].startswith("["):
        return [str(v) for v in json.loads(values[0])]
    return values


def add_config_args(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` (EngineConfig, ServerConfig): --field-name,
    typed by the field's hint, its default shown; a bool is a --x/--no-x pair (a `disable_x`
    field: --disable-x and --enable-x). Help, choices, parsing and aliases come from the
    field's config.setting()."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not f.init or f.name in skip or not meta.get("flag", True):
            continue
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        names = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        help_text = meta.get("help", "")
        if meta.get("show_default", True) and "default" not in help_text and \
                not (isinstance(default, bool) and f.name.startswith("disable_")):
            help_text += f" (default: {default})" if help_text else f"default: {default}"
        base, is_list = _flag_type(hints[f.name])
        kw = dict(dest=f.name, default=default, help=help_text.replace("%", "%%"))
        if base is bool and f.name.startswith("disable_"):
            p.add_argument(*names, action="store_true", **kw)
            p.add_argument("--enable-" + f.name[len("disable_"):].replace("_", "-"), dest=f.name,
                           action="store_false", help=argparse.SUPPRESS)
        elif base is bool:
            p.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            p.add_argument(*names, nargs="+", type=base, **kw)
        else:
            p.add_argument(*names, type=meta.get("parse") or base, choices=meta.get("choices"),
                           metavar=f.name.upper() if meta.get("choices") is None else None, **kw)


def config_from_args(cls: type, args: argparse.Namespace, **overrides):
    """The dataclass `cls` from the parsed flags of add_config_args (overrides win)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.init and hasattr(args, f.name):
            value = getattr(args, f.name)
            if _flag_type(hints[f.name])[1] and value is not None:
                value = _json_list(value)
            values[f.name] = value
    return cls(**{**values, **overrides})


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    try:
        return config_from_args(EngineConfig, args, **overrides)
    except ValueError as e:   # a value the config refuses: one line, as argparse's own errors
        sys.exit(f"pagedserve: error: {e}")


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
    llm = LLM.from_config(engine_config(args))
    prompts = args.prompt or ["The capital of France is"]
    recorder = None
    if args.kv_map:
        from pagedserve.engine.kv_map import KVMapRecorder
        recorder = KVMapRecorder(llm.engine)
    outs = llm.generate(prompts, sampling_params(args), use_tqdm=False)
    elapsed = time.perf_counter() - start
    if recorder is not None:
        print(f"--- KV map of {len(recorder.frames)} frames: {recorder.write_html(args.kv_map)}", file=sys.stderr)
    for out in outs:
        print(f"--- prompt: {out.prompt!r}")
        print(out.outputs[0].text)
    llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"--- {len(outs)} prompt(s), {n} tokens generated, {elapsed:.1f}s including model load", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve import LLM
    llm = LLM.from_config(engine_config(args))
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
    from pagedserve.server.app import run_server
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    named = args.model or []
    if args.models_dir or len(named) > 1 or any("=" in m for m in named):
        return _serve_many(args, [*([args.model_tag] if args.model_tag else []), *named])
    config = engine_config(args, model=args.model_tag or (named[0] if named else None))
    try:
        server = config_from_args(ServerConfig, args)
    except ValueError as e:   # a value the config refuses: one line, as argparse's own errors
        sys.exit(f"pagedserve: error: {e}")
    if server.enable_auto_tool_choice and not server.tool_call_parser:
        print("pagedserve serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    if server.lora_modules and not config.enable_lora:
        print("pagedserve serve: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    if config.enable_lora:
        from pagedserve.server.lora import parse_lora_module
        try:
            for text in server.lora_modules or ():
                parse_lora_module(text)
        except ValueError as e:
            sys.exit(f"pagedserve: error: {e}")
    if config.model and not (config.load_format == "dummy" and is_preset(config.model)):
        resolve_model(config.model, config.revision)   # a missing model is one line, not a failed server
    code = run_server(config, server)
    # Everything has stopped (engine, ranks, Ray): leave now, not seconds later after the
    # interpreter's teardown of torch and the model, so SIGTERM exits within --shutdown-timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve_many(args: argparse.Namespace, models: list[str]) -> int:
    """Several models behind one server, loaded on demand (server/multi.py)."""
    from pagedserve.server.model_specs import find_models
    from pagedserve.server.models_manager import ModelManager
    from pagedserve.server.multi import run_multi_server
    try:
        server = config_from_args(ServerConfig, args)
        base = config_from_args(EngineConfig, args, model=None)
        specs = find_models(server.models_dir, models)
        if not specs:
            raise ValueError(f"no models in --models-dir {server.models_dir} (.gguf files or HF directories)")
        ModelManager(specs, base, server, None)   # every model's settings checked now, not at its first request
    except ValueError as e:
        sys.exit(f"pagedserve: error: {e}")
    code = run_multi_server(specs, base, server)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_cache(args: argparse.Namespace) -> int:
    """What pagedserve keeps under its cache directory, and --clear to remove it."""
    import shutil
    from pagedserve.config import cache_dir
    root = cache_dir()
    for kind in ("models", "tokenizers", "kernels"):
        d = root / kind
        files = [f for f in d.rglob("*") if f.is_file()] if d.exists() else []
        size = sum(f.stat().st_size for f in files)
        entries = len(list(d.iterdir())) if d.exists() else 0
        print(f"{d}: {entries} entries, {size / 1024**2:.1f} MiB" + (" (removed)" if args.clear and d.exists() else ""))
        if args.clear:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    """Compile the CPU kernels for this CPU into the cache (scripts/setup.sh runs it), so the
    first run does not wait for the compiler."""
    from pagedserve.kernels.prebuild import prebuild
    failed = 0
    for b in prebuild(all_variants=args.all):
        if b.path is None:
            failed += 1
            print(f"{b.library} ({b.variant}): not built, runs will use torch instead: {b.error.strip()}", file=sys.stderr)
        else:
            print(f"{b.library} ({b.variant}): {'cached' if b.cached else f'built in {b.seconds:.0f} s'}, {b.path}")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """`pagedserve bench latency | throughput | serve` (pagedserve/bench/)."""
    from pagedserve.bench import latency, serve, throughput
    if args.bench == "serve":
        return serve.run(args)
    module = latency if args.bench == "latency" else throughput
    module.run(engine_config(args), args)
    return 0


def add_bench_parser(sub) -> None:
    from pagedserve.bench import latency, serve, throughput
    bench = sub.add_parser("bench", help="measure: latency of a batch, offline throughput, or a server "
                                         "(vLLM's `bench` flags; prints a table, --output-json writes JSON)")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=ArgumentParser)
    for name, module, text in (("latency", latency, "one batch end to end, timed a few times"),
                               ("throughput", throughput, "offline: a dataset's requests all at once"),
                               ("serve", serve, "an async client against the OpenAI-compatible server")):
        p = kinds.add_parser(name, help=text, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_args(p)
        if module is not serve:
            add_config_args(p, EngineConfig, skip=("seed",))
        p.set_defaults(func=cmd_bench)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Hub id, HF directory or .gguf file (default: SmolLM2-135M-Instruct); same as --model")
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="the model (Hub id, HF directory or .gguf file); repeat as NAME=PATH to serve several, "
                        "loaded on demand")
    add_config_args(p, ServerConfig)
    add_config_args(p, EngineConfig, skip=("model",))


def build_parser() -> ArgumentParser:
    from pagedserve import __version__
    parser = ArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    gen = sub.add_parser("generate", help="generate text for prompts offline")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--kv-map", default=None, metavar="FILE.html",
                     help="write the KV cache's blocks step by step as a self-contained HTML replay")
    add_config_args(gen, EngineConfig)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--message", action="append", help="send these messages instead of reading stdin")
    add_config_args(chat, EngineConfig)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    cache = sub.add_parser("cache", help="show (or --clear) what pagedserve derived from models and compiled "
                                         "($PAGEDSERVE_CACHE or ~/.cache/pagedserve)")
    cache.add_argument("--clear", action="store_true", help="remove converted GGUF weights, tokenizers and "
                                                            "compiled kernels (made again when needed)")
    cache.set_defaults(func=cmd_cache)

    add_bench_parser(sub)

    kernels = sub.add_parser("kernels", help="compile the CPU kernels for this CPU now (else the first run does)")
    kernels.add_argument("--all", action="store_true",
                         help="every variant this CPU supports (the tests run each), not only the one runs load")
    kernels.set_defaults(func=cmd_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelNotFoundError, GGUFFileError) as e:    # a missing model, a GGUF file refused: one line
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
