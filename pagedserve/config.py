"""Engine configuration: what to load, how much KV memory, how to batch."""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

_log = logging.getLogger("pagedserve.config")

# vLLM's names: half = float16, float = float32.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16, "float": torch.float32}

# The choices of the settings below, defined once: EngineConfig checks them, the CLI offers them.
DTYPES = ("auto", *_DTYPES)
DEVICES = ("cpu", "cuda", "cuda:N")                      # cuda:N for any device index N
ATTENTION_BACKENDS = ("cpu", "torch", "triton")
CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")        # kv/contiguous.py: the paper's baselines
KV_ALLOCATORS = ("paged", *CONTIGUOUS_POLICIES)
PREEMPTION_MODES = ("recompute", "swap")
ROUTING_POLICIES = ("kv_aware", "round_robin", "least_loaded", "prefix_hash")   # cluster/routing.py
LOAD_FORMATS = ("auto", "dummy")                        # dummy: random weights of the model's shapes
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")           # executor/: processes on this machine, Ray actors
# vLLM's names, plus int8; attention/kv_format.py says what each stores (fp8 is fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}             # EngineConfig stores the format's own name
# Block sizes the attention kernels are built and tested for (the CPU kernel, the torch reference
# and the Triton kernels all take a block size at run time; vLLM offers 1, 8, 16, 32, 64, 128).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RUNNERS = ("auto", "generate", "pooling")               # vLLM's --runner: pooling serves embeddings
CONVERTS = ("auto", "none", "embed")                    # vLLM's --convert: a causal LM used as an embedder
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# Quantized weights (models/quantized.py): gguf: a .gguf file's own blocks; q8_0 / q4_0: an HF
# float model quantized at load into those GGML block types.
QUANTIZATIONS = ("gguf", "q8_0", "q4_0")
# Batch-invariant steps (batch.py StepBatch.batch_invariant): auto: steps holding a greedy
# request (its output must reproduce); on: every step; off: none.
BATCH_INVARIANT = ("auto", "on", "off")
BATCH_INVARIANT_ENV = "PAGEDSERVE_BATCH_INVARIANT"     # 1: on, 0: off (the default when unset)
GRAMMAR_WARMUP_ENV = "PAGEDSERVE_GRAMMAR_WARMUP"       # 0: the server's structured_outputs_warmup off (the tests)


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string: `4GiB`, `512MiB`, `4Gi` (powers of 1024), `4GB`,
    `4G` (powers of 1000), `1073741824` (bytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.fullmatch(str(value))
    if m is None:
        raise ValueError(f"not a size: {value!r} (examples: 1073741824, 4GiB, 512MiB, 8GB)")
    number, unit, binary = m.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " kmgt".index(unit.lower() or " "))


_HUMAN_INT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)\s*")


def parse_human_int(value: int | str) -> int:
    """A count as vLLM's human-readable integers write it: `4k` = 4000, `25.6k` = 25600,
    `1m` = 10**6 (decimal, k m g t), `4K` = 4096, `32K` = 32768, `1M` = 2**20 (binary, K M G T:
    integers only), or a plain number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _HUMAN_INT.fullmatch(str(value))
    if m is None:
        raise ValueError(f"not a count: {value!r} (examples: 4096, 4k = 4000, 4K = 4096, 1m, 1M)")
    number, unit = m.groups()
    if not unit:
        if "." in number:
            raise ValueError(f"not a whole count: {value!r}")
        return int(number)
    if unit.isupper():
        if "." in number:
            raise ValueError(f"{value!r}: a binary suffix ({unit}) takes a whole number (25.6k is fine, 25.6K not)")
        return int(number) * 1024 ** " KMGT".index(unit)
    result = float(number) * 1000 ** " kmgt".index(unit)
    if result != int(result):
        raise ValueError(f"not a whole count: {value!r}")
    return int(result)


def parse_json_object(text: str) -> dict:
    """A flag's JSON object (vLLM's dict-valued flags, e.g. --override-generation-config)."""
    value = json.loads(text) if isinstance(text, str) else text
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object; got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A flag's number that must be > 0."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0; got {text}")
    return value


def setting(default: Any = MISSING, help: str = "", *, default_factory: Callable[[], Any] | Any = MISSING,
            choices: tuple | None = None, parse: Callable[[str], Any] | None = None,
            aliases: tuple[str, ...] = (), flag: bool = True, show_default: bool = True) -> Any:
    """A configuration field with what the command line needs to offer it: cli.py turns every
    field of EngineConfig (and of server/config.py's ServerConfig) into a flag `--field-name`
    from its type and default, with this help; a field declared without setting() gets a flag
    too. `parse` turns the flag's text into the value (e.g. parse_size); `aliases` are more
    flag names (vLLM's); `flag=False` keeps it off the command line."""
    metadata = dict(help=help, choices=choices, parse=parse, aliases=aliases, flag=flag, show_default=show_default)
    return field(default=default, default_factory=default_factory, metadata=metadata)


def server_grammar_warmup() -> bool:
    """The server's structured_outputs_warmup where the config leaves it None: on (its first
    structured request should not wait for xgrammar), unless $PAGEDSERVE_GRAMMAR_WARMUP is 0."""
    return os.environ.get(GRAMMAR_WARMUP_ENV, "") != "0"


def _one_of(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class EngineConfig:
    model: str | None = setting(None, "a Hub id (org/name, resolved through huggingface_hub's cache), an HF "
                                      "directory or a .gguf file; default: SmolLM2-135M-Instruct")
    tokenizer: str | None = setting(None, "Hub id or directory of the tokenizer; default: the model's own")
    revision: str | None = setting(None, "the model's Hub revision (branch, tag or commit) when it is a Hub id")
    dtype: str = setting("auto", "weights and activations; auto: the checkpoint's, as bfloat16 where the CPU has "
                                 "bf16 arithmetic, else float32", choices=DTYPES)
    seed: int = setting(0, "random seed of the engine (a request's own seed makes it reproducible)")
    # KV cache
    block_size: int = setting(16, f"tokens per KV cache block, one of {', '.join(map(str, BLOCK_SIZES))}")
    kv_cache_memory: int | None = setting(
        None, "memory for the KV cache: bytes or a size (4GiB, 512MiB, 8GB); default: 2 GiB on CPU, "
              "gpu_memory_utilization on a GPU", parse=parse_size, aliases=("--kv-cache-memory-bytes",))
    num_gpu_blocks_override: int | None = setting(None, "exact number of KV blocks, overriding kv_cache_memory "
                                                        "(tests, benchmarks)")
    # 8-bit KV cache (attention/kv_format.py): keys and values quantized as they are written,
    # read inside the attention kernels; about twice the blocks of a 16-bit cache in the same memory.
    kv_cache_dtype: str = setting("auto", "KV cache storage: auto (the model's dtype), fp8 (= fp8_e4m3), "
                                          "fp8_e4m3, fp8_e5m2, int8 (8-bit: ~2x the tokens)",
                                  choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of common prompt prefixes")
    # A finished sequence's last, partly computed block stays cached under the key of its
    # computed tokens (kv/kv_cache_manager.py _keep_partial_block): a chat's next turn, which
    # resends them, takes the block over instead of computing them again.
    enable_partial_block_caching: bool = setting(False, "keep a sequence's last, partly filled KV block in the "
                                                        "prefix cache when it ends, for a later prompt that "
                                                        "continues its tokens (a chat's next turn)")
    # paged, or a baseline that reserves one contiguous region per request (kv/contiguous.py):
    # max | pow2 | oracle. The baselines share nothing (no n > 1, beam search or prefix caching).
    kv_allocator: str = setting("paged", "paged, or a paper baseline reserving one contiguous region per "
                                         "request (no sharing)", choices=KV_ALLOCATORS)
    # Scheduler
    max_model_len: int | None = setting(None, "context length (prompt + output); 4k = 4000, 4K = 4096; default: "
                                              "the model's", parse=parse_human_int)
    max_num_seqs: int = setting(256, "most sequences in one step")
    max_num_batched_tokens: int = setting(2048, "most tokens in one step (prefill chunks and decodes); 2k, 2K",
                                          parse=parse_human_int)
    preemption_mode: str = setting("recompute", "what preemption does with a request's KV blocks",
                                   choices=PREEMPTION_MODES)
    # Short prefills beside long ones (vLLM's names): a prompt with more than the threshold left to
    # compute after its prefix-cache hits is long; each step computes at most the threshold of any
    # prefill, and at most max_long_partial_prefills long ones are in progress (a waiting long
    # prompt keeps its place while shorter ones, e.g. mostly cached, are admitted past it). 0: off.
    long_prefill_token_threshold: int = setting(0, "a prefill with more tokens left than this is long: each step "
                                                   "computes at most this many of a prefill (0: no limit)",
                                                parse=parse_human_int)
    max_num_partial_prefills: int = setting(0, "most prompts being prefilled at once (0: no limit)")
    max_long_partial_prefills: int = setting(1, "most long prompts (long_prefill_token_threshold) being prefilled "
                                                "at once; shorter ones are admitted past a waiting long one")
    # Admission control: a new prompt waits while admitting it (all its prompt blocks) would leave
    # fewer than this share of the KV blocks free for running requests to grow into. Not applied
    # when nothing runs (the liveness argument in scheduler.py). vLLM's V0 scheduler kept 1%; 5%
    # measured best on the paper-scale ShareGPT trace (benchmarks/admission.py: preemptions 1.42
    # -> 0.18 per request, and the highest simulated throughput of 0-20%).
    admission_watermark: float = setting(0.05, "share of KV blocks a new prompt must leave free while others run")
    # Watchdog: after this many steps in a row that compute nothing while requests wait (the
    # scheduler's liveness argument says none should), fail those requests; 0 turns it off.
    watchdog_steps: int = setting(100, "fail waiting requests after this many steps in a row without "
                                       "progress (a scheduler bug); 0: off")
    swap_space: float = setting(0, "GiB of host memory for swapped-out KV blocks (used only with preemption_mode "
                                   "swap; at most 70% of the host's memory)")
    num_host_blocks_override: int | None = setting(None, "exact number of swap-space blocks (tests, benchmarks)")
    # The prefix cache's disk tier (kv/tier.py, worker/kv_tier.py): cached blocks the pool evicts are
    # saved to files there and read back when a later prompt's prefix misses the pool; the files
    # outlive the engine and may be shared by several engines of the same model.
    kv_offload_path: str | None = setting(None, "directory of the prefix cache's disk tier: evicted cached KV "
                                                "blocks saved there, read back on a later hit and after a restart")
    kv_offload_gb: float | None = setting(None, "GiB the disk tier's directory may hold (default 8; needs "
                                                "kv_offload_path)")
    # Above the disk tier (or alone): evicted blocks kept in host memory (worker/kv_host_tier.py),
    # pinned on a GPU; on a CPU device a RAM tier whose hits skip the file read and checksum.
    kv_offload_cpu_gb: float | None = setting(None, "GiB of host memory for evicted cached KV blocks, above the "
                                                    "disk tier (or alone); pinned on a GPU")
    # Off only for an A/B of it (benchmarks/kv_tier_serve.py): a queued request's reads then start
    # when the admission loop reaches it, not while the requests ahead of it compute.
    kv_offload_read_ahead: bool = setting(True, "start the tier reads of requests queued behind running ones at "
                                                "once, overlapping their compute (off: when admission reaches them)")
    # Debugging: check the paging invariants after every step (costly; tests turn it on).
    check_invariants: bool = setting(False, "check the paging invariants after every step (slow; tests)")
    # Device and attention kernels. None picks cuda + triton when torch sees a GPU, else cpu + cpu.
    device: str | None = setting(None, f"{' | '.join(DEVICES)}; default: cuda when torch sees a GPU")
    attention_backend: str | None = setting(None, "default: triton on cuda, cpu (the C++ kernel) on cpu",
                                            choices=ATTENTION_BACKENDS)
    gpu_memory_utilization: float = setting(0.9, "CUDA without kv_cache_memory: the share of the GPU's total "
                                                 "memory for this engine (weights, profiled activations, CUDA "
                                                 "graphs, KV cache), as in vLLM")
    # Threads of the CPU kernels and torch (both OpenMP). None: the CPUs this process may use
    # (affinity mask and cgroup quota), not the machine's core count (kernels/threads.py).
    num_threads: int | None = setting(None, "CPU threads; default: the CPUs this process may use (affinity "
                                            "and cgroup quota)", aliases=("--threads",))
    # vLLM compatibility
    chat_template: str | None = setting(None, "a chat template (Jinja) or a file holding one, instead of the "
                                              "model's")
    generation_config: str = setting("auto", "sampling defaults: auto (the model's generation_config.json), "
                                             "vllm (none: SamplingParams' own), or a directory holding one")
    max_logprobs: int = setting(20, "most logprobs a request may ask for per token")
    trust_remote_code: bool = setting(False, "accepted for vLLM compatibility; never needed (no model code is "
                                             "loaded from checkpoints)")
    # auto: the model's weights; dummy: random weights of its shapes, made on the device, for
    # timing runs (model may then be a preset name, models/presets.py; EOS never stops a sequence).
    load_format: str = setting("auto", "dummy: random weights of the model's shapes (the model may then be a "
                                       "preset name, models/presets.py)", choices=LOAD_FORMATS)
    # CUDA: decode steps replay CUDA graphs captured per batch-size bucket (worker/cuda_graphs.py);
    # True runs every step eagerly. cuda_graph_sizes: the buckets (None: 1, 2, 4, 8, 16, 24, ...
    # up to max_num_seqs, at most 256; larger decode batches run eagerly).
    enforce_eager: bool = setting(False, "CUDA: run decode steps eagerly, no CUDA graphs")
    cuda_graph_sizes: list[int] | None = setting(None, "CUDA: decode batch sizes to capture graphs for; default: "
                                                       "1, 2, 4, 8, 16, 24, ... up to max_num_seqs (at most 256)")
    # Tensor parallelism (executor/): the model's heads, MLP and vocabulary split over this many
    # ranks, each in its own process (rank 0 in the engine's), started by the backend: mp
    # (this machine) or ray (a Ray cluster). kv_cache_memory is per rank.
    tensor_parallel_size: int = setting(1, "split the model over this many ranks (processes), each holding its "
                                           "shard", aliases=("-tp",))
    distributed_executor_backend: str | None = setting(
        None, "mp: processes on this machine; ray: Ray actors on a Ray cluster; default: mp when "
              "tensor_parallel_size > 1", choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    threads_per_rank: int | None = setting(None, "torch/OpenMP threads of each rank; default: the CPUs / "
                                                 "tensor_parallel_size")
    distributed_timeout: float = setting(120.0, "seconds a tensor-parallel collective waits for a rank before "
                                                "the engine fails")
    tensor_parallel_host: str | None = setting(None, "address the tensor-parallel rendezvous listens on (the ranks "
                                                     "connect to it); default: 127.0.0.1 (mp), this node's IP (ray)")
    # Structured outputs (structured/manager.py): limits on what one request's constraint may cost.
    structured_outputs_compile_timeout: float = setting(10.0, "seconds one grammar compile may take; longer fails "
                                                              "its request with a 400 (<= 0: no limit)")
    structured_outputs_max_grammar_bytes: int = setting(256 * 1024, "largest grammar (EBNF text of a schema, regex, "
                                                                    "choice or grammar) compiled; larger ones get a "
                                                                    "400 (<= 0: no limit)", parse=parse_size)
    structured_outputs_cache_bytes: int = setting(256 * 1024**2, "memory of the cache of compiled grammars "
                                                                 "(xgrammar's size of each), least recently used "
                                                                 "evicted", parse=parse_size)
    # None: the server's default (server_grammar_warmup: on unless $PAGEDSERVE_GRAMMAR_WARMUP is 0,
    # which the tests set: no child per engine); offline (LLM, generate, benchmarks) off.
    structured_outputs_warmup: bool | None = setting(None, "at start, in the background, load xgrammar and start a "
                                                           "grammar compile process, so the first structured "
                                                           "request waits for neither; default: on in the server "
                                                           "unless $PAGEDSERVE_GRAMMAR_WARMUP is 0, off offline")

    # vLLM's flags of the API surface (issue 33): accepted with vLLM's meaning, or with a log line
    # saying how pagedserve differs.
    enable_chunked_prefill: bool | None = setting(
        None, "accepted: pagedserve always runs a prompt longer than the step's token budget "
              "(max_num_batched_tokens) in chunks; --no-enable-chunked-prefill logs that it still does")
    max_seq_len_to_capture: int | None = setting(
        None, "accepted; no effect: each CUDA graph covers every context length up to max_model_len",
        parse=parse_human_int)
    override_generation_config: dict | None = setting(
        None, "JSON object of sampling defaults over the generation config's, e.g. '{\"temperature\": 0.5}'",
        parse=parse_json_object)
    # Pooling (embeddings): runner "pooling" serves /v1/embeddings and LLM.embed from a causal LM
    # (the hidden state after the final norm, pooled); generation requests are refused.
    runner: str = setting("auto", "generate, or pooling: embeddings (/v1/embeddings, LLM.embed) from the model's "
                                  "hidden states; auto: generate", choices=RUNNERS)
    convert: str = setting("auto", "embed: use a causal LM as an embedding model (what runner pooling does; "
                                   "auto: embed under runner pooling)", choices=CONVERTS)
    pooler_config: dict | None = setting(
        None, "JSON object: pooling_type (LAST, MEAN or CLS; default LAST) and normalize (default true), "
              "e.g. '{\"pooling_type\": \"MEAN\"}'", parse=parse_json_object)

    # Quantized weights (models/quantized.py; kernels/quant.py computes them, CPU only). None: a .gguf
    # file runs in its own block formats (as "gguf", vLLM's name), an HF model in its float dtype;
    # q8_0 / q4_0 quantize an HF float model's matmul weights at load. gguf_dequantize keeps the
    # older path: every GGUF tensor dequantized to `dtype` at load (a float32 copy cached per file).
    quantization: str | None = setting(None, "gguf: a .gguf file's weights computed in their own blocks (the default "
                                             "for .gguf files on the CPU); q8_0 | q4_0: quantize an HF float model at "
                                             "load", choices=QUANTIZATIONS, aliases=("-q",))
    gguf_dequantize: bool = setting(False, "dequantize a .gguf file's weights to dtype at load (float compute, a "
                                           "float32 copy cached per file) instead of computing in its blocks")

    # Batch invariance: a request's rows computed as they would be alone, whatever shares their
    # step (quantized products in r8 layouts: prefill chunks on the decode rows' integer dots and
    # GEMM; benchmarks/batch_invariance.py measures on against off). None: from
    # $PAGEDSERVE_BATCH_INVARIANT (1: on, 0: off), else auto.
    batch_invariant: str | None = setting(None, "auto: steps holding a greedy (temperature 0) request compute every "
                                                "row as it would be alone (greedy output does not depend on the "
                                                "batch, the prefix cache or speculation); on: every step; off: "
                                                "none; default: $PAGEDSERVE_BATCH_INVARIANT (1 on, 0 off), else auto",
                                          choices=BATCH_INVARIANT)

    # Speculative decoding (spec_decode/): vLLM's speculative_config, a dict or its JSON
    # ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, ...}); None: off.
    # Made a spec_decode.config.SpeculativeConfig by __post_init__.
    speculative_config: dict | None = setting(None, "speculative decoding as JSON, vLLM's keys: "
                                                    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'",
                                              parse=json.loads)

    # Multi-LoRA (lora/): PEFT adapters over the base model, batched per step (not merged), in
    # max_loras device slots filled from a host cache of max_cpu_loras adapters.
    enable_lora: bool = setting(False, "serve LoRA adapters (LoRARequest offline, --lora-modules on the server)")
    max_loras: int = setting(1, "adapters that can run in one batch (device slots)")
    max_lora_rank: int = setting(16, "the largest adapter rank accepted (slots are padded to it)")
    max_cpu_loras: int | None = setting(None, "adapters kept in host memory (LRU); default: max_loras")

    def __post_init__(self) -> None:
        self._check_api_surface()
        _one_of("dtype", self.dtype, DTYPES)
        self._check_quantization()
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode one token per step (refused, as vLLM does).
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes a token in each step")
        if self.long_prefill_token_threshold < 0 or self.max_num_partial_prefills < 0:
            bad = "long_prefill_token_threshold" if self.long_prefill_token_threshold < 0 else "max_num_partial_prefills"
            raise ValueError(f"{bad} must be >= 0 (0: no limit), got {getattr(self, bad)}")
        if not 1 <= self.max_long_partial_prefills <= (self.max_num_partial_prefills or self.max_long_partial_prefills):
            raise ValueError(f"max_long_partial_prefills must be >= 1 and at most max_num_partial_prefills "
                             f"(when set), got {self.max_long_partial_prefills}")
        if self.watchdog_steps < 0:
            raise ValueError(f"watchdog_steps must be >= 0 (0: off), got {self.watchdog_steps}")
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.batch_invariant is None:
            env = os.environ.get(BATCH_INVARIANT_ENV, "")
            self.batch_invariant = {"1": "on", "0": "off"}.get(env, "auto")
        _one_of("batch_invariant", self.batch_invariant, BATCH_INVARIANT)
        if not 0 <= self.admission_watermark < 1:
            raise ValueError(f"admission_watermark must be in [0, 1), got {self.admission_watermark}")
        _one_of("kv_allocator", self.kv_allocator, KV_ALLOCATORS)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.preemption_mode == "swap" and self.kv_allocator != "paged":
            raise ValueError(f"preemption_mode='swap' needs kv_allocator='paged' (swap space is a pool of "
                             f"blocks), not {self.kv_allocator!r}")
        self._check_kv_offload()
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.device is not None and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.attention_backend is not None:
            _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        from pagedserve.models.presets import is_preset
        if is_preset(self.model) and self.load_format != "dummy":
            raise ValueError(f"model {self.model!r} is a preset: a config without weights; pass "
                             f"load_format='dummy' (random weights of its shapes) or a model path")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be batch sizes >= 1, got {self.cuda_graph_sizes}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config must be auto, vllm or a directory; {self.generation_config!r} "
                             f"is no directory")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend is None and self.tensor_parallel_size > 1:
            self.distributed_executor_backend = "mp"
        if self.distributed_executor_backend is not None:
            _one_of("distributed_executor_backend", self.distributed_executor_backend, DISTRIBUTED_EXECUTOR_BACKENDS)
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        self._check_lora()
        from pagedserve.spec_decode.config import parse as parse_speculative_config
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is not None and (self.tensor_parallel_size > 1 or self.kv_allocator != "paged"):
            raise ValueError("speculative_config is not yet supported with tensor_parallel_size > 1 or a "
                             "kv_allocator other than paged")

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1; got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def _check_quantization(self) -> None:
        """What can be told before the model is resolved: the quantized kernels run on the CPU,
        and a GGUF file is either computed in its blocks or dequantized, never re-quantized."""
        if self.quantization is None:
            return
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        gguf_model = self.model is None or str(self.model).endswith(".gguf")    # None: the default model, a GGUF
        if self.quantization != "gguf" and gguf_model:
            raise ValueError(f"quantization={self.quantization!r} quantizes an HF float model at load; the model is "
                             f"a .gguf file, whose weights are already quantized (quantization='gguf', the default)")
        if self.quantization == "gguf" and self.gguf_dequantize:
            raise ValueError("quantization='gguf' computes in the file's blocks; gguf_dequantize=True dequantizes "
                             "them: pass one")
        if self.quantization != "gguf" and self.gguf_dequantize:
            raise ValueError(f"gguf_dequantize applies to .gguf files; quantization={self.quantization!r} is for HF "
                             f"float models")
        if (self.device or "cpu").startswith("cuda") or self.attention_backend == "triton":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only (no CUDA/Triton kernels for "
                             f"quantized weights yet); use device='cpu', or gguf_dequantize=True for a GGUF file")

    def _check_kv_offload(self) -> None:
        if self.kv_offload_cpu_gb is not None and not self.kv_offload_cpu_gb > 0:
            raise ValueError(f"kv_offload_cpu_gb must be > 0 GiB, got {self.kv_offload_cpu_gb}")
        if self.kv_offload_path is None and self.kv_offload_gb is not None:
            raise ValueError("kv_offload_gb needs kv_offload_path (--kv-offload-path DIR): the disk tier's directory")
        if not self.kv_offload:
            return
        name = "kv_offload_path" if self.kv_offload_path is not None else "kv_offload_cpu_gb"
        if self.kv_offload_path is not None:
            if self.kv_offload_gb is None:
                self.kv_offload_gb = 8.0
            if not self.kv_offload_gb > 0:
                raise ValueError(f"kv_offload_gb must be > 0 GiB, got {self.kv_offload_gb}")
            if not self.kv_offload_path or os.path.isfile(self.kv_offload_path):
                raise ValueError(f"kv_offload_path must be a directory (made if missing); got {self.kv_offload_path!r}")
        if not self.enable_prefix_caching or self.kv_allocator != "paged":
            raise ValueError(f"{name} is a tier of the prefix cache: it needs enable_prefix_caching and "
                             "kv_allocator='paged'")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"{name} is not supported with tensor_parallel_size > 1 yet")

    @property
    def kv_offload(self) -> bool:
        """A tier below the prefix cache: the disk's, host memory's, or both."""
        return self.kv_offload_path is not None or self.kv_offload_cpu_gb is not None

    @property
    def kv_offload_bytes(self) -> int:
        return int((self.kv_offload_gb or 0) * 1024**3)

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * 1024**3)

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def pooling_type(self) -> str:
        return str((self.pooler_config or {}).get("pooling_type") or "LAST").upper()

    @property
    def pooling_normalize(self) -> bool:
        return bool((self.pooler_config or {}).get("normalize", True))

    def _check_api_surface(self) -> None:
        """The checks of the vLLM-compatibility settings above (issue 33): block size, swap space
        against the host's memory, the pooling settings, and warnings for settings that change
        nothing here."""
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))} (the sizes the "
                             f"attention kernels are built and tested for); got {self.block_size}")
        _check_swap_space(self.swap_space, self.preemption_mode)
        _one_of("runner", self.runner, RUNNERS)
        _one_of("convert", self.convert, CONVERTS)
        if self.convert == "embed" and self.runner == "generate":
            raise ValueError("convert='embed' makes an embedding model: it needs runner='pooling', not 'generate'")
        if self.convert == "embed" and self.runner == "auto":
            self.runner = "pooling"
        if self.pooler_config is not None:
            unknown = sorted(set(self.pooler_config) - {"pooling_type", "normalize"})
            if unknown:
                raise ValueError(f"pooler_config: unsupported keys {unknown}; supported: pooling_type, normalize")
            _one_of("pooler_config pooling_type", self.pooling_type, POOLING_TYPES)
            if not self.is_pooling:
                raise ValueError("pooler_config needs runner='pooling' (--runner pooling)")
        if self.enable_chunked_prefill is False:
            _log.warning("enable_chunked_prefill=False: pagedserve still runs a prompt longer than the step's "
                         "token budget (max_num_batched_tokens=%d) in chunks; raise max_num_batched_tokens to "
                         "run prompts whole", self.max_num_batched_tokens)
        if self.max_seq_len_to_capture is not None:
            _log.info("max_seq_len_to_capture is accepted and changes nothing: pagedserve's CUDA graphs cover "
                      "every context length up to max_model_len")


DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_swap_space(gib: float, preemption_mode: str, total: int | None = None) -> None:
    """swap_space is in GiB (a byte count, as it was before, would ask for petabytes): refused
    above 70% of the host's memory, warned about above 40% (vLLM's limits) and when nothing
    uses it (preemption_mode recompute)."""
    if gib < 0:
        raise ValueError(f"swap_space must be >= 0 GiB, got {gib}")
    if not gib:
        return
    total = total if total is not None else host_memory_bytes()
    if total:
        asked = gib * 1024**3
        if asked > 0.7 * total:
            hint = ""
            if gib >= 2**20:
                hint = (f"; swap_space is in GiB: {gib:.10g} looks like a size in bytes, which would be "
                        f"{gib / 1024**3:.3g} GiB")
            raise ValueError(f"swap_space {gib:.10g} GiB is more than 70% of this host's {total / 1024**3:.1f} GiB "
                             f"of memory{hint}")
        if asked > 0.4 * total:
            _log.warning("swap_space %g GiB is more than 40%% of this host's %.1f GiB of memory", gib,
                         total / 1024**3)
    if preemption_mode != "swap":
        _log.warning("swap_space %g GiB is not used: only preemption_mode='swap' (--preemption-mode swap) "
                     "swaps KV blocks to host memory; preemption recomputes now", gib)


def resolve_dtype(name: str, model_default: torch.dtype | None, bf16_is_fast: bool = True) -> torch.dtype:
    """`auto` takes the checkpoint's dtype, with float16 turned into bfloat16 (CPUs have fast
    bf16 paths, not fp16), and bfloat16 into float32 where `bf16_is_fast` says the device
    has no fast bf16 matmul (kernels.cpu.auto_keeps_bf16 on CPU)."""
    if name != "auto":
        return _DTYPES[name]
    dtype = torch.bfloat16 if model_default in (None, torch.float16) else model_default
    return torch.float32 if dtype == torch.bfloat16 and not bf16_is_fast else dtype


def cache_dir(*parts: str) -> Path:
    """Where pagedserve keeps what it derives once per machine (converted weights,
    tokenizers, compiled kernels): $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
    return root.joinpath(*parts)
