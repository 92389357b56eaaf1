"""A GGUF file from a stranger, checked before anything is built from it.

The reader (models/gguf_reader.py) already refuses a file whose counts, lengths, dimensions or
offsets do not fit in it. Here the metadata is checked against itself and against the tensors:
the compiled layer loop and the kernels size their buffers from the metadata (ModelArgs) and
read the weights as the tensors lie, so a file whose `embedding_length` says 65536 over tensors
64 wide would make them read and write far outside both. Every integer the model is built from
must be a positive integer, the head counts must divide, every special token id must lie in the
vocabulary, and every tensor of a known kind must have exactly the shape ModelArgs implies.
Each refusal is a GGUFFileError (a ValueError) naming the file and the field.

`check_gguf(path)` runs before the loader reads a tensor and before transformers' GGUF reader
builds the tokenizer (models/loader.py calls it on every path a GGUF file takes).
"""
from __future__ import annotations

import math

from pagedserve.models import architectures
from pagedserve.models.gguf_reader import GGUFFile, GGUFFileError
from pagedserve.models.llama import ModelArgs

_INTEGER_KINDS = {0, 1, 2, 3, 4, 5, 10, 11}      # GGUF value types: u8 i8 u16 i16 u32 i32 u64 i64
_FLOAT_KINDS = {6, 12}
_MAX_DIM = 2**20                 # any width, head count or layer count of a real model is far below
_MAX_CONTEXT = 2**24             # positions: the RoPE tables are sized by it
# {arch}.<key>: the model's sizes (each a positive integer where present; the first three required)
_REQUIRED = ("block_count", "embedding_length", "attention.head_count")
_SIZES = _REQUIRED + ("feed_forward_length", "attention.head_count_kv", "context_length", "vocab_size",
                      "rope.dimension_count", "attention.key_length", "attention.value_length",
                      "expert_count", "expert_used_count", "expert_feed_forward_length")
_POSITIVE_FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")
# tokenizer.ggml.<name>_token_id: ids transformers and the engine index the vocabulary with
_TOKEN_IDS = ("bos", "eos", "unknown", "padding")


def check_gguf(path: str) -> tuple[GGUFFile, ModelArgs]:
    """The file's reader and ModelArgs, once the file's structure, metadata and tensor shapes
    agree; GGUFFileError (naming the file and the field) otherwise."""
    from pagedserve.models.loader import args_from_gguf
    reader = GGUFFile(path)
    check_metadata(reader)
    args = args_from_gguf(reader)
    check_tensor_shapes(reader, args)
    return reader, args


def _int_field(reader: GGUFFile, key: str, low: int, high: int) -> int | list[int] | None:
    """The integer (or per-layer integers) at `key`, each in [low, high]; None if absent."""
    f = reader.fields.get(key)
    if f is None:
        return None
    kinds_ok = f.kind in _INTEGER_KINDS or (f.kind == 9 and f.elem_kind in _INTEGER_KINDS and f.value is not None)
    values = f.value if f.kind == 9 else [f.value]
    if not kinds_ok or not values:
        raise GGUFFileError(reader.path, key, f"must be an integer, got {_describe(f)}")
    for v in values:
        if not low <= v <= high:
            raise GGUFFileError(reader.path, key, f"{v} is out of range ({low} to {high})")
    return f.value


def _describe(f) -> str:
    if f.kind == 9:
        return f"an array of {f.count}"
    return repr(f.value)


def check_metadata(reader: GGUFFile) -> None:
    """Types and ranges of the metadata the model is built from, and the tokenizer's ids."""
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None or arch_field.kind != 8:
        raise GGUFFileError(reader.path, "general.architecture", "missing or not a string")
    p = arch_field.value + "."
    for key in _REQUIRED:
        if p + key not in reader.fields:
            raise GGUFFileError(reader.path, p + key, "missing (the model's size cannot be known)")
    sizes = {key: _int_field(reader, p + key, 1, _MAX_CONTEXT if key == "context_length" else _MAX_DIM)
             for key in _SIZES}
    heads, kv_heads = sizes["attention.head_count"], sizes["attention.head_count_kv"]
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise GGUFFileError(reader.path, p + "attention.head_count_kv",
                            f"{kv_heads} does not divide {p}attention.head_count ({heads})")
    for key in _POSITIVE_FLOATS:
        f = reader.fields.get(p + key)
        if f is not None and not (f.kind in _FLOAT_KINDS | _INTEGER_KINDS and math.isfinite(f.value) and f.value > 0):
            raise GGUFFileError(reader.path, p + key, f"must be a positive number, got {_describe(f)}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and (tokens.kind != 9 or tokens.elem_kind != 8 or tokens.count == 0):
        raise GGUFFileError(reader.path, "tokenizer.ggml.tokens",
                            "the vocabulary must be a non-empty array of strings, got "
                            + (f"{tokens.count} entries" if tokens.kind == 9 else _describe(tokens)))
    vocab = tokens.count if tokens is not None else sizes["vocab_size"]
    if tokens is not None and sizes["vocab_size"] is not None and tokens.count > sizes["vocab_size"]:
        raise GGUFFileError(reader.path, "tokenizer.ggml.tokens",
                            f"{tokens.count} tokens, more than {p}vocab_size ({sizes['vocab_size']})")
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in reader.fields:
            if vocab is None:
                raise GGUFFileError(reader.path, key, "a token id without a vocabulary (tokenizer.ggml.tokens)")
            _int_field(reader, key, 0, vocab - 1)


def _layer_kind(name: str) -> tuple[int | None, str]:
    """('blk.3.attn_q.weight') -> (3, 'attn_q.weight'); a top-level tensor: (None, its name)."""
    if not name.startswith("blk."):
        return None, name
    parts = name.split(".", 2)
    if len(parts) < 3 or not parts[1].isdigit():
        return -1, name
    return int(parts[1]), parts[2]


def expected_shapes(args: ModelArgs, p: str) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each known tensor kind's shape (rows first, as numpy lists it), each dimension with the
    metadata it comes from. Kinds not listed (an architecture's own) are left to its loader."""
    hidden = (p + "embedding_length", args.hidden_size)
    q = (f"{p}attention.head_count x head dim", args.num_heads * args.head_dim)
    kv = (f"{p}attention.head_count_kv x head dim", args.num_kv_heads * args.head_dim)
    inter = (p + "feed_forward_length", args.intermediate_size)
    vocab = (p + "vocab_size (or the tokenizer's tokens)", args.vocab_size)
    qkv = (f"{p}attention.head_count + 2 x head_count_kv, x head dim", (args.num_heads + 2 * args.num_kv_heads) *
           args.head_dim)
    arch = architectures.by_hf_name(args.architecture)
    up = (f"2 x {p}feed_forward_length", 2 * args.intermediate_size) if arch and arch.fused_gate_up else inter
    return {
        "token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.weight": (hidden, q),
        "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (up, hidden), "ffn_down.weight": (hidden, inter),
        "attn_qkv.weight": (qkv, hidden), "attn_qkv.bias": (qkv,),       # fused (Phi-3; ffn_up: gate and up)
        "attn_output.bias": (hidden,), "post_attention_norm.weight": (hidden,),
        "attn_sinks.weight": ((p + "attention.head_count", args.num_heads),),
    } | (_moe_shapes(args, p, hidden) if args.moe is not None else {})


def _moe_shapes(args: ModelArgs, p: str, hidden: tuple[str, int]) -> dict[str, tuple[tuple[str, int], ...]]:
    """The routers' and the stacked experts' shapes ([E, rows, cols]: the kernels read each expert's
    rows as a slice of the tensor's bytes), their biases (gpt-oss), the shared expert's."""
    experts = (p + "expert_count", args.moe.num_experts)
    inter = (p + "expert_feed_forward_length", args.moe.intermediate_size)
    shared = (p + "expert_shared_feed_forward_length", args.moe.shared_intermediate_size)
    return {
        "ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp.bias": (experts,),
        "ffn_gate_exps.weight": (experts, inter, hidden), "ffn_up_exps.weight": (experts, inter, hidden),
        "ffn_down_exps.weight": (experts, hidden, inter),
        "ffn_gate_exps.bias": (experts, inter), "ffn_up_exps.bias": (experts, inter), "ffn_down_exps.bias": (experts, hidden),
        "ffn_gate_shexp.weight": (shared, hidden), "ffn_up_shexp.weight": (shared, hidden),
        "ffn_down_shexp.weight": (hidden, shared), "ffn_gate_inp_shexp.weight": (hidden,),
    }


def check_tensor_shapes(reader: GGUFFile, args: ModelArgs) -> None:
    """Every tensor of a kind expected_shapes knows has exactly its shape, every layer tensor
    belongs to a layer below block_count, each of those layers has layer 0's tensors, and the
    head dimension is a positive even number."""
    p = reader.fields["general.architecture"].value + "."
    if args.head_dim < 2 or args.head_dim % 2:
        raise GGUFFileError(reader.path, p + "rope.dimension_count",
                            f"a head dimension of {args.head_dim} (embedding_length / head_count, or "
                            f"rope.dimension_count): RoPE needs a positive even number")
    if args.rotary_dim and not (2 <= args.rotary_dim <= args.head_dim and args.rotary_dim % 2 == 0):
        # RoPE turns the leading rope.dimension_count values of each head in place: more than a
        # head holds would write past it
        raise GGUFFileError(reader.path, p + "rope.dimension_count",
                            f"{args.rotary_dim} must be a positive even number of at most the head dimension "
                            f"({args.head_dim})")
    expected = expected_shapes(args, p)
    kinds: dict[int, set[str]] = {}
    for t in reader.tensors:
        layer, kind = _layer_kind(t.name)
        if layer is not None and not 0 <= layer < args.num_layers:
            raise GGUFFileError(reader.path, t.name, f"a tensor of layer {layer}, but {p}block_count is "
                                                     f"{args.num_layers}")
        if layer is not None:
            kinds.setdefault(layer, set()).add(kind)
        want = expected.get(kind)
        if want is None:
            continue
        have = tuple(int(d) for d in reversed(t.shape))
        if have != tuple(v for _, v in want):
            wrong = next(((k, v) for (k, v), h in zip(want, have) if v != h), want[0])
            raise GGUFFileError(reader.path, t.name,
                                f"shape {list(have)} contradicts the metadata, which implies "
                                f"{[v for _, v in want]} ({wrong[0]} = {wrong[1]})")
    # Every layer the metadata counts holds (at least) the tensors of layer 0: the model builds
    # block_count layers alike (their FFN's aside in an MoE model: dense and sparse layers mix,
    # Qwen3-MoE's mlp_only_layers / decoder_sparse_step).
    mixed_ffn = args.moe is not None
    for layer in range(1, args.num_layers):
        lacking = sorted(k for k in kinds.get(0, set()) - kinds.get(layer, set())
                         if not (mixed_ffn and k.startswith("ffn_")))
        if lacking:
            raise GGUFFileError(reader.path, f"blk.{layer}.{lacking[0]}",
                                f"missing (layer 0 has it and {p}block_count is {args.num_layers})")
