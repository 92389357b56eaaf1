"""The GPU path's CPU-testable parts. CUDA graphs for decode steps: the bucketing and
padding; the padded static buffers run eagerly here (capture=False) with the Triton
kernels under the interpreter, so everything but the capture itself is what a GPU
replays. Sampling on the device: a seeded row's noise."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.worker.cuda_graphs import (PAD_SEQ_LEN, PAD_SLOT, DecodeBatch, bucket_for, capture_sizes,
                                           pad_decode_batch, uses_cuda_graphs)
from tests.conftest import PROMPTS, hf_greedy


def test_capture_sizes_default_cover_every_batch_up_to_max_num_seqs():
    sizes = capture_sizes(None, 256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b % 8 == 0 for b in sizes[3:])
    assert capture_sizes(None, 100)[-2:] == [96, 100]        # max_num_seqs gets a bucket of its own
    assert capture_sizes(None, 1000)[-1] == 256               # larger decode batches run eagerly
    assert capture_sizes([64, 3, 3, 512, 1], 256) == [1, 3, 64]
    for n in range(1, 101):
        b = bucket_for(n, capture_sizes(None, 100))
        assert b is not None and n <= b < n + 8


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, None]


def test_padding_rows_write_nothing_and_read_one_token():
    batch = DecodeBatch(token_ids=[11, 12, 13], positions=[5, 40, 0], slots=[21, 7 * 16 + 8, 3 * 16],
                        seq_lens=[6, 41, 1], block_tables=[[1], [9, 8, 7], [3]])
    p = pad_decode_batch(batch, 8)
    assert p["input_ids"].tolist() == [11, 12, 13] + [0] * 5
    assert p["positions"].tolist() == [5, 40, 0] + [0] * 5
    assert p["slot_mapping"].tolist() == [21, 120, 48] + [PAD_SLOT] * 5
    assert p["seq_lens"].tolist() == [6, 41, 1] + [PAD_SEQ_LEN] * 5
    assert p["block_tables"].tolist() == [[1, 0, 0], [9, 8, 7], [3, 0, 0]] + [[0, 0, 0]] * 5
    assert pad_decode_batch(batch, 3)["input_ids"].tolist() == [11, 12, 13]
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_batch(batch, 2)


def test_graphs_only_for_triton_on_cuda_unless_eager():
    class Backend:
        def __init__(self, name):
            self.name = name
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_cuda_graphs(EngineConfig(), cuda, Backend("triton"))
    assert not uses_cuda_graphs(EngineConfig(enforce_eager=True), cuda, Backend("triton"))
    assert not uses_cuda_graphs(EngineConfig(), cuda, Backend("torch"))
    assert not uses_cuda_graphs(EngineConfig(), cpu, Backend("triton"))
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=[0, 8])


def test_padded_decode_steps_give_transformers_tokens(tiny_llama):
    """Decode steps through the padded buffers (batches of 3 and 5 padded to 4 and 8, then
    smaller as sequences finish) give transformers' greedy tokens, so padding rows neither
    write the cache nor disturb real rows; prefills and a batch above the largest bucket
    run eagerly."""
    tok = tiny_llama.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:6]]
    lengths = [7, 3, 9, 5, 6, 8]
    llm = LLM(tiny_llama.path, dtype="float32", device="cpu", attention_backend="triton",
              num_gpu_blocks_override=64, block_size=4, max_model_len=64)
    runner = llm.engine.runner
    runner.capture_cuda_graphs([1, 2, 4, 8], llm.engine.max_model_len, capture=False)
    graphs = runner.decode_graphs
    sizes_run = []
    run = graphs.run
    graphs.run = lambda batch: (sizes_run.append(len(batch.token_ids)), run(batch))[1]
    for group in (prompts[:3], prompts[:5]):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths[:len(group)]]
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        for p, n, o in zip(group, lengths, outs):
            assert o.outputs[0].token_ids == hf_greedy(tiny_llama.hf, p, n)
    assert {3, 5} <= set(sizes_run) and 1 in sizes_run
    # Wider than the largest bucket: eager (the graphs are not asked).
    graphs.sizes = [1, 2]
    sizes_run.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny_llama.hf, p, 3) for p in prompts[:3]]
    assert sizes_run == []


def test_seeded_noise_drawn_apart_is_the_in_place_draw():
    """On a GPU a seeded row's noise is drawn on the CPU generator and copied over
    (sampling/sampler.py seeded_noise): the same numbers as the CPU sampler's in-place draw
    into its row of the batch's noise, so seeded tokens agree where the probabilities do."""
    from pagedserve.sampling.sampler import seeded_noise
    noise = torch.empty(3, 1000)
    seeded_noise(noise[1], torch.Generator().manual_seed(7))
    apart = torch.empty(1000).exponential_(generator=torch.Generator().manual_seed(7))
    assert torch.equal(noise[1], apart)


def _rows(n_random: int, seeded: tuple[int, ...] = ()):
    from pagedserve.batch import SamplingSettings
    from pagedserve.sampling.sampler import SamplingRow
    greedy = SamplingSettings()
    rand = [SamplingSettings(temperature=0.8, top_p=0.9), SamplingSettings(temperature=1.2, top_k=5, min_p=0.05),
            SamplingSettings(temperature=0.7)]
    rows = [SamplingRow(greedy, 0, None, None, None)]
    for i in range(n_random):
        gen = torch.Generator().manual_seed(100 + i) if i in seeded else None
        rows.append(SamplingRow(rand[i % len(rand)], 0, None, None, gen))
    return rows


def test_steady_sampling_sends_nothing_from_the_host():
    """On a GPU every tensor built from host data is a host-to-device copy. A step whose
    random rows are the last step's (a steady decode batch) builds none: the rows' indices
    and parameters stay on the device (aten.lift_fresh marks a tensor made from Python
    data); a change of rows uploads them once."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from pagedserve.sampling.sampler import Sampler

    class HostData(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.made += func is torch.ops.aten.lift_fresh.default
            return func(*args, **(kwargs or {}))

    sampler = Sampler({2}, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = _rows(4, seeded=(1,))
    sampler(torch.randn(5, 300, generator=g), rows)
    for _ in range(3):
        with HostData() as mode:
            out = sampler(torch.randn(5, 300, generator=g), rows)
        assert mode.made == 0 and len(out.token_ids) == 5
    assert sampler.host_copies == 1
    sampler(torch.randn(4, 300, generator=g), rows[:4])       # a row left: uploaded again, once
    assert sampler.host_copies == 2


def test_seeded_generators_live_on_the_runners_device(tiny_llama):
    """The worker creates a seeded sequence's generator on its own device (on a GPU: a
    CUDA generator, drawn in place, nothing copied); on the CPU the tokens are as before:
    a seed gives the same tokens in any batch."""
    from pagedserve.batch import SampleRow, SamplingSettings
    llm = LLM(tiny_llama.path, dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=4,
              max_model_len=64)
    runner = llm.engine.runner
    row = runner._sampling_row(7, SampleRow(SamplingSettings(temperature=1.0), seed=3, num_output_tokens=0))
    assert row.generator.device == torch.device(runner.device)
    tok = tiny_llama.tokenizer
    p = SamplingParams(temperature=1.0, max_tokens=6, seed=11, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": tok.encode(PROMPTS[0])}], p, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": tok.encode(x)} for x in PROMPTS[:3]],
                         [p, SamplingParams(temperature=1.0, max_tokens=6),
                          SamplingParams(temperature=0, max_tokens=6)],
                         use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def test_graph_decode_splits_each_context_whatever_the_bound(tiny_llama, monkeypatch):
    """The graphs' decode launch is bounded by max_model_len (512) but its splits come from
    the batch and the GPU (faked: 132 SMs, partitions of at least 64 tokens): 8 splits, of
    which a sequence of ~150 tokens fills 3 and a short one 1, and the tokens are still
    transformers' greedy ones."""
    from pagedserve.attention import triton_decode as td
    monkeypatch.setattr(td, "device_sms", lambda device: 132)
    monkeypatch.setattr(td, "MIN_PARTITION", 64)
    launches = []
    choose = td.choose_splits
    monkeypatch.setattr(td, "choose_splits", lambda *a: launches.append((a, choose(*a))) or launches[-1][1])
    tok = tiny_llama.tokenizer
    long = (tok.encode(PROMPTS[0]) * 40)[:150]
    prompts = [long, (tok.encode(PROMPTS[1]) * 20)[:70], tok.encode(PROMPTS[2])]
    llm = LLM(tiny_llama.path, dtype="float32", device="cpu", attention_backend="triton",
              num_gpu_blocks_override=64, block_size=16, max_model_len=512)
    llm.engine.runner.capture_cuda_graphs([1, 2, 4], 512, capture=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama.hf, p, 3)
    graph_launches = [(args, splits) for args, splits in launches if args[0] == 512]
    assert graph_launches and all(splits == 8 for _, splits in graph_launches)
    assert td.partition_tokens(151, 8, td.BLOCK_N, 64) == 64      # 3 of the 8 splits hold tokens
