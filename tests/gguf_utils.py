"""Writing GGUF files as llama.cpp's converter does, for tests/test_gguf.py,
tests/test_quantized_models.py and benchmarks/quantized.py: HF tensor names as GGUF's, the
model header, random valid K-quant blocks."""
from __future__ import annotations

import numpy as np

# HF decoder-layer modules -> GGUF tensor kinds (blk.<i>.<kind>.<weight|bias>)
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_TOP = {"embed_tokens.weight": "token_embd", "norm.weight": "output_norm", "lm_head.weight": "output"}

# K-quant layouts (gguf.GGMLQuantizationType names): the byte offsets of the float16
# super-block scale d and minimum scale dmin, and dmin / d that centres the values.
K_SCALES = {"Q2_K": (80, 82, 1.5), "Q3_K": (108, None, 0), "Q4_K": (0, 2, 7.5), "Q5_K": (0, 2, 15.5),
            "Q6_K": (208, None, 0)}


def gguf_name(name: str) -> tuple[str, str]:
    """An HF tensor name (with or without `model.`) as (its GGUF kind, its GGUF name)."""
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        module, suffix = rest.rsplit(".", 1)
        return LAYER[module], f"blk.{i}.{LAYER[module]}.{suffix}"
    return _TOP[name], _TOP[name] + ".weight"


def gguf_writer(path, arch: str, *, layers: int, context: int, hidden: int, intermediate: int, heads: int,
                kv_heads: int, eps: float, vocab: int, rope_theta: float = 10000.0, **kwargs):
    """A gguf.GGUFWriter for `path` with the model header written (kwargs: the writer's)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch, **kwargs)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(vocab)
    return w


def hf_writer(path, arch: str, cfg, **kwargs):
    """gguf_writer with the header of an HF config."""
    return gguf_writer(path, arch, layers=cfg.num_hidden_layers, context=cfg.max_position_embeddings,
                       hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads,
                       kv_heads=cfg.num_key_value_heads, eps=cfg.rms_norm_eps, vocab=cfg.vocab_size, **kwargs)


def gemma_rename(name: str, a):
    """llama.cpp's Gemma converter: sandwich norms under its names, every norm stored as 1 + w
    ([(GGUF name, array)]; None for a tensor the shared table names)."""
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    name = name.removeprefix("model.")
    if name == "norm.weight":
        return [("output_norm.weight", a + 1)]
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        module = rest.rsplit(".", 1)[0]
        if module in names:
            return [(f"blk.{i}.{names[module]}.weight", a + 1)]
    return None


def gemma_header(w, head_dim: int, sliding_window: int) -> None:
    """The keys llama.cpp's Gemma converter adds to the shared header (both Gemma 2 and 3)."""
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(sliding_window)


def finish(w) -> None:
    """Write the header, metadata and tensors added to `w`, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_streamed(w, tensors) -> None:
    """Write a file whose tensors are made one at a time as they are written (a model larger than
    memory: nothing is held beyond the tensor in hand, and no temporary copy of the file is made).
    `tensors`: [(name, shape, numpy dtype, raw GGML type or None, make)], shape and dtype those of
    the array `make()` returns (uint8 bytes for a raw type); the `make`s are called in order."""
    for name, shape, dtype, raw, _ in tensors:
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, dtype, _, make in tensors:
        a = make()
        if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
            raise ValueError(f"{name}: made {a.dtype} {a.shape}, announced {np.dtype(dtype)} {tuple(shape)}")
        w.write_tensor_data(a)
    w.close()


def random_k_blocks(qtype, rows: int, cols: int, rng: np.random.Generator, std: float,
                    sample_rows: int | None = None) -> np.ndarray:
    """Random valid K-quant blocks [rows, bytes] (their bits uniform; d, dmin scaled to values of
    about `std`, measured over the first sample_rows rows: all where None)."""
    import gguf
    qtype = gguf.GGMLQuantizationType(qtype)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    d_at, dmin_at, ratio = K_SCALES[qtype.name]

    def set_scales(d: float) -> None:
        raw[..., d_at:d_at + 2] = np.full(raw.shape[:2], d, np.float16)[..., None].view(np.uint8)
        if dmin_at is not None:
            raw[..., dmin_at:dmin_at + 2] = np.full(raw.shape[:2], d * ratio, np.float16)[..., None].view(np.uint8)

    set_scales(1.0)
    n = rows if sample_rows is None else min(rows, sample_rows)
    values = gguf.quants.dequantize(raw[:n].reshape(n, -1), qtype)
    set_scales(std / float(values.std()))
    return raw.reshape(rows, -1)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's q/k rows into llama.cpp's rotary layout (what its `llama` converter writes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary_back(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_model(hf, path, arch: str, *, permute_qk: bool = False, qtype=None, header=None,
                   rename=None, extra_tensors: dict | None = None) -> dict:
    """A transformers model written as llama.cpp's converter writes GGUF architecture `arch`: the
    config's header (plus `header(writer, config)`), HF tensors under GGUF names (`rename(name,
    array)` -> [(gguf name, array), ...] for a tensor the shared table does not cover, else None),
    q/k rows permuted where its converter does, matrices in `qtype` (gguf.GGMLQuantizationType;
    float32 if None), `extra_tensors` (GGUF name -> array) added. Returns the state dict as
    written, dequantized, in HF names: the weights the model in the file computes with."""
    import gguf
    import torch
    cfg = hf.config
    w = hf_writer(path, arch, cfg)
    if header is not None:
        header(w, cfg)
    written = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().astype(np.float32)
        parts = rename(name, a) if rename is not None else None
        heads = None
        if parts is None:
            kind, file_name = gguf_name(name)
            if permute_qk:
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(kind)
            parts = [(file_name, permute_rotary(a, heads) if heads else a)]
        back = []
        for file_name, arr in parts:
            if qtype is None or arr.ndim == 1:
                w.add_tensor(file_name, arr)
                back.append(arr)
            else:
                raw = gguf.quants.quantize(arr, qtype)
                w.add_tensor(file_name, raw, raw_dtype=qtype)
                back.append(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
        whole = np.concatenate(back) if len(back) > 1 else back[0]
        written[name] = torch.from_numpy(permute_rotary_back(whole, heads) if heads else whole).clone()
    for file_name, arr in (extra_tensors or {}).items():
        w.add_tensor(file_name, np.asarray(arr, dtype=np.float32))
    finish(w)
    return written


def add_tokenizer(w, tok, chat_template: str | None = None) -> None:
    """A byte-level BPE tokenizer (transformers' fast one) in the GGUF metadata as llama.cpp's
    converter writes a `gpt2` tokenizer, with its chat template (tokenizer.chat_template)."""
    import json
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = [""] * len(tok)
    for text, i in spec["model"]["vocab"].items():
        tokens[i] = text
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    if chat_template:
        w.add_chat_template(chat_template)
