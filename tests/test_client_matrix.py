"""The client libraries people point at vLLM servers, against a live pagedserve (the tiny
model): the openai client (tests/test_server.py, test_responses.py, test_embeddings.py),
langchain-openai (ChatOpenAI: chat, stream, a tool call, the Responses API; OpenAIEmbeddings)
and the openai-agents SDK (an Agent over the Responses API, with a function tool; the chat
completions model). The server section of docs/serving.md lists exactly these."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
import torch

from tests.server_utils import API_KEY


@pytest.fixture(scope="module")
def server(api_server):
    """tests/api_servers.py: auto tool choice (hermes parser) and the responses store."""
    return api_server


# ---- langchain-openai -----------------------------------------------------------------------------
def test_langchain_chat_stream_tools_and_responses(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        return "sunny"

    chat = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_tokens=6,
                      max_retries=0)
    reply = chat.invoke("Hello there")
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat.stream("Hello there"))
    assert streamed == reply.content
    longer = chat.model_copy(update={"max_tokens": 40})
    called = longer.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Paris?")
    assert called.tool_calls[0]["name"] == "get_weather"
    assert called.tool_calls[0]["args"]["city"] in ("Paris", "Tokyo")
    responses = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_tokens=6,
                           max_retries=0, use_responses_api=True)
    answer = responses.invoke("Hello there")
    assert answer.text == reply.content      # the same greedy text through /v1/responses


def test_langchain_embeddings(pooling_server, tiny_llama):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send text, not tiktoken's ids (OpenAI's tokenizer, not the model's).
    emb = OpenAIEmbeddings(model="tiny", base_url=pooling_server.url + "/v1", api_key=API_KEY,
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(["The quick brown fox", "def add(a, b):"])
    query = emb.embed_query("The quick brown fox")
    assert len(docs) == 2 and len(docs[0]) == 64 and docs[0] == pytest.approx(query, abs=1e-6)
    with torch.no_grad():
        ids = tiny_llama.tokenizer.encode("def add(a, b):")
        ref = torch.nn.functional.normalize(tiny_llama.hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
    assert docs[1] == pytest.approx(ref.tolist(), abs=1e-5)


# ---- openai-agents --------------------------------------------------------------------------------
def test_openai_agents_over_responses_and_chat(server):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    set_tracing_disabled(True)      # no export of traces to OpenAI's servers
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> tuple:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        # OpenAI's agents treat a response cut by max_output_tokens as a failure: a stop string (a
        # vLLM extra) ends the random model's text first.
        stop = {"stop": ["e", " "]}
        settings = ModelSettings(temperature=0, max_tokens=60, extra_body=stop)
        # The default model class is the Responses one: a plain answer, then a forced tool call
        # whose result is the agent's answer (stop_on_first_tool: no second, free turn).
        responses_model = OpenAIResponsesModel("tiny", client)
        plain = await Runner.run(Agent(name="a", instructions="Be brief.", model=responses_model,
                                       model_settings=settings), "Hello there")
        with_tool = await Runner.run(Agent(name="w", instructions="Use the tool.", model=responses_model,
                                           tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                                           model_settings=ModelSettings(temperature=0, max_tokens=60,
                                                                        tool_choice="get_weather")),
                                     "weather in Paris?", max_turns=3)
        streamed = Runner.run_streamed(Agent(name="s", instructions="Be brief.", model=responses_model,
                                             model_settings=settings), "Hello there")
        kinds = [event.type async for event in streamed.stream_events()]
        chat_model = OpenAIChatCompletionsModel("tiny", client)
        over_chat = await Runner.run(Agent(name="c", instructions="Be brief.", model=chat_model,
                                           model_settings=settings), "Hello there")
        return plain, with_tool, streamed, kinds, over_chat

    plain, with_tool, streamed, kinds, over_chat = asyncio.run(run())
    assert isinstance(plain.final_output, str)
    assert calls and calls[0] in ("Paris", "Tokyo")
    assert any(getattr(item, "type", "") == "tool_call_output_item" for item in with_tool.new_items)
    assert with_tool.final_output == f"sunny in {calls[0]}"
    assert "raw_response_event" in kinds and streamed.final_output == plain.final_output
    assert over_chat.final_output == plain.final_output      # the same greedy text over chat completions
    json.dumps(plain.raw_responses[0].usage.__dict__, default=str)   # usage came back
