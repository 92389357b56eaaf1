"""Embeddings (runner pooling): the pooled hidden state after the final norm equals transformers'
last_hidden_state (LAST token, normalised, by default; MEAN and CLS), through chunked prefills
and prefix-cache hits, offline (LLM.embed) and through /v1/embeddings with the openai client;
and the default model in float32."""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from pagedserve import LLM, InvalidRequestError, PoolingParams, SamplingParams
from pagedserve.models.loader import default_model_path
from tests.q8_oracle import integer_path_modules, q8_inputs
from tests.server_utils import authed_http, openai_client

PROMPTS = ["Once upon a time there was a tiny language model that", "def add(a, b):", "The quick brown fox"]


def hf_embedding(hf, ids: list[int], kind: str = "LAST", normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embed_equals_transformers(tiny_llama, kind):
    # A 5-token budget splits every prompt into chunks; the repeated prompts find their blocks
    # in the prefix cache (LAST only: MEAN and CLS need every position computed).
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, runner="pooling", max_num_seqs=4,
              max_num_batched_tokens=5, check_invariants=True, pooler_config={"pooling_type": kind})
    outs = llm.embed(PROMPTS + PROMPTS, use_tqdm=False)
    for out in outs:
        assert out.finished and len(out.outputs.embedding) == 64
        ref = hf_embedding(tiny_llama.hf, out.prompt_token_ids, kind)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-5)
    hits = llm.kv_cache_stats()["prefix_cache_hits"]
    assert hits > 0 if kind == "LAST" else hits == 0
    assert llm.kv_cache_stats()["num_used_blocks"] == 0
    raw = llm.embed(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding),
                               hf_embedding(tiny_llama.hf, raw.prompt_token_ids, kind, normalize=False),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_an_embedding_does_not_depend_on_how_its_prompt_is_split(tiny_llama, kind):
    """The same prompt in one chunk, and split so that its last chunk is 1 token (attended as a
    prompt row, not a decode row) or in chunks of 2: the same embedding, bit for bit under
    batch_invariant on, and transformers' within float rounding."""
    prompt = PROMPTS[0]
    out = {}
    for budget in (64, 4, 2):
        llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, runner="pooling", max_num_seqs=2,
                  max_num_batched_tokens=budget, batch_invariant="on", enable_prefix_caching=False,
                  pooler_config={"pooling_type": kind})
        (o,) = llm.embed([prompt], use_tqdm=False)
        out[budget] = o.outputs.embedding
    n = len(o.prompt_token_ids)
    assert n % 4 == 1 and n % 2 == 1        # budget 4's and 2's last chunks are 1 token
    assert out[4] == out[64] and out[2] == out[64]
    torch.testing.assert_close(torch.tensor(out[64]), hf_embedding(tiny_llama.hf, o.prompt_token_ids, kind),
                               atol=1e-5, rtol=1e-5)


def test_pooling_and_generation_refuse_each_other(tiny_llama):
    pooling = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=32, convert="embed")
    with pytest.raises(InvalidRequestError, match="does not generate"):
        pooling.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="matryoshka") as e:
        pooling.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    assert e.value.param == "dimensions"
    assert len(pooling.embed("hi", PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding) == 64
    generating = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=32)
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        generating.embed("hi", use_tqdm=False)


def test_the_default_model_in_float32():
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                              dtype=torch.float32).eval()
    llm = LLM(dtype="float32", kv_cache_memory=64 * 1024**2, runner="pooling")
    # Products on the integer path (r8 layouts on the 256-bit variants, prefills too) see 8-bit
    # activations: so does the oracle's matching module (tests/q8_oracle.py); the LM head is not run.
    # Float32 summation order still moves values across the 8-bit rounding steps, which 30 layers
    # carry on (measured on avx2: cosine 0.9975-0.9997, max difference 0.008-0.03): bounds for that
    # path; elsewhere (float tiles) the embedding stays within 2e-4.
    names = integer_path_modules(llm.engine.executor.worker.runner.model)
    names.pop("lm_head", None)
    for out in llm.embed(PROMPTS, use_tqdm=False):
        with q8_inputs(hf, names):
            ref = hf_embedding(hf, out.prompt_token_ids)
        got = torch.tensor(out.outputs.embedding)
        if names:
            assert float(torch.nn.functional.cosine_similarity(got, ref, dim=0)) > 0.995
            torch.testing.assert_close(got, ref, atol=5e-2, rtol=0)
        else:
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def server(pooling_server):
    """tests/api_servers.py: --runner pooling (LAST, normalised: the defaults)."""
    return pooling_server


def test_embeddings_route_with_the_openai_client(server, tiny_llama):
    client = openai_client(server)
    r = client.embeddings.create(model="tiny", input=PROMPTS)       # the client asks for base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny"
    ids = [tiny_llama.tokenizer.encode(p) for p in PROMPTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids):
        torch.testing.assert_close(torch.tensor(d.embedding), hf_embedding(tiny_llama.hf, i), atol=1e-5, rtol=1e-5)
    http = authed_http(server)
    one = http.post("/v1/embeddings", json={"input": PROMPTS[1], "encoding_format": "float"}).json()
    assert one["object"] == "list" and one["data"][0]["object"] == "embedding"
    assert np.allclose(one["data"][0]["embedding"], r.data[1].embedding, atol=1e-6)
    b64 = http.post("/v1/embeddings", json={"input": [ids[0]], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, r.data[0].embedding, atol=1e-6)
    assert client.embeddings.create(model="tiny", input=ids[2]).data[0].embedding == r.data[2].embedding
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "--runner pooling" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="hi")
