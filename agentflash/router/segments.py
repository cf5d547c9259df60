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
# ... the same on the line's text without its blanks (which the pattern skips, however long)
_MATH_DENSE = re.compile(r"\d[-+*/×÷^%]\(?\d")
_BLANKS = re.compile(r"\s+")
# A code fence (CommonMark): a line that starts, after at most three spaces, with a run of three
# or more backticks or tildes; what follows the run is an opening fence's info string.
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)", re.DOTALL)


def _opening_fence(line: str) -> tuple[str, int] | None:
    """(character, length) of the fence ``line`` opens, or None (a backtick fence's info string
    holds no backtick: "```x```" is inline code)."""
    match = _FENCE.match(line)
    if match is None or (match[1][0] == "`" and "`" in match[2]):
        return None
    return match[1][0], len(match[1])


def _closes(line: str, fence: tuple[str, int]) -> bool:
    """Whether ``line`` closes a block ``fence`` opened: a run of the same character, at least
    as long, and nothing after it but blanks."""
    match = _FENCE.match(line)
    return (match is not None and match[1][0] == fence[0] and len(match[1]) >= fence[1]
            and not match[2].strip(" \t\r"))  # (a line may end in \r\n)


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

    Only the newly committed text of each step is read; the current line is kept, so that a code
    fence split across tokens is still seen. A fence opens or closes a block only as a line of
    its own (CommonMark): backticks inside a line are inline code.
    """

    def __init__(self, schema_bound: bool = False, calls_beside: bool = False):
        self.schema_bound = schema_bound  # the reply's text is a JSON schema's answer
        self.calls_beside = calls_beside  # ... and tool calls may stand instead of it
        self.in_tool_call = False
        self.in_code = False
        self.fence: tuple[str, int] | None = None  # the block open as the current line began
        self.line = ""  # text of the current line so far
        self.math = False  # ... which is the working of a calculation (_MATH_LINE)
        self.dense_tail = ""  # the last characters of the line's text without its blanks
        self.segments: list[Segment] = []

    @property
    def kind(self) -> SegmentKind:
        if self.schema_bound and not (self.calls_beside and self.in_tool_call):
            return SegmentKind.SCHEMA
        if self.in_tool_call:
            return SegmentKind.TOOL_CALL
        if self.in_code:
            return SegmentKind.CODE
        if self.math:
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
                self._extend(piece)  # (a fence after it on its line is none)
                if not self.in_tool_call:  # a calculation the call's JSON held is not the
                    # prose's after it (a date, "2024-05-01", is one)
                    self.math, self.dense_tail = False, ""
            elif self.in_tool_call:  # a ``` in the call's JSON opens no code block
                if piece == "\n":
                    self._new_line()
                else:
                    self._extend(piece)
            elif piece == "\n":
                if self.fence is None:
                    self.fence = _opening_fence(self.line)
                elif _closes(self.line, self.fence):
                    self.fence = None
                self._new_line()
                self.in_code = self.fence is not None
            elif piece:
                self._extend(piece)
                self.in_code = (_opening_fence(self.line) is not None if self.fence is None
                                else not _closes(self.line, self.fence))

    def _extend(self, piece: str) -> None:
        self.line += piece
        if not self.math:  # the new text, blanks out, after the few characters before it that
            # a calculation may begin in: each step's search was of the whole line so far (a
            # line of 120,000 characters took 13 s of searches)
            dense = self.dense_tail + _BLANKS.sub("", piece)
            self.math = _MATH_DENSE.search(dense) is not None
            self.dense_tail = dense[-3:]

    def _new_line(self) -> None:
        self.line, self.math, self.dense_tail = "", False, ""
