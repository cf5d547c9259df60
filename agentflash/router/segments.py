"""What kind of text a request is writing: tool-call body, code block, calculation, schema-bound
answer or prose. Segments switch inside one generation; the tracker follows committed tokens."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from agentflash.tool_format import CLOSE, OPEN, CallEnd


class SegmentKind(enum.Enum):
    PROSE = "prose"
    TOOL_CALL = "tool_call"  # from <tool_call> to the </tool_call> that ends it
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
    its own (CommonMark): backticks inside a line are inline code. A tool call runs from its
    ``<tool_call>`` to where ``parse_tool_calls`` ends it (``CallEnd``), however the steps split
    the text: a ``</tool_call>`` in one of its JSON strings does not end it.
    """

    def __init__(self, schema_bound: bool = False, calls_beside: bool = False):
        self.schema_bound = schema_bound  # the reply's text is a JSON schema's answer
        self.calls_beside = calls_beside  # ... and tool calls may stand instead of it
        self.call: CallEnd | None = None  # the tool call being written: where it ends
        self.in_code = False
        self.fence: tuple[str, int] | None = None  # the block open as the current line began
        self.line = ""  # text of the current line so far
        self.math = False  # ... which is the working of a calculation (_MATH_LINE)
        self.dense_tail = ""  # the last characters of the line's text without its blanks
        self.segments: list[Segment] = []

    @property
    def in_tool_call(self) -> bool:
        return self.call is not None

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
        while text:
            text = self._call(text) if self.call is not None else self._outside(text)

    def _outside(self, text: str) -> str:
        """Read text outside a call up to a ``<tool_call>`` (which may have begun at the end of
        the text before); what follows the tag is returned, the call's."""
        kept = self.line[-len(OPEN) + 1 :]  # where a tag begun at the end of a piece is seen
        at = (kept + text).find(OPEN)
        if at < 0:
            self._lines(text)
            return ""
        at -= len(kept)
        self._lines(text[: max(at, 0)])
        self._extend(OPEN[max(-at, 0) :])  # (a fence after it on its line is none)
        self.call = CallEnd()
        return text[at + len(OPEN) :]

    def _call(self, text: str) -> str:
        """Read a call's body up to its end as ``parse_tool_calls`` reads it (``CallEnd``: a tag
        in one of its JSON strings does not end it); what follows its closing tag is returned
        (the body's own text, where it ends at a tag before the text)."""
        assert self.call is not None
        end = self.call.read(text)
        if end is None:
            return ""
        body, end = self.call.text, end + len(CLOSE)
        self.call = None
        line = body.rfind("\n", 0, end)  # the line goes on (the call's text is not read)
        self.line = body[line + 1 : end] if line >= 0 else self.line + body[:end]
        # a calculation the call's JSON held is not the prose's after it (a date, 2024-05-01)
        self.math, self.dense_tail = False, ""
        return body[end:]

    def _lines(self, text: str) -> None:
        """Read text outside a call that holds no ``<tool_call>``: lines, fences, calculations."""
        for piece in re.split(r"(\n)", text):
            if piece == "\n":
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
