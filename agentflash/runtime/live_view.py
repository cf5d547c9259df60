"""A live terminal view of a workflow run: steps, agents, tool calls and tokens per second."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentflash.runtime import events as ev
from agentflash.runtime.errors import StepFailed
from agentflash.runtime.workflow import (
    StepEvent,
    StepFinished,
    StepStarted,
    Workflow,
    WorkflowEvent,
    WorkflowResult,
)


@dataclass
class _Row:
    agent: str
    status: str = "waiting"
    tools: list[str] = field(default_factory=list)
    new_tokens: int = 0
    wall_s: float = 0.0
    writing: str = ""  # the tail of what the model is writing now
    call: tuple[int, str] | None = None  # the tool call being written (index, arguments so far)

    @property
    def tokens_per_s(self) -> str:
        return f"{self.new_tokens / self.wall_s:.1f}" if self.wall_s > 0 else "-"


class WorkflowView:
    """One row per step, updated from the run's events; render with rich (``__rich__``)."""

    def __init__(self, wf: Workflow):
        self.name = wf.name
        self.rows = {step.id: _Row(step.agent) for step in wf.steps}

    def update(self, event: WorkflowEvent) -> None:
        if isinstance(event, StepStarted):
            self.rows[event.step].status = "running"
        elif isinstance(event, StepFinished):
            self.rows[event.step].status = "done"
            self.rows[event.step].writing = ""
        elif isinstance(event, StepEvent):
            self._run_event(self.rows[event.step], event.event)
        else:
            raise AssertionError(f"unknown workflow event {event!r}")

    def fail(self, err: Exception) -> None:
        """The run ended with ``err``: the step it names failed, the others still running were
        cancelled (a failure without a step, such as an output template's, fails them all)."""
        failed = err.step_id if isinstance(err, StepFailed) else None
        for step, row in self.rows.items():
            if row.status != "running":
                continue
            if failed is None or step == failed:
                row.status, row.writing = "failed", str(getattr(err, "cause", err))[:60]
            else:
                row.status, row.writing = "cancelled", ""

    def _run_event(self, row: _Row, event: ev.RunEvent) -> None:
        if isinstance(event, ev.AgentTurnStarted):
            row.agent, row.writing, row.call = event.agent, "", None
        elif isinstance(event, ev.TextDelta):
            row.writing = (row.writing + event.text).replace("\n", " ")[-40:]
        elif isinstance(event, ev.ToolCallDelta):
            so_far = row.call[1] if row.call and row.call[0] == event.index else ""
            row.call = (event.index, so_far + event.arguments_delta)
            row.writing = f"{event.name}({row.call[1][-30:]}"
        elif isinstance(event, ev.ToolStarted):
            row.tools.append(f"{event.name} ...")
        elif isinstance(event, ev.ToolResult):
            mark = "failed" if event.is_error else "ok"
            pending = f"{event.name} ..."
            if pending in row.tools:
                row.tools[row.tools.index(pending)] = f"{event.name} {mark}"
            else:
                row.tools.append(f"{event.name} {mark}")
        elif isinstance(event, ev.GenerationStats):
            row.new_tokens += event.stats.get("new_tokens", 0)
            row.wall_s += event.stats.get("wall_s", 0.0)
        elif isinstance(event, ev.HandoffOccurred):
            row.agent = f"{event.from_agent} -> {event.to_agent}"
        elif isinstance(event, ev.FinalOutput):
            row.writing = ""

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=f"workflow {self.name}", title_justify="left")
        for column in ("step", "agent", "status", "tool calls", "tokens", "tok/s"):
            table.add_column(column, no_wrap=column != "tool calls", min_width=len(column),
                             justify="right" if column in ("tokens", "tok/s") else "left")
        # what a step writes (or why it failed) wraps: it must not squeeze the columns before it
        table.add_column("writing", ratio=1)
        for step_id, row in self.rows.items():
            table.add_row(step_id, row.agent, row.status, ", ".join(row.tools) or "-",
                          str(row.new_tokens), row.tokens_per_s, row.writing)
        return table


async def run_with_view(wf: Workflow, inputs: dict[str, Any], console: Any) -> WorkflowResult:
    """Run ``wf`` while a rich ``Live`` display on ``console`` shows its progress."""
    from rich.live import Live

    view = WorkflowView(wf)
    try:
        with Live(view, console=console, refresh_per_second=8, transient=False):
            try:
                async with wf.run_streamed(inputs) as run:
                    async for event in run:
                        view.update(event)
            except Exception as err:
                view.fail(err)
                raise
    finally:
        if not console.is_terminal:  # a file or a pipe: Live leaves its last line open
            console.line()
    return run.result
