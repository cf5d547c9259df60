"""Three runs share one engine concurrently; a triage agent hands over to a specialist; an input
guardrail stops the third, a request it must not serve.

    python examples/sdk_handoff.py [MODEL_DIR]      # default: the bundled demo model
"""

import sys

import anyio

from agentflash.backends.local import LocalBackend
from agentflash.runtime import Agent, Decoding, GuardrailTripped, Runner, tool


@tool
async def get_weather(city: str) -> dict:
    """Get the weather forecast for a city."""
    return {"status": "ok", "id": len(city), "forecast": "sunny"}


def no_secrets(text: str) -> str | None:
    return "the request mentions a password" if "password" in text.lower() else None


forecaster = Agent("forecaster", instructions="You are a helpful assistant with access to tools.",
                   tools=[get_weather], handoff_description="Answers weather questions.",
                   decoding=Decoding(max_tokens=64))
triage = Agent("triage", instructions="You are an agent. Call tools when they help.",
               handoffs=[forecaster], input_guardrails=[no_secrets],
               decoding=Decoding(max_tokens=64))


async def main(backend=None):
    backend = backend or LocalBackend(sys.argv[1] if len(sys.argv) > 1 else "demo")
    requests = {city: f"Use transfer_to_forecaster with reason weather in {city}."
                for city in ("Oslo", "Lima")} | {"secret": "My password is hunter2."}
    results = {}

    async def ask(key: str) -> None:
        try:
            results[key] = await Runner.run(triage, requests[key], backend=backend)
        except GuardrailTripped as err:
            results[key] = err

    async with backend, anyio.create_task_group() as tg:  # one engine serves every run
        for key in requests:
            tg.start_soon(ask, key)
    for key, r in results.items():
        done = r if isinstance(r, GuardrailTripped) else f"{r.last_agent}: {r.final_output!r}"
        print(f"{key}: {done}")
    return results


if __name__ == "__main__":
    anyio.run(main)
