"""The Triton grouped GEMM for a mixture of experts' routed experts (kernels/triton_moe.py, through
kernels/triton_ops.py's TritonOps) against transformers' MoE blocks and the torch reference
(models/moe.py's loop over experts), interpreted on a CPU (conftest sets TRITON_INTERPRET=1; with a
GPU they run compiled): top-k with and without renormalisation, top-k logits then softmax with
gpt-oss's clamped SwiGLU and biases (the clamps biting), an expert no token chose, token counts not
a multiple of the block, bf16 weights; the routing step's blocks; tiny MoE models' tokens and
logprobs through the Triton path as transformers'; the kernels compiled for sm_90."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.kernels.triton_moe import Tiles, align_by_expert, grouped_moe, max_blocks, stack_experts
from pagedserve.kernels.triton_ops import TritonOps
from pagedserve.models.moe import ExpertWeights, MoESpec, MoEWeights, count_expert_reads, moe_forward, route
from pagedserve.models.ops import TorchOps
from tests.test_moe import E, H, _block, _hf, _hidden, _weights

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Model:
    """What TritonOps.prepare_weights reads of a model: its layers' MoE blocks."""
    def __init__(self, *blocks: MoEWeights) -> None:
        self.layers = [type("Layer", (), {"moe": b})() for b in blocks]


def _triton_ops(w: MoEWeights) -> TritonOps:
    w.to(DEVICE)
    ops = TritonOps()
    ops.prepare_weights(_Model(w))
    return ops


def _without_expert(block, kind: str, expert: int) -> None:
    """Expert `expert`'s router row so low that no token chooses it."""
    router = block.router if kind == "gpt_oss" else block.gate
    with torch.no_grad():
        router.weight[expert] = 0.0
        if getattr(router, "bias", None) is not None:
            router.bias[expert] = -1e4
        else:
            router.weight[expert, 0] = -1e3


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_block_matches_transformers(kind, tokens):
    """qwen3_moe / mixtral: softmax, top-k renormalised; olmoe: not renormalised; qwen2_moe: a shared
    expert beside; gpt_oss: top-k logits then softmax, clamped SwiGLU, biases. 37 tokens: not a
    multiple of any block; expert 3 gets none of them."""
    block, spec = _block(kind)
    x = _hidden(tokens)
    if kind != "qwen2_moe":
        _without_expert(block, kind, 3)
        x[:, 0] = x[:, 0].abs() + 0.5
    ref = _hf(block, x)
    w = _weights(block, kind)
    ops = _triton_ops(w)
    with count_expert_reads() as reads:
        ours = moe_forward(x.to(DEVICE), w, spec, ops).cpu()
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    if kind != "qwen2_moe":
        assert 3 not in reads.experts() and len(reads.experts()) > 1
    assert ops.describe()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_one_expert_gets_every_token(kind):
    """Expert 5 takes all 40 tokens (its rows over several blocks), the others one slot each."""
    block, spec = _block(kind)
    with torch.no_grad():
        (block.router if kind == "gpt_oss" else block.gate).weight[5] = 3.0
    x = _hidden(40, all_to_one=True)
    ref = _hf(block, x)
    w = _weights(block, kind)
    with count_expert_reads() as reads:
        ours = moe_forward(x.to(DEVICE), w, spec, _triton_ops(w)).cpu()
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert (5, 40) in {(e, n) for (_, e, n) in reads.calls[0]}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_captures_the_block():
    """The routing step and both launches have no host sync: a CUDA graph captures them, and its
    replay on new inputs equals an eager call."""
    experts = _random_experts(torch.bfloat16, biases=True)
    stack = stack_experts(experts)
    spec = MoESpec(E, 2, 48, scoring="topk_softmax", activation="clamped_swiglu")
    x = torch.randn(24, H, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(24, E, device=DEVICE), spec)
    grouped_moe(x, stack, weights, ids, spec.activation)          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_moe(x, stack, weights, ids, spec.activation)
    new_weights, new_ids = route(torch.randn(24, E, device=DEVICE), spec)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, grouped_moe(x, stack, weights, ids, spec.activation), atol=0, rtol=0)


def _random_experts(dtype: torch.dtype, biases: bool, scale: float = 0.2, seed: int = 0) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    inter = 48                         # not a multiple of the column tile

    def r(*shape, s=scale):
        return (torch.randn(*shape, generator=g) * s).to(DEVICE, dtype)
    return [ExpertWeights(r(2 * inter, H), r(H, inter), r(2 * inter, s=1.0) if biases else None,
                          r(H, s=1.0) if biases else None) for _ in range(E)]


def _reference(x: torch.Tensor, experts: list[ExpertWeights], weights: torch.Tensor, ids: torch.Tensor,
               spec: MoESpec) -> torch.Tensor:
    """moe.py's loop over experts (TorchOps) for the same routing."""
    w = MoEWeights(torch.zeros(E, H, device=DEVICE), experts)
    from pagedserve.models.moe import _experts_one_by_one
    ops = TorchOps()
    return _experts_one_by_one(x, w, spec, ops, ops.linear, weights, ids, [])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")      # the interpreter's sigmoid of -100
@pytest.mark.parametrize("limit", [7.0, 0.3])
def test_gpt_oss_clamped_swiglu(limit):
    """Activations past the limit (gate above it, up on both sides): the kernel's clamps agree with
    the reference's, and they change the result (a kernel without them would fail)."""
    experts = _random_experts(torch.float32, biases=True, scale=1.0)
    spec = MoESpec(E, 2, 48, scoring="topk_softmax", activation="clamped_swiglu", swiglu_alpha=1.702,
                   swiglu_limit=limit)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(21, H, generator=g) * 2).to(DEVICE)
    weights, ids = route(torch.randn(21, E, generator=g).to(DEVICE), spec)
    ref = _reference(x, experts, weights, ids, spec)
    stack = stack_experts([ExpertWeights(e.gate_up, e.down, e.gate_up_bias, e.down_bias) for e in experts])
    ours = grouped_moe(x, stack, weights, ids, "clamped_swiglu", 1.702, limit, Tiles(16, 32, 32))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    unclamped = grouped_moe(x, stack, weights, ids, "clamped_swiglu", 1.702, 1e9, Tiles(16, 32, 32))
    assert (unclamped - ref).abs().max() > 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights(dtype):
    """bf16 / fp16 experts (as a GPU holds them after load): float32 accumulation, the activations
    rounded once to the weights' type; within that rounding of the reference in the same dtype."""
    experts = _random_experts(dtype, biases=False)
    spec = MoESpec(E, 2, 48, norm_topk_prob=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, H, generator=g).to(DEVICE, dtype)
    weights, ids = route(torch.randn(19, E, generator=g).to(DEVICE), spec)
    ref = _reference(x.float(), [ExpertWeights(e.gate_up.float(), e.down.float()) for e in experts], weights, ids,
                     spec)
    stack = stack_experts(experts)
    ours = grouped_moe(x, stack, weights, ids, tiles=Tiles(16, 32, 64))
    assert stack.gate_up.dtype == dtype and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens, top_k, block_m", [(1, 2, 16), (37, 2, 16), (40, 4, 32), (5, 7, 16)])
def test_routing_blocks(tokens, top_k, block_m):
    """Every pair in exactly one row of a block of its own expert, each expert's rows in pair order,
    padding rows past the pairs, no block for an expert no token chose, unused blocks -1."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:top_k] for _ in range(tokens)])   # expert 7: never
    blocks = align_by_expert(ids, E, block_m)
    num_pairs = tokens * top_k
    assert blocks.block_expert.numel() == max_blocks(num_pairs, E, block_m)
    pairs = blocks.pairs.view(-1, block_m)
    flat = ids.view(-1)
    seen = []
    for b, expert in enumerate(blocks.block_expert.tolist()):
        rows = [p for p in pairs[b].tolist() if p < num_pairs]
        if expert < 0:
            assert not rows
            continue
        assert rows and all(flat[p] == expert for p in rows) and rows == sorted(rows)
        seen += rows
    assert sorted(seen) == list(range(num_pairs))
    assert 7 not in blocks.block_expert.tolist()
    used = blocks.block_expert[blocks.block_expert >= 0]
    assert torch.equal(used, used.sort().values)      # blocks in expert order, then the unused


def test_experts_that_do_not_stack_keep_the_loop():
    """Quantized experts, or biases on only some experts: no stack, routed_experts None (moe.py then
    runs them one by one)."""
    from pagedserve.quant_format import quantize_torch
    experts = _random_experts(torch.float32, biases=True)
    experts[2].down_bias = None
    assert stack_experts(experts) is None
    q = [ExpertWeights(quantize_torch(e.gate_up.cpu(), "q8_0"), e.down) for e in _random_experts(torch.float32, False)]
    w = MoEWeights(torch.zeros(E, H), q)
    ops = TritonOps()
    ops.prepare_weights(_Model(w))
    spec = MoESpec(E, 2, 48)
    weights, ids = route(torch.randn(3, E), spec)
    assert ops.routed_experts(torch.randn(3, H), q, weights, ids, spec) is None and not ops.describe()


# ---- tiny MoE models through the Triton path ------------------------------------------------

@pytest.fixture
def triton_ops_in_worker(monkeypatch):
    """The worker's ops TritonOps on this device (on a CPU the worker would pick CpuOps)."""
    from pagedserve.kernels import triton_ops
    from pagedserve.worker import worker
    launches = []

    def counted(*args, **kwargs):
        launches.append(args[1].gate_up.shape[0])
        return grouped_moe(*args, **kwargs)
    monkeypatch.setattr(worker, "make_ops", lambda device, attention=None: TritonOps())
    monkeypatch.setattr(triton_ops, "grouped_moe", counted)
    return launches


def test_gpt_oss_model_matches_transformers(tiny_tokenizer, tmp_path, triton_ops_in_worker):
    """gpt-oss (4 experts top-2, clamped SwiGLU, biases, sinks, a window) through the grouped GEMM
    (and, on a GPU, the Triton attention backend): greedy tokens and prompt logprobs as transformers'."""
    from tests.gpt_oss_utils import tiny_gpt_oss
    from tests.test_moe_models import _check
    hf = tiny_gpt_oss(tiny_tokenizer, tmp_path / "gpt-oss")
    llm = LLM(str(tmp_path / "gpt-oss"), dtype="float32", num_gpu_blocks_override=64, device=DEVICE.type,
              attention_backend="torch" if DEVICE.type == "cpu" else "triton")
    ops = llm.engine.runner.model.ops
    assert isinstance(ops, TritonOps) and len(ops._stacks) == llm.engine.model_args.num_layers
    _check(llm, hf, tiny_tokenizer)
    assert triton_ops_in_worker and set(triton_ops_in_worker) == {4}      # every MoE layer's step went through it


def test_qwen3_moe_model_matches_transformers(tiny_tokenizer, tmp_path, triton_ops_in_worker):
    """Qwen3-MoE (8 experts top-2 renormalised, a dense first layer) through the grouped GEMM, prefill
    chunks beside decodes: tokens and prompt logprobs as transformers'."""
    from tests.moe_utils import make_tiny_moe
    from tests.test_moe_models import _check
    tm = make_tiny_moe(tmp_path, "qwen3_moe", tiny_tokenizer)
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=16, max_num_seqs=4,
              attention_backend="torch" if DEVICE.type == "cpu" else "triton", device=DEVICE.type)
    ops = llm.engine.runner.model.ops
    assert isinstance(ops, TritonOps) and len(ops._stacks) == 1       # layer 0 is dense
    _check(llm, tm.hf, tm.tokenizer)
    assert triton_ops_in_worker and set(triton_ops_in_worker) == {8}


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every launch compiles anyway")
def test_kernels_compile_for_sm90(monkeypatch):
    """The interpreter never compiles: record bf16 launches of both kernels (SwiGLU without biases,
    clamped SwiGLU with them; decode's and prefill's tiles) and compile each to sm_90 machine code
    in a process without the interpreter, as tests/test_triton_kernels.py does for attention."""
    import json
    import os
    import subprocess
    import sys
    from triton.runtime.interpreter import InterpretedFunction
    from tests.test_triton_kernels import _COMPILE, _signature
    launches = {}
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__name__, kwargs.get("GLU"), kwargs.get("HAS_BIAS"), kwargs.get("BLOCK_M"))
        launches.setdefault(key, (self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    spec = MoESpec(E, 2, 48)
    for biases, activation, tokens in ((False, "silu", 3), (True, "clamped_swiglu", 300)):
        stack = stack_experts(_random_experts(torch.bfloat16, biases))
        weights, ids = route(torch.randn(tokens, E), spec)
        grouped_moe(torch.randn(tokens, H, dtype=torch.bfloat16), stack, weights, ids, activation)
    jobs = []
    for fn, args, kwargs in launches.values():
        sig, consts, attrs = _signature(fn, args, kwargs)
        jobs.append([fn.__name__, fn.__module__, sig, consts, attrs, {"num_warps": kwargs["num_warps"]}])
    assert len(jobs) == 4, [j[0] for j in jobs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(jobs), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 4, done.stdout


@pytest.mark.skipif(DEVICE.type == "cuda", reason="scripts/gpu_run.sh runs the full script on a GPU")
def test_gpu_benchmark_dry_run(tmp_path):
    """benchmarks/gpu_moe.py --dry-run (what scripts/gpu_run.sh runs on a GPU) end to end with tiny
    shapes: the grouped GEMM within tolerance of the torch loop, a tile setting timed."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_moe.py"
    out = tmp_path / "gpu_moe.json"
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--json", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["ok"] and set(res["shapes"]) == {"tiny", "tiny-gpt-oss"}
    for shape in res["shapes"].values():
        assert [r["tokens"] for r in shape["rows"]] == [1, 37] and all(r["rel_err"] < 3e-2 for r in shape["rows"])
        assert shape["tuning"][0]["best"]["us"] > 0
