"""Why a run stopped without its final output.

The three kinds of failure stay apart: the model's mistakes that it can correct (a bad tool call,
a tool that raised) go back to the model as tool results and never reach these classes; the
developer's mistakes are ``agentflash.errors.UserError``, raised when the agent or workflow is
built; the errors here end a run that was set up correctly.
"""

from __future__ import annotations

from agentflash.errors import UserError, described


class RunError(Exception):
    """A run stopped before its final output; the message says why. ``tracer``: the failed
    run's trace (``tracer.timeline()``), as a finished run's result holds it. ``steps``: a
    failed workflow's steps that finished (``StepResult`` by step id), as its result would have
    held them; None for an agent's run."""

    tracer = None  # set where the run (or workflow) that failed raises it
    steps = None


class ModelBehaviorError(RunError):
    """The model wrote something that breaks the agent's contract and cannot be sent back: a reply
    that does not match the output type, or one that ignores the tool choice. (The grammar layer
    makes these impossible on the embedded engine once it constrains decoding.)"""


class MaxTurnsExceeded(RunError):
    """The agent used its model turns without reaching a final output."""


class GuardrailTripped(RunError):
    """A guardrail stopped the run."""

    def __init__(self, kind: str, guardrail: str, reason: str):
        super().__init__(f"{kind} guardrail {guardrail!r} stopped the run: {reason}")
        self.kind, self.guardrail, self.reason = kind, guardrail, reason

    def __reduce__(self) -> tuple:  # copied or pickled (a process pool's): its own arguments,
        # not the message alone, and what the run set on it (its trace, a workflow's steps)
        return type(self), (self.kind, self.guardrail, self.reason), self.__dict__


class RunCancelled(RunError):
    """The run was cancelled before it finished."""


class StepFailed(RunError):
    """A workflow step's run failed; the other steps were cancelled."""

    def __init__(self, step_id: str, agent: str, cause: BaseException):
        said = str(cause) if isinstance(cause, RunError | UserError) else (
            described(cause))  # another exception: its type says what it was
        super().__init__(f"step {step_id!r} (agent {agent!r}) failed: {said}")
        self.step_id, self.agent, self.cause = step_id, agent, cause

    def __reduce__(self) -> tuple:  # as GuardrailTripped's
        return type(self), (self.step_id, self.agent, self.cause), self.__dict__


class OutputsFailed(RunError):
    """The steps ran, and the workflow's outputs could not be rendered from their results."""
