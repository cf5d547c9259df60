"""Typed tools on the embedded engine, streamed: each call runs as soon as its block closes.

    python examples/sdk_tools.py [MODEL_DIR]        # default: the bundled demo model
"""

import sys

import anyio

from agentflash.backends.local import LocalBackend
from agentflash.runtime import Agent, Decoding, GenerationStats, Runner, TextDelta, ToolResult, tool


@tool
def get_weather(city: str, days: int = 1) -> dict:
    """Get the weather forecast for a city.

    Args:
        city: The city to look up.
        days: How many days of forecast.
    """
    return {"status": "ok", "id": len(city) * 100 + days, "forecast": " ".join(["sunny"] * days)}


agent = Agent("assistant", instructions="You are a helpful assistant with access to tools.",
              tools=[get_weather], decoding=Decoding(max_tokens=64))


async def main(backend=None):
    backend = backend or LocalBackend(sys.argv[1] if len(sys.argv) > 1 else "demo")
    prompt = "Use get_weather with city Oslo, days 3."
    async with backend, Runner.run_streamed(agent, prompt, backend=backend) as run:
        async for event in run:
            if isinstance(event, TextDelta):
                print(event.text, end="", flush=True)
            elif isinstance(event, ToolResult):
                print(f"\n{event.name}({event.arguments}) -> {event.output}")
            elif isinstance(event, GenerationStats):
                s = event.stats
                print(f"\n[{s['new_tokens']} tokens, {s['tokens_per_s']} tok/s, tau {s['tau']}]")
    print("final output:", run.result.final_output)
    print(run.result.tracer.timeline())
    return run.result


if __name__ == "__main__":
    anyio.run(main)
