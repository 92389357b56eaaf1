"""Shared fixtures: tiny random-weight models built from transformers configs.

Each model is saved as an HF directory (config.json + safetensors + a small
byte-level BPE tokenizer trained here), loaded by pagedserve's own loader, and
compared against the transformers model object it came from.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests. "ci", the default: derandomized (every run tries the same examples, so a
# clean clone passes or fails the same way every time) with no example database; an
# example that ever failed is pinned with @example on its test. "fuzz": the long random
# run required before a change to the scheduler or a KV cache manager lands (docs/testing.md);
# chosen by `-m fuzz` or PAGEDSERVE_FUZZ_EXAMPLES, with that many examples per
# test (default 10,000). "dev": random, CI-sized (--hypothesis-seed works there).
# HYPOTHESIS_PROFILE picks one explicitly.
FUZZ_EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES") or 10_000)
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.register_profile("fuzz", max_examples=FUZZ_EXAMPLES, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("fuzz" if os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES") else "ci")
settings.load_profile(PROFILE)


def pytest_configure(config):
    global PROFILE
    markexpr = config.getoption("markexpr", "") or ""
    if not os.environ.get("HYPOTHESIS_PROFILE") and "fuzz" in markexpr and "not fuzz" not in markexpr:
        PROFILE = "fuzz"
        settings.load_profile(PROFILE)


def pytest_collection_modifyitems(config, items):
    if PROFILE == "fuzz":   # thousands of examples take longer than the suite's per-test timeout
        for item in items:
            item.add_marker(pytest.mark.timeout(0))


def examples(n: int) -> int:
    """max_examples for a property test: n, or the fuzz profile's count in a fuzz run."""
    return FUZZ_EXAMPLES if PROFILE == "fuzz" else n


# Busy-waiting OpenMP threads are ruinous when other processes share the cores (a tiny
# matmul on 2 spinning threads ran 15x slower than on 1 here); sleep instead. Must be set
# before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

# Every engine built in the tests checks the paging invariants after every step.
os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"
# No grammar compile process started ahead for every engine (structured_outputs_warmup): the
# tests that want one ask for it.
os.environ.setdefault("PAGEDSERVE_GRAMMAR_WARMUP", "0")
# Without a GPU, Triton kernels run under Triton's interpreter. Triton reads this when it
# is first imported (importing transformers' models already does that), so it is set here,
# first; on a CPU-only machine nothing else can use Triton, so no other test sees a change.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "An operating system maps pages of virtual memory to physical frames.",
    "Once upon a time there was a tiny language model that liked to count: one two three four five.",
    "Héllo wörld, naïve café, 日本語のテキスト, emoji 🙂🚀 and more unicode: ñ ß ø.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching schedules every running sequence at each iteration.",
] * 20

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class TinyModel:
    path: str
    hf: object          # the transformers model (float32, eval)
    tokenizer: object
    name: str


VARIANTS = {
    # name: (config class, kwargs)
    "llama_gqa_untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_mha_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    "llama_linear_rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral_gqa": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                          sliding_window=None)),
    "qwen2_bias_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: q/k norms; head_dim 32 with 4 heads (128 != hidden 64, as Qwen3-0.6B's 16 x 128 != 1024).
    # (random_norms: every norm weight drawn, not ones, so that each norm's own weight counts.)
    "qwen3_untied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False, random_norms=True)),
    "qwen3_tied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                       tie_word_embeddings=True, random_norms=True)),
    # Phi-3 / Phi-4-mini: fused qkv and gate_up, partial rotary (half of each head), LongRoPE whose
    # switch (32 tokens) the longer prompts and generations cross.
    "phi3_longrope": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         partial_rotary_factor=0.5, original_max_position_embeddings=32,
                                         sliding_window=None, random_norms=True,
                                         rope_scaling={"rope_type": "longrope",
                                                       "short_factor": [1.0, 1.1, 1.3, 1.6],
                                                       "long_factor": [1.0, 2.0, 4.0, 9.0]})),
    # Qwen3's long-context form: YaRN (factor 4 over an original 32 tokens; beta_fast 8 puts the
    # ramp inside the 8 frequencies of head_dim 16, so each of its three parts is used).
    "qwen3_yarn": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       tie_word_embeddings=False, random_norms=True,
                                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                                                     "beta_slow": 1.0, "original_max_position_embeddings": 32})),
    # SmolLM3: every 4th layer without RoPE (layer 3 of 4).
    "smollm3_nope": ("SmolLM3Config", dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=True, random_norms=True)),
    # Granite 3: embedding, residual, attention and logits multipliers.
    "granite_multipliers": ("GraniteConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=False, embedding_multiplier=6.0,
                                                  residual_multiplier=0.25, attention_multiplier=0.05,
                                                  logits_scaling=3.0, random_norms=True)),
    # Head dim 64 with 3 query heads per KV head (the default model's shape): the vectorised
    # attention kernel, not only its scalar path.
    "llama_head64": ("LlamaConfig", dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                                         tie_word_embeddings=True)),
    # Splits over 3 tensor-parallel ranks (heads, one KV head replicated, intermediate; the
    # vocabulary in padded parts).
    "llama_tp3": ("LlamaConfig", dict(hidden_size=96, intermediate_size=96, num_attention_heads=3,
                                      num_key_value_heads=1, tie_word_embeddings=False)),
}


def make_tiny_model(root: Path, name: str, tokenizer, v4_config: bool = False) -> TinyModel:
    import transformers
    cls_name, extra = VARIANTS[name]
    config_cls = getattr(transformers, cls_name)
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id, rope_theta=10000.0)
    kwargs.update(extra)
    random_norms = kwargs.pop("random_norms", False)
    rope_scaling = kwargs.pop("rope_scaling", None)
    if rope_scaling:
        kwargs["rope_parameters"] = {"rope_theta": kwargs["rope_theta"], **rope_scaling}
    config = config_cls(**kwargs)
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)   # hash() of a str changes per process
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    hf = model_cls(config).float().eval()
    if random_norms:
        with torch.no_grad():
            for n, t in hf.named_parameters():
                if n.endswith("norm.weight"):
                    t.uniform_(0.5, 1.5)
    path = root / (name + ("_v4" if v4_config else ""))
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if v4_config:
        # The transformers 4 form: rope_theta at the top, scaling in rope_scaling.
        rope = cfg.pop("rope_parameters", None) or {}
        cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
        cfg_file.write_text(json.dumps(cfg))
    return TinyModel(str(path), hf, tokenizer, name)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


_cache: dict = {}


@pytest.fixture(scope="session")
def tiny_models(tiny_root, tiny_tokenizer):
    """name -> TinyModel, built once per session on first use."""
    def get(name: str, v4_config: bool = False) -> TinyModel:
        key = (name, v4_config)
        if key not in _cache:
            _cache[key] = make_tiny_model(tiny_root, name, tiny_tokenizer, v4_config)
        return _cache[key]
    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> TinyModel:
    return tiny_models("llama_gqa_untied")


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate: the oracle for our tokens. EOS is banned until
    max_new_tokens (min_new_tokens), like SamplingParams(min_tokens=max_tokens)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                          min_new_tokens=max_new_tokens, pad_token_id=hf.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def wait_for(condition, what: str, timeout: float = 60.0, interval: float = 0.02):
    """Poll until `condition()` is true and return its value; a hang fails the test after `timeout`
    seconds (a bound on waiting, never asserted on as a speed)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
    return value


PROMPTS = [
    "The quick brown fox",
    "Paged attention stores",
    "Once upon a time there was a tiny language model",
    "def add(a, b):",
    "Héllo wörld 日本語",
    "An operating system maps pages of virtual memory to physical frames. Continuous batching schedules",
    "one",
    "Keys and values",
]


def _run_kernel_variant(name: str):
    """Make CPU kernel variant `name` the one pagedserve calls, for one test; skipped (naming
    the missing CPU flags) where this CPU cannot run it."""
    from pagedserve.kernels import cpu
    missing = cpu.missing_flags(name)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (kernel variant {name})")
    with cpu.using_variant(name) as lib:
        assert lib is not None, f"kernel variant {name} failed to build"
        assert lib.kernel_variant().decode().startswith(name)
        yield name


@pytest.fixture(params=["avx512bf16", "avx512", "avx2", "scalar"])
def kernel_variant(request):
    """Each CPU kernel variant in turn (kernels/cpu.py VARIANTS), for kernel-level tests."""
    yield from _run_kernel_variant(request.param)


@pytest.fixture
def avx2_kernels():
    """The AVX2 kernel variant, as a CPU without AVX-512 runs it."""
    yield from _run_kernel_variant("avx2")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance (2 CPUs) for the whole run, shared by every test that uses Ray
    (tensor parallelism's ray backend, data-parallel replicas), shut down at the end; skips
    where Ray is not installed (the `ray` extra). Starting Ray costs seconds."""
    ray = pytest.importorskip("ray")
    ctx = ray.init(num_cpus=2, include_dashboard=False, namespace="pagedserve-tests")
    yield ctx
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_cluster):
    """The shared Ray instance's address: servers join it with --ray-address."""
    return ray_cluster.address_info["gcs_address"]


from tests.api_servers import api_server, client, http, pooling_server  # noqa: E402,F401 - the server tests' fixtures
