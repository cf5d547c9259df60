"""What kind of text a request is writing: tool-call body, code block, calculation, schema-bound
answer or prose. Segments switch inside one generation; the tracker follows committed tokens."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class SegmentKind(enum.Enum):
    PROSE = "prose"
    TOOL_CALL = "tool_call"  # from <tool_call> to </tool_call>
    CODE = "code"  # inside a fenced block
    MATH = "math"  # a line of arithmetic being worked
    SCHEMA = "schema"  # the whole reply is bound to a JSON schema (a regex's or a Lark
    # grammar's reply is tracked by its text, as prose, code or math: a regex may bind free text)


# A line with a number, an operator and a number: the working of a calculation.
_MATH_LINE = re.compile(r"\d\s*[-+*/×÷^%]\s*\(?\s*\d")


@dataclass
class Segment:
    """One stretch of a reply written in one kind and one decoding mode."""

    kind: SegmentKind
    mode: str  # "dflash" | "plain"
    tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0  # tokens the drafter proposed
    accepted: int = 0  # drafted or forced tokens the target accepted
    forced: int = 0  # tokens the grammar forced (no model proposed them)

    def to_dict(self) -> dict:
        tau = self.tokens / self.target_forwards if self.target_forwards else float(self.tokens)
        return {
            "kind": self.kind.value,
            "mode": self.mode,
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "tau": round(tau, 3),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "forced": self.forced,
        }


class SegmentTracker:
    """Follows one request's committed text and records its segments.

    Only the newly committed text of each step is decoded; a short tail of earlier text is kept so
    that markers split across tokens (a code fence) are still seen.
    """

    TAIL = 64

    def __init__(self, schema_bound: bool = False, calls_beside: bool = False):
        self.schema_bound = schema_bound  # the reply's text is a JSON schema's answer
        self.calls_beside = calls_beside  # ... and tool calls may stand instead of it
        self.in_tool_call = False
        self.in_code = False
        self.line = ""  # text of the current line so far
        self.tail = ""
        self.segments: list[Segment] = []

    @property
    def kind(self) -> SegmentKind:
        if self.schema_bound and not (self.calls_beside and self.in_tool_call):
            return SegmentKind.SCHEMA
        if self.in_tool_call:
            return SegmentKind.TOOL_CALL
        if self.in_code:
            return SegmentKind.CODE
        if _MATH_LINE.search(self.line):
            return SegmentKind.MATH
        return SegmentKind.PROSE

    def record(self, kind: SegmentKind, mode: str, tokens: int, forwards: int,
               drafted: int = 0, accepted: int = 0, forced: int = 0) -> None:
        """Count a step's committed tokens in the segment the step was decided in. The tokens
        of the prompt's step (no forward of their own: ``forwards`` 0) count as plain, until a
        later step of the same kind is recorded: they join its segment, in its mode."""
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind is kind and not last.target_forwards:
            last.mode = mode
        if last is None or last.kind is not kind or last.mode != mode:
            last = Segment(kind, mode)
            self.segments.append(last)
        last.tokens += tokens
        last.target_forwards += forwards
        last.drafted += drafted
        last.accepted += accepted
        last.forced += forced

    def feed(self, text: str) -> None:
        """Advance over newly committed text."""
        for piece in re.split(r"(<tool_call>|</tool_call>|\n)", text):
            if piece in ("<tool_call>", "</tool_call>"):
                self.in_tool_call = piece == "<tool_call>"
                self.tail = ""  # no fence runs across the marker
            elif self.in_tool_call:  # a ``` in the call's JSON opens no code block
                self.line = "" if piece == "\n" else self.line + piece
            elif piece == "\n":
                self.line = ""
                self.tail += piece
            elif piece:
                before = self.tail.count("```")
                self.tail += piece
                self.line += piece
                if (self.tail.count("```") - before) % 2:
                    self.in_code = not self.in_code
            self.tail = self.tail[-self.TAIL :]
