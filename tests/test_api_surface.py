"""vLLM's API surface (issue 33): the small routes (/ping, /load, /tokenize's token strings),
the developer role, and vLLM's flags, accepted with their meaning or refused saying how
pagedserve differs. /v1/responses: test_responses.py; embeddings: test_embeddings.py."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cli import build_parser, config_from_args, main
from pagedserve.config import EngineConfig, _check_swap_space, parse_human_int
from pagedserve.engine.chat import render_chat
from pagedserve.server.config import ServerConfig
from tests.server_utils import PROMPT, api_server_args, served


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("surface"), api_server_args(
        "--response-role", "bot", "--return-tokens-as-token-ids", "--disable-fastapi-docs", "--max-log-len", "100",
        "--override-generation-config", '{"max_new_tokens": 3}', "--enable-chunked-prefill",
        "--max-model-len", "0.5k", "--max-seq-len-to-capture", "8K"))


# ---- routes ------------------------------------------------------------------------------------------
def test_ping_load_and_token_strings(server, http, tiny_llama):
    assert httpx.get(server.url + "/ping").status_code == 200          # no key, as /health
    assert httpx.post(server.url + "/ping").status_code == 200
    assert http.get("/load").json() == {"server_load": 0}
    assert httpx.get(server.url + "/load").status_code == 401           # a data route: behind the key
    out = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert out["token_strs"] == tiny_llama.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert "token_strs" not in http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert out["max_model_len"] == 500                                    # --max-model-len 0.5k
    assert http.get("/docs").status_code == 404 and http.get("/openapi.json").status_code == 404
    # A generating server asked for embeddings: a 400 naming the flag, not a 404.
    r = http.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def test_developer_role_response_role_and_token_ids(client, http, tiny_llama):
    # The tiny template prints each role: developer is known to it only as system.
    dev = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "be brief"},
                                                    {"role": "user", "content": "hi"}]}).json()["tokens"]
    sys_ = http.post("/tokenize", json={"messages": [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "hi"}]}).json()["tokens"]
    assert dev == sys_
    r = client.chat.completions.create(model="tiny", messages=[{"role": "developer", "content": "be brief"},
                                                               {"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].message.role == "bot"                              # --response-role
    assert r.usage.completion_tokens <= 3                                  # --override-generation-config
    token = r.choices[0].logprobs.content[0]
    assert token.token.startswith("token_id:") and int(token.token.split(":")[1]) >= 0
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, max_tokens=2))
    assert chunks[0].choices[0].delta.role == "bot"


def test_developer_role_stays_where_the_template_knows_it(tiny_llama):
    tok = tiny_llama.tokenizer
    knows = "{% for m in messages %}{% if m['role'] == 'developer' %}D:{% endif %}{{ m['content'] }}{% endfor %}"
    conv = [{"role": "developer", "content": "x"}]
    assert tok.decode(render_chat(tok, conv, False, chat_template=knows)) == "D:x"
    assert "<|system|>x" in tok.decode(render_chat(tok, conv, False))


# ---- flags -------------------------------------------------------------------------------------------
VLLM_LINE = ["serve", "org/model", "--enable-chunked-prefill", "--max-log-len", "10", "--disable-fastapi-docs",
             "--response-role", "bot", "--return-tokens-as-token-ids", "--override-generation-config",
             '{"temperature": 0.5}', "--max-seq-len-to-capture", "8192", "--max-model-len", "4k",
             "--max-num-batched-tokens", "8K", "--runner", "generate", "--block-size", "32"]


def test_a_typical_vllm_command_line_parses():
    args = build_parser().parse_args(VLLM_LINE)
    engine = config_from_args(EngineConfig, args, model=args.model_tag)
    server = config_from_args(ServerConfig, args)
    assert (engine.max_model_len, engine.max_num_batched_tokens, engine.block_size) == (4000, 8192, 32)
    assert engine.enable_chunked_prefill and engine.override_generation_config == {"temperature": 0.5}
    assert engine.max_seq_len_to_capture == 8192 and engine.runner == "generate"
    assert (server.max_log_len, server.response_role) == (10, "bot")
    assert server.disable_fastapi_docs and server.return_tokens_as_token_ids
    no = build_parser().parse_args(["serve", "--no-enable-chunked-prefill"])
    assert config_from_args(EngineConfig, no).enable_chunked_prefill is False


@pytest.mark.parametrize("text,value", [("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("1m", 10**6),
                                        ("1M", 2**20), ("2048", 2048), (512, 512)])
def test_human_readable_counts(text, value):
    assert parse_human_int(text) == value


@pytest.mark.parametrize("text", ["25.6K", "1.5", "4x", "0.0001k"])
def test_bad_counts_are_refused(text):
    with pytest.raises(ValueError):
        parse_human_int(text)


def test_refusals_and_warnings_of_the_silent_cases(caplog):
    with pytest.raises(ValueError, match="one of 1, 2, 4, 8, 16, 32"):
        EngineConfig(block_size=7)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--block-size", "7"])
    assert "block_size must be one of" in str(e.value.code)
    # A byte count where GiB are meant: said so, not an attempt at petabytes.
    with pytest.raises(ValueError, match="looks like a size in bytes, which would be 0.25 GiB"):
        _check_swap_space(268435456, "swap", total=16 * 1024**3)
    with pytest.raises(ValueError, match="more than 70%"):
        _check_swap_space(12, "swap", total=16 * 1024**3)
    with caplog.at_level(logging.WARNING, logger="pagedserve.config"):
        _check_swap_space(4, "recompute", total=64 * 1024**3)
        _check_swap_space(8, "swap", total=16 * 1024**3)
        EngineConfig(enable_chunked_prefill=False)
    text = caplog.text
    assert "not used: only preemption_mode='swap'" in text and "more than 40%" in text
    assert "still runs a prompt longer than the step's token budget" in text
    with pytest.raises(ValueError, match="unsupported keys"):
        EngineConfig(runner="pooling", pooler_config={"pooling_kind": "x"})
    with pytest.raises(ValueError, match="needs runner='pooling'"):
        EngineConfig(pooler_config={"pooling_type": "MEAN"})


def test_serve_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pagedserve ")


def test_enable_chunked_prefill_in_the_offline_api(tiny_llama):
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, enable_chunked_prefill=True,
              override_generation_config={"temperature": 0.0, "max_new_tokens": 4})
    assert llm.get_default_sampling_params().max_tokens == 4
    out = llm.generate(PROMPT, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_default_models_hub_id_is_the_bundled_file_offline(tmp_path):
    code = ("from pagedserve.models.resolve import resolve_model; "
            "from pagedserve.models.loader import default_model_path; "
            "assert resolve_model('HuggingFaceTB/SmolLM2-135M-Instruct') == default_model_path(); print('ok')")
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
    assert "serving the bundled copy" in res.stderr


# ---- the shipped tool template and the warning -------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_the_template_does_not_show_are_warned_about(client, server):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert "renders no tools" in raw.headers["warning"] and raw.parse().choices[0].message.content is not None
    plain = client.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                             max_tokens=2)
    assert "warning" not in plain.headers
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                   tool_choice="none", max_tokens=2)
    assert server.log().count("renders no tools") == 1                     # logged once


def test_the_shipped_hermes_template(tiny_llama):
    from pagedserve.chat_templates import renders_tools
    from pagedserve.engine.chat import load_chat_template
    from pagedserve.server.tools import ToolPlan, parse_tool_calls
    hermes = load_chat_template("hermes")
    assert hermes == load_chat_template("tool_chat_template_hermes.jinja") and renders_tools(hermes)
    with pytest.raises(ValueError, match="shipped template"):
        load_chat_template("no-such-template")
    tok = tiny_llama.tokenizer
    conv = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tok.decode(render_chat(tok, conv, True, hermes, tools=[WEATHER]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and '"name": "get_weather"' in text
    assert "<tools>" in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The call the template shows is the one the hermes parser reads back.
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, calls = parse_tool_calls(ToolPlan("auto", [WEATHER]), turn)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    # Selectable where a template is asked for: LLM(chat_template=...) (and so --chat-template hermes).
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=32, chat_template="hermes")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), tools=[WEATHER], use_tqdm=False)
    assert "<tools>" in tok.decode(out[0].prompt_token_ids)


def test_hermes_template_is_smollm2s_own_without_tools():
    from pagedserve.engine.chat import load_chat_template
    from pagedserve.models.loader import default_model_path, load_tokenizer
    try:
        tok = load_tokenizer(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"}]
    hermes = load_chat_template("hermes")
    assert render_chat(tok, conv, True, hermes) == render_chat(tok, conv, True)
    # SmolLM2's own template drops the tools; the shipped one shows them.
    assert render_chat(tok, conv, True, tools=[WEATHER]) == render_chat(tok, conv, True)
    assert len(render_chat(tok, conv, True, hermes, tools=[WEATHER])) > len(render_chat(tok, conv, True)) + 30
