"""The worker's input is plain data: a real step's batch pickles small, holds no Request
or Sequence, and is all the worker needs (outputs are identical when every batch goes
through pickle first, as it will to a worker in another process)."""
import ast
import pickle
from pathlib import Path

import torch

from pagedserve import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedserve.batch import StepBatch
from pagedserve.request import Request, Sequence
from pagedserve.worker.model_runner import ModelRunner
from tests.conftest import PROMPTS
from tests.test_engine import assert_no_blocks_held, make_llm

WORKER = Path(__file__).parent.parent / "pagedserve" / "worker"
FORBIDDEN = ("pagedserve.scheduler", "pagedserve.engine", "pagedserve.request")


def _pagedserve_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found |= {n for n in names if n.startswith("pagedserve.")}
    return found


def test_the_worker_imports_no_scheduler_engine_or_request():
    """Not directly, nor through the modules it imports (the top-level package's __init__,
    the public API, aside)."""
    root = WORKER.parent.parent
    todo = [f"pagedserve.worker.{p.stem}" for p in WORKER.glob("*.py")]
    seen: set[str] = set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        assert not mod.startswith(FORBIDDEN), f"the worker reaches {mod}"
        path = root / (mod.replace(".", "/") + ".py")
        if not path.exists():
            path = root / mod.replace(".", "/") / "__init__.py"
        todo += _pagedserve_imports(path)
    assert "pagedserve.batch" in seen


class _NoLiveObjects(pickle.Pickler):
    def persistent_id(self, obj):
        assert not isinstance(obj, (Request, Sequence, torch.Tensor, torch.Generator)), \
            f"the batch holds a {type(obj).__name__}"
        return None


def _workload():
    """Prompts with every kind of request the sampler and the worker see."""
    return [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(temperature=0.9, top_p=0.8, top_k=20, min_p=0.05, seed=7, max_tokens=12,
                                    ignore_eos=True, logprobs=2)),
        (PROMPTS[2], SamplingParams(temperature=1.0, n=2, best_of=3, seed=3, max_tokens=10, ignore_eos=True,
                                    presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)),
        (PROMPTS[3], SamplingParams(temperature=0, max_tokens=6, min_tokens=6, prompt_logprobs=2,
                                    logit_bias={5: 2.0})),
        (PROMPTS[5], BeamSearchParams(beam_width=3, max_tokens=8)),
        # Structured outputs: the grammar's token bitmask travels in the batch as a numpy array.
        (PROMPTS[4], SamplingParams(temperature=0.8, seed=5, max_tokens=8,
                                    structured_outputs=StructuredOutputsParams(regex="[a-z]+( [a-z]+)*"))),
    ]


def _run(llm, round_trip: bool, batches: list, monkeypatch) -> list:
    execute = ModelRunner.execute

    def execute_data(self, batch: StepBatch):
        batches.append(batch)
        if round_trip:
            batch = pickle.loads(pickle.dumps(batch))
        return execute(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", execute_data)
    outputs = run_workload(llm)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    return outputs


def run_workload(llm) -> list:
    """_workload() through llm's engine, step by step: per request, each completion's tokens,
    cumulative logprob and logprobs, then the prompt logprobs."""
    engine = llm.engine
    for i, (prompt, params) in enumerate(_workload()):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [(c.token_ids, c.cumulative_logprob, c.logprobs) for c in out.outputs] + \
                    [out.prompt_logprobs]
    return [finals[str(i)] for i in range(len(_workload()))]


def test_a_real_steps_batch_is_data_only_small_and_all_the_worker_needs(tiny_llama, monkeypatch):
    direct, round_tripped = [], []
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=512, seed=1)
    expected = _run(llm, False, direct, monkeypatch)
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=512, seed=1)
    assert _run(llm, True, round_tripped, monkeypatch) == expected
    assert_no_blocks_held(llm)
    assert len(direct) == len(round_tripped) > 5
    for batch in direct:
        data = _pickle_checked(batch)
        # Per sequence: its new tokens, its block table, a sampling row; no prompt or history
        # beyond what a penalty needs (one request here has penalties, the prompt is short).
        # The grammar bitmask is a vocabulary's bits, counted apart: the structured request can be
        # alone in its step (its grammar compiles first in a child process), its sampling row
        # (~450 bytes) not shared out over other sequences.
        mask = len(pickle.dumps(batch.grammar_bitmask)) if batch.grammar_bitmask is not None else 0
        assert len(data) - mask < 700 + 250 * len(batch.seqs), (len(data), mask, len(batch.seqs))
    assert any(b.grammar_bitmask is not None for b in direct)
    decodes = [b for b in direct if all(s.num_new_tokens == 1 for s in b.seqs)]
    assert decodes and all(len(_pickle_checked(b)) < 3000 for b in decodes)


def _pickle_checked(batch: StepBatch) -> bytes:
    import io
    buf = io.BytesIO()
    _NoLiveObjects(buf).dump(batch)
    return buf.getvalue()


def test_the_sampled_rows_of_the_hidden_states():
    """The LM head's input: hidden itself (no copy) where the sampled rows are all of it in order (a
    single-stream decode step), else those rows in the order asked."""
    from pagedserve.worker.model_runner import _rows
    hidden = torch.arange(12.0).view(3, 4)
    assert _rows(hidden, [0, 1, 2]) is hidden
    assert torch.equal(_rows(hidden, [2]), hidden[2:3])
    assert torch.equal(_rows(hidden, [1, 0, 2]), hidden[[1, 0, 2]])
    assert torch.equal(_rows(hidden, [0, 2]), hidden[[0, 2]])
    assert _rows(hidden, []).shape == (0, 4)


def test_a_batchs_tensors_from_its_sequences():
    """prepare_batch's tensors (one int64 tensor made at once, split into views) hold each sequence's
    tokens then drafts, positions, slots from its table, the padded tables, per KV group."""
    from pagedserve.batch import ScheduledTokens
    from pagedserve.worker.model_runner import prepare_batch
    B = 4
    seqs = [ScheduledTokens(0, [11], 9, [3, 5, 7]),                                   # a decode at 9
            ScheduledTokens(1, [21], 4, [8, 2], draft_token_ids=[22, 23]),            # a verify at 4, 5, 6
            ScheduledTokens(2, [31, 32, 33], 0, [6])]                                 # a prefill chunk
    ids, pos, meta = prepare_batch(seqs, B, "cpu", {0: [[40, 41, 47]], 1: [[42, 48]], 2: [[43]]}, (None, 8))
    assert ids.tolist() == [11, 21, 22, 23, 31, 32, 33] and pos.tolist() == [9, 4, 5, 6, 0, 1, 2]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 1, 4, 7]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [10, 7, 3] and meta.max_seq_len == 10
    assert (meta.num_decodes, meta.num_verify) == (1, 1)
    first, second = meta.groups
    assert first is meta and (first.window, second.window) == (None, 8)
    assert first.slot_mapping.tolist() == [7 * B + 1, 2 * B, 2 * B + 1, 2 * B + 2, 6 * B, 6 * B + 1, 6 * B + 2]
    assert first.block_tables.tolist() == [[3, 5, 7], [8, 2, 0], [6, 0, 0]]
    assert second.slot_mapping.tolist() == [47 * B + 1, 48 * B, 48 * B + 1, 48 * B + 2, 43 * B, 43 * B + 1, 43 * B + 2]
    assert second.block_tables.tolist() == [[40, 41, 47], [42, 48, 0], [43, 0, 0]]
    for t in (ids, pos, first.slot_mapping, first.block_tables, second.block_tables, meta.seq_lens):
        assert t.dtype == torch.long and t.is_contiguous()
