"""gpt-oss GGUF files as llama.cpp writes them (arch `gpt-oss`: MXFP4 experts stacked per projection
with their biases, attn_sinks, the sliding-window pattern, YaRN's keys): loaded in their blocks (the
experts MXFP4 views of the file's tensors, never dequantized), the greedy tokens of transformers over
the file's numbers, and a file whose expert tensor contradicts the metadata refused before a kernel
reads it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import moe as moe_kernels
from pagedserve.kernels import quant
from tests.conftest import hf_greedy
from tests.gpt_oss_utils import tiny_gpt_oss, write_gpt_oss_gguf
from tests.moe_utils import assert_compiled_loop_equals_python_loop

gguf = pytest.importorskip("gguf")

PROMPTS = ["The quick brown fox jumps", "Paged attention stores keys", "Once upon a time there was a tiny"]
NEW = 8


@pytest.fixture(scope="module")
def gpt_oss_file(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    hf = tiny_gpt_oss(tiny_tokenizer, root / "hf")
    state = write_gpt_oss_gguf(hf, tiny_tokenizer, root / "tiny-gpt-oss.gguf")
    oracle = type(hf)(hf.config).float().eval()
    oracle.load_state_dict(state)
    return root / "tiny-gpt-oss.gguf", oracle


def test_gpt_oss_gguf_generates_transformers_tokens(gpt_oss_file, tiny_tokenizer):
    path, hf = gpt_oss_file
    llm = LLM(str(path), num_gpu_blocks_override=64, dtype="float32")
    args = llm.engine.model_args
    assert args.architecture == "GptOssForCausalLM" and args.attention_sinks and args.o_bias
    assert args.layer_windows == (4, None) and args.moe.scoring == "topk_softmax"
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["truncate"] is False
    model = llm.engine.executor.worker.runner.model
    # the experts' bytes repacked at load on the 256-bit variants (8 rows interleaved: dot_mxfp4_r8_256.h)
    mxfp4_layout = "mxfp4r8" if quant.variant() in quant.EXPERT_R8_VARIANTS else "mxfp4"
    for layer in model.layers:
        assert layer.sinks.shape == (4,) and layer.moe.router_bias is not None
        for e in layer.moe.experts:
            parts = e.gate_up if isinstance(e.gate_up, tuple) else (e.gate_up,)
            assert {p.qtype for p in parts} | {e.down.qtype} == {mxfp4_layout}
            assert e.gate_up_bias is not None and e.down_bias is not None
    # the compiled layer loop runs it (attention and router biases, sinks, windows, clamped SwiGLU)
    assert (model.compiled_layers is not None) == moe_kernels.runs_here()
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, out.prompt_token_ids, NEW), out.prompt
    ids = tiny_tokenizer.encode(PROMPTS[2] + " model that liked to count")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
    assert (ours - ref).abs().max() <= 0.1          # the experts' q8 activations (csrc/quant/mxfp4.h)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_loop_runs_gpt_oss_as_the_python_loop(gpt_oss_file, dtype):
    """The compiled layer loop (o and router biases, top-k softmax routing, the experts' clamped
    SwiGLU with biases in csrc/moe/experts.h) gives the Python layer loop's greedy tokens and
    logprobs, prompts prefilled in chunks past the window."""
    if not moe_kernels.runs_here():
        pytest.skip("quant_moe_experts does not run in this build")
    path, _ = gpt_oss_file
    llm = LLM(str(path), num_gpu_blocks_override=64, dtype=dtype, max_num_batched_tokens=16, max_num_seqs=4)
    model = llm.engine.executor.worker.runner.model
    assert model.compiled_layers is not None
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    prompts = PROMPTS + [" ".join(PROMPTS)]
    assert_compiled_loop_equals_python_loop(llm, model, prompts, params, dtype)


def test_an_expert_tensor_contradicting_the_metadata_is_refused(gpt_oss_file, tmp_path):
    """ffn_down_exps with a wider expert than expert_feed_forward_length says: refused by name by
    models/gguf_check.py before anything reads it."""
    from pagedserve.models.gguf_check import check_gguf
    from pagedserve.models.gguf_reader import GGUFFileError
    path, _ = gpt_oss_file
    reader = gguf.GGUFReader(str(path))
    arch = "gpt-oss"
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.ffn_down_exps.weight":
            data = np.concatenate([data, data[:, :, :17]], axis=2)       # one more block of columns
        raw = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type if raw else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFileError, match="blk.1.ffn_down_exps.weight.*expert_feed_forward_length"):
        check_gguf(str(tmp_path / "bad.gguf"))
