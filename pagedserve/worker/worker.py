"""Setting up the worker, which owns the device: the model's ops and attention backend,
the model (or, under tensor parallelism, this rank's shard of it) loaded onto the device,
the KV cache sized to the memory there, the sampler (on the device), the ModelRunner that
runs steps and, on CUDA, its decode CUDA graphs. The engine gets back what it needs to plan:
the number of device and host blocks, the context length and the model's shape."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedserve.attention.selector import make_attention_backend
from pagedserve.config import EngineConfig
from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.models.llama import ModelArgs
from pagedserve.models.loader import is_gguf, load_model
from pagedserve.models.ops import ModelOps, TorchOps
from pagedserve.models.quantized import (model_read_bytes_per_token, model_weight_bytes, quantized_qtypes,
                                         resolve_quantization)
from pagedserve.models.sharding import Shard
from pagedserve.sampling.sampler import Sampler
from pagedserve.worker.cuda_graphs import capture_sizes, uses_cuda_graphs
from pagedserve.worker.device import (KVMemoryPlan, MemoryProbe, default_kv_cache_memory, memory_probe,
                                      profile_kv_memory, resolve_device)
from pagedserve.kv.groups import KVGroups, plan_kv_groups
from pagedserve.worker.model_runner import ModelRunner, kv_cache_bytes_per_block


logger = logging.getLogger(__name__)


def make_ops(device: torch.device, attention=None) -> ModelOps:
    """The CPU kernels on the CPU (each call falls back to torch where its kernel does not
    apply); on CUDA with the Triton attention backend, torch plus Triton's grouped GEMM for a
    mixture of experts' routed experts (kernels/triton_ops.py); plain torch elsewhere."""
    if device.type == "cpu":
        from pagedserve.kernels.cpu_ops import CpuOps
        return CpuOps()
    if device.type == "cuda" and getattr(attention, "name", None) == "triton":
        from pagedserve.kernels.triton_ops import TritonOps
        return TritonOps()
    return TorchOps()


def make_sampler(eos_token_ids: set[int], seed: int, device: torch.device) -> Sampler:
    """The sampler runs where the logits are: on the CPU with the CPU kernels' argmax, on a
    GPU in torch (only sampled ids and requested logprobs cross to the host)."""
    return Sampler(eos_token_ids, seed, make_ops(device), device)


def resolve_max_model_len(requested: int | None, args: ModelArgs) -> int:
    """The context length: the model's, or a shorter one asked for (a sliding window does not
    limit it: its layers read their windows of the paged cache, kv/groups.py)."""
    limit = args.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} is longer than the model's context ({limit})")
    return requested


def kv_groups_of(args) -> KVGroups:
    """The model's KV groups (kv/groups.py): its layers by attention kind (OPT: all full)."""
    windows = args.windows() if hasattr(args, "windows") else [None] * args.num_layers
    return plan_kv_groups(windows)


def num_kv_blocks(config: EngineConfig, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                  memory_plan: KVMemoryPlan | None, draft_args: ModelArgs | None = None) -> tuple[int, int]:
    """(device blocks, host swap-space blocks) for the KV cache: kv_cache_memory (or, on a
    GPU, what the profile's memory_plan leaves) and swap_space, in blocks of this model (and of
    a draft model's, whose KV lives in the same blocks: a block's bytes count both). A hybrid
    model's block holds one KV group's layers (kv/groups.py layers_per_block)."""
    block_bytes = sum(kv_cache_bytes_per_block(kv_groups_of(a).layers_per_block, config.block_size, a.num_kv_heads,
                                               a.head_dim, dtype, config.kv_cache_dtype)
                      for a in (args, draft_args) if a)
    kv_memory = config.kv_cache_memory or default_kv_cache_memory(memory_plan)
    num_blocks = config.num_gpu_blocks_override or kv_memory // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} bytes holds no block: one block of "
                         f"{config.block_size} tokens takes {block_bytes} bytes")
    num_host_blocks = 0
    if config.preemption_mode == "swap":
        num_host_blocks = config.num_host_blocks_override or config.swap_space_bytes // block_bytes
        if num_host_blocks < 1:
            raise ValueError(f"preemption_mode='swap' needs swap_space (GiB of host memory) for at least one "
                             f"block of {block_bytes} bytes; got {config.swap_space} GiB")
    return num_blocks, num_host_blocks


def load_draft_model(config: EngineConfig, target: ModelArgs, max_model_len: int, ops: ModelOps,
                     device: torch.device):
    """Speculative method draft_model: the draft (a path or Hub id; a .gguf file runs in its
    blocks unless its quantization says otherwise), unsharded, in the target's dtype, with its
    own attention backend. ValueError where it cannot draft for this target."""
    from pagedserve.models.presets import is_preset
    from pagedserve.models.resolve import resolve_model
    spec = config.speculative_config
    path = spec.model if config.load_format == "dummy" and is_preset(spec.model) else \
        resolve_model(spec.model, spec.revision)
    attention = make_attention_backend(config.attention_backend, device, config.kv_cache_dtype)
    quantization = resolve_quantization(spec.quantization, False, is_gguf(path), device)
    draft, args, _ = load_model(path, config.dtype, attention, max_model_len, ops, config.load_format, device,
                                config.seed, Shard(), None, quantization)
    if args.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of {args.vocab_size} tokens, "
                         f"the target's has {target.vocab_size}: a draft model must share the target's tokenizer")
    if resolve_max_model_len(None, args) < max_model_len:
        raise ValueError(f"speculative_config model {spec.model!r} has a context of "
                         f"{resolve_max_model_len(None, args)} tokens, shorter than max_model_len {max_model_len}")
    draft.to(device)
    draft.pack_linear_weights()
    logger.info("draft model %s: %.1f MiB of weights%s", spec.model, model_weight_bytes(draft) / 2**20,
                f" ({quantization} blocks)" if quantization else "")
    return draft


@dataclass
class Worker:
    runner: ModelRunner
    device: torch.device
    model_args: ModelArgs          # the whole model's (a tensor-parallel rank runs a shard of it)
    dtype: torch.dtype
    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    kv_windows: tuple[int | None, ...] = (None,)    # each KV group's sliding window (kv/groups.py)
    # The disk tier (worker/kv_tier.py), if any: the keys its directory holds for this model,
    # oldest first, and how many blocks its size bound holds (the engine's index, kv/tier.py).
    tier_keys: list[bytes] = field(default_factory=list)
    tier_capacity: int = 0
    # Whether a step that is not batch-invariant computes rows with other arithmetic than a
    # batch-invariant one (ModelOps.invariance_changes over the model's and the draft's
    # quantized block types): only then does the scheduler mark such steps' blocks.
    batch_dependent_steps: bool = True

    @classmethod
    def load(cls, config: EngineConfig, model_path: str, eos_token_ids: set[int],
             group: TensorParallelGroup | None = None, device: torch.device | None = None,
             probe: MemoryProbe | None = None) -> "Worker":
        """Load the model onto the configured device, size its KV cache and build the runner.
        With a tensor-parallel `group`, this rank's shard of the model and the KV cache of its
        heads; every rank gets the same number of blocks (the smallest any rank can hold).
        On a GPU without kv_cache_memory, the KV cache gets what a profile leaves
        (worker/device.py); `probe` reads the device's memory (default: CUDA's; tests fake it)."""
        device = device or resolve_device(config.device)
        attention = make_attention_backend(config.attention_backend, device, config.kv_cache_dtype)
        ops = make_ops(device, attention)
        shard = Shard(group.rank, group.world_size) if group else Shard()
        probe = probe or memory_probe(device)
        start = probe.snapshot() if probe else None
        quantization = resolve_quantization(config.quantization, config.gguf_dequantize, is_gguf(model_path),
                                            device)
        model, args, dtype = load_model(model_path, config.dtype, attention, config.max_model_len, ops,
                                        config.load_format, device, config.seed, shard, group, quantization)
        model.to(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()      # what building the weights left in the allocator's cache
        model.pack_linear_weights()
        # The bytes the weights hold (quantized ones: their blocks), beside the KV cache's budget;
        # a mixture of experts reads only its routed experts' share of them per token.
        moe = getattr(args, "moe", None)   # OPTArgs has no experts
        per_token = f"; read per token: {model_read_bytes_per_token(model) / 2**20:.1f} MiB ({moe.top_k} of " \
                    f"{moe.num_experts} experts)" if moe is not None else ""
        logger.info("weights: %.1f MiB%s%s", model_weight_bytes(model) / 2**20,
                    f" ({quantization} blocks)" if quantization else "", per_token)
        max_model_len = resolve_max_model_len(config.max_model_len, args)
        kv_groups = kv_groups_of(args)
        spec = config.speculative_config
        if kv_groups.hybrid and spec is not None and spec.method == "draft_model":
            raise ValueError("speculative_config method 'draft_model' shares the target's block tables, and this "
                             "model has sliding-window layers (KV groups): use method 'ngram' or 'suffix'")
        draft = load_draft_model(config, args, max_model_len, ops, device) \
            if spec is not None and spec.method == "draft_model" else None
        sizes = capture_sizes(config.cuda_graph_sizes, config.max_num_seqs)
        # TP: eager. Sliding-window models: a graph's buffers hold every KV group's slots and tables.
        graphs = bool(sizes) and group is None and uses_cuda_graphs(config, device, attention)
        memory_plan = None
        if probe and config.kv_cache_memory is None and config.num_gpu_blocks_override is None:
            memory_plan = profile_kv_memory(model, config, device, make_sampler(eos_token_ids, config.seed, device),
                                            probe, start, max_model_len, sizes[-1] if graphs else None)
        num_blocks, num_host_blocks = num_kv_blocks(config, model.args, dtype, device, memory_plan,
                                                    draft.args if draft is not None else None)
        if group:
            num_blocks, num_host_blocks = group.min_int(num_blocks), group.min_int(num_host_blocks)
        sampler = make_sampler(eos_token_ids, config.seed, device)
        runner = ModelRunner(model, num_blocks, config.block_size, sampler, device, num_host_blocks, kv_groups)
        if kv_groups.hybrid:
            logger.info("KV groups: %s, %d layers a block", ", ".join(kv_groups.describe()), kv_groups.layers_per_block)
        if draft is not None:
            from pagedserve.spec_decode.draft_model import DraftModel
            runner.draft = DraftModel(draft, num_blocks, config.block_size, device, num_host_blocks)
        if config.enable_lora:
            from pagedserve.lora.weights import LoRAWeights
            runner.lora = LoRAWeights(args, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                      dtype, device, shard)
        if graphs:
            runner.capture_cuda_graphs(sizes, max_model_len)
        worker = cls(runner, device, args, dtype, num_blocks, num_host_blocks, max_model_len, kv_groups.windows)
        qtypes = quantized_qtypes(model) | (quantized_qtypes(draft) if draft is not None else set())
        worker.batch_dependent_steps = ops.invariance_changes(qtypes)
        if config.kv_offload:
            from pagedserve.worker.kv_tier import open_tier_store
            runner.tier = open_tier_store(config, model_path, args, dtype, runner.kv_cache)
            worker.tier_keys = runner.tier.scan()
            worker.tier_capacity = runner.tier.capacity
        return worker
