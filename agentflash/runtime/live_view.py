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
    started: dict[str, int] = field(default_factory=dict)  # a running call's id -> its cell

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

    def fail(self, err: BaseException) -> None:
        """The run ended with ``err``: the step it names failed, the others still running were
        cancelled (a failure without a step, such as an output template's, fails them all; an
        interruption, Ctrl-C, cancels them), and the steps still waiting never ran."""
        interrupted = not isinstance(err, Exception)
        failed = err.step_id if isinstance(err, StepFailed) else None
        for step, row in self.rows.items():
            # the failed step may have failed before it started (its input's template)
            if row.status == "waiting" and (interrupted or step != failed):
                row.status = "not run"
            elif row.status not in ("running", "waiting"):
                continue
            elif not interrupted and (failed is None or step == failed):
                row.status, row.writing = "failed", _said(getattr(err, "cause", err))
            else:
                row.status, row.writing = "cancelled", ""

    def _run_event(self, row: _Row, event: ev.RunEvent) -> None:
        if isinstance(event, ev.AgentTurnStarted):
            row.agent, row.writing, row.call = event.agent, "", None
        elif isinstance(event, ev.TextDelta):
            if row.call is not None:  # text after a call: the call's cell is done
                row.writing, row.call = "", None
            row.writing = (row.writing + event.text).replace("\n", " ")[-40:]
        elif isinstance(event, ev.ToolCallDelta):
            so_far = row.call[1] if row.call and row.call[0] == event.index else ""
            row.call = (event.index, so_far + event.arguments_delta)
            row.writing = f"{event.name}({row.call[1][-30:]}"
        elif isinstance(event, ev.ToolStarted):
            row.started[event.call_id] = len(row.tools)
            row.tools.append(f"{event.name} ...")
        elif isinstance(event, ev.ToolResult):
            # the cell of the call it answers (two calls of one tool finish in either order)
            done = f"{event.name} {'failed' if event.is_error else 'ok'}"
            at = row.started.pop(event.call_id, None)
            if at is None:  # a call the runtime answered: it never started
                row.tools.append(done)
            else:
                row.tools[at] = done
        elif isinstance(event, ev.GenerationStats):
            row.new_tokens += event.stats.get("new_tokens", 0)
            row.wall_s += event.stats.get("wall_s", 0.0)
        elif isinstance(event, ev.HandoffOccurred):
            row.agent = f"{event.from_agent} -> {event.to_agent}"
        elif isinstance(event, ev.FinalOutput):
            row.writing = ""

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"workflow {self.name}", title_justify="left")
        # one line a step, every column given its width here: the status and the counts keep
        # theirs, names and tool calls are cut with an ellipsis, what a step writes (or why it
        # failed) takes the rest; below 90 columns the tool calls and the writing are left out,
        # below 47 the counts and then the agent
        # (left to rich, a row too wide for the terminal squeezed the status and the counts to
        # nothing, and a wrapping column made rows of blank lines)
        widths = self._widths(options.max_width)
        for column, width in widths.items():
            table.add_column(column, width=width, no_wrap=True, overflow="ellipsis",
                             justify="right" if column in ("tokens", "tok/s") else "left")
        for step_id, row in self.rows.items():
            cells = {"step": step_id, "agent": row.agent, "status": row.status,
                     "tool calls": ", ".join(row.tools) or "-", "tokens": str(row.new_tokens),
                     "tok/s": row.tokens_per_s, "writing": row.writing}
            # as text: the model's text and an error's message are not rich's markup (a
            # "[key]" left out, a "[/b]" raising MarkupError in the middle of the run)
            table.add_row(*(Text(cells[column]) for column in widths))
        yield table

    def _widths(self, total: int) -> dict[str, int]:
        """Each shown column's width for a table at most ``total`` characters wide."""
        wide = total >= 90
        columns = [c for c in COLUMNS if wide or c not in ("tool calls", "writing")]
        rows = self.rows.values()
        want = {"step": max([4, *map(len, self.rows)]),
                "agent": max([5, *(len(r.agent) for r in rows)]),
                "tool calls": max([10, *(len(", ".join(r.tools)) for r in rows)])}
        fixed = {"status": len("cancelled"), "tokens": 6, "tok/s": 6}
        least = 20 if wide else 0  # what the writing column gets before names are cut

        def room() -> int:  # borders and padding: 3 characters a column and 1
            return total - (3 * len(columns) + 1) - sum(fixed[c] for c in fixed if c in columns)

        # narrower still, the counts go, then the agent: a step and its status stay whole
        for dropped in ("tok/s", "tokens", "agent"):
            if room() >= sum(min(want[c], 5) for c in want if c in columns) + least:
                break
            columns.remove(dropped)
        flexible = {c: min(want[c], 24) for c in want if c in columns}
        floor = 5 if len(columns) > 2 else 3  # names cut to "ab…" only where all else went
        while sum(flexible.values()) > room() - least and max(flexible.values()) > floor:
            widest = max(flexible, key=flexible.get)
            flexible[widest] -= 1
        widths = {**flexible, **fixed}
        if wide:
            widths["writing"] = max(room() - sum(flexible.values()), 1)
        return {c: widths[c] for c in columns}


COLUMNS = ("step", "agent", "status", "tool calls", "tokens", "tok/s", "writing")


async def run_with_view(wf: Workflow, inputs: dict[str, Any], console: Any) -> WorkflowResult:
    """Run ``wf`` while a rich ``Live`` display on ``console`` shows its progress."""
    from rich.live import Live

    view = WorkflowView(wf)
    live = Live(view, console=console, refresh_per_second=8, transient=False)
    try:
        try:
            async with wf.run_streamed(inputs) as run:
                async for event in run:
                    if not live.is_started:  # drawn once the run is under way: a model that
                        live.start()  # does not load, a budget too small, draw no table
                    view.update(event)
        except BaseException as err:  # Ctrl-C and cancellation too: no row left running
            view.fail(err)
            raise
    finally:
        if live.is_started:
            live.stop()
            if not console.is_terminal:  # a file or a pipe: Live leaves its last line open
                console.line()
    return run.result


def _said(err: BaseException) -> str:
    """An error's message; its type where it has none or its ``__str__`` fails."""
    try:
        return str(err) or type(err).__name__
    except Exception:  # noqa: BLE001
        return type(err).__name__
