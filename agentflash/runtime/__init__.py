"""The agent runtime: agents with typed tools, handoffs and structured output, one streaming run
loop, traces, and YAML workflows.

    from agentflash.runtime import Agent, Runner, tool

    @tool
    def get_weather(city: str, days: int = 1) -> dict:
        '''Get the weather forecast for a city.'''
        ...

    agent = Agent("forecaster", tools=[get_weather])
    result = Runner.run_sync(agent, "Use get_weather with city Oslo, days 3.")
"""

from agentflash.backends.base import Decoding, ForceTool, Speculation, ToolChoice
from agentflash.runtime.agent import Agent, Guardrail
from agentflash.runtime.errors import (
    GuardrailTripped,
    MaxTurnsExceeded,
    ModelBehaviorError,
    RunCancelled,
    RunError,
    StepFailed,
)
from agentflash.runtime.events import (
    AgentTurnStarted,
    FinalOutput,
    GenerationStats,
    HandoffOccurred,
    RunEvent,
    TextDelta,
    ToolCallDelta,
    ToolResult,
    ToolStarted,
)
from agentflash.runtime.runner import Runner, RunResult, StreamedRun, ToolCallRecord
from agentflash.runtime.tools import FunctionTool, HttpTool, tool
from agentflash.runtime.tracing import Tracer
from agentflash.runtime.workflow import Workflow, WorkflowResult, load_workflow

__all__ = [
    "Agent", "AgentTurnStarted", "Decoding", "FinalOutput", "ForceTool", "FunctionTool",
    "GenerationStats", "Guardrail", "GuardrailTripped", "HandoffOccurred", "HttpTool",
    "MaxTurnsExceeded", "ModelBehaviorError", "RunCancelled", "RunError", "RunEvent", "RunResult",
    "Runner", "Speculation", "StepFailed", "StreamedRun", "TextDelta", "ToolCallDelta",
    "ToolCallRecord", "ToolChoice", "ToolResult", "ToolStarted", "Tracer", "Workflow",
    "WorkflowResult", "load_workflow", "tool",
]
