"""A peer agent framework as a client: the OpenAI Agents SDK, on its chat-completions model with
an ``AsyncOpenAI`` client pointed at ``agentflash serve``, runs an agent with a function tool to
completion on the demo model."""

import agents
import anyio
import pytest
from openai import AsyncOpenAI

from agentflash.backends.local import load_weights
from agentflash.engine.engine import Engine, EngineConfig
from agentflash.server.app import ServerConfig, serving_in_thread


@pytest.fixture(scope="module")
def url():
    net, tokenizer, model_dir, drafter = load_weights("demo")
    engine = Engine(net, tokenizer, EngineConfig(max_len=1024), model_dir, drafter)
    with serving_in_thread(ServerConfig(port=0, max_tokens=256), engine) as base_url:
        yield base_url


def test_agents_sdk_runs_an_agent_with_a_function_tool(url):
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """Get the weather forecast for a city.

        Args:
            city: The city to look up.
            days: How many days of forecast.
        """
        calls.append((city, days))
        return '{"status": "ok", "id": 403}'

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    model = agents.OpenAIChatCompletionsModel(model="demo", openai_client=client)
    agent = agents.Agent(
        name="assistant", instructions="You are a helpful assistant with access to tools.",
        tools=[get_weather], model=model,
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=96))

    async def main():
        try:
            return await agents.Runner.run(agent, "Use get_weather with city Oslo, days 3.",
                                           max_turns=4)
        finally:
            await client.close()

    result = anyio.run(main)
    assert len(calls) >= 1 and all(isinstance(c, str) and isinstance(d, int) for c, d in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
