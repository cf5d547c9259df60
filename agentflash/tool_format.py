"""The Qwen3/Hermes tool-call format:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a tool's name (whole), as OpenAI's API takes it: chat templates write it unescaped
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class MalformedToolCall:
    body: str
    error: str


# a call's body that names its tool before it breaks off (max_tokens cut it, or its JSON is
# bad further on), and where its arguments begin
_BEGUN = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,(?:\s*"arguments"\s*:\s*)?')


def begun_call(body: str) -> tuple[str, str] | None:
    """(the tool's name, the arguments as far as written) of a malformed call's body that
    names its tool before it breaks off; None where the name is not whole."""
    begun = _BEGUN.match(body)
    if begun is None:
        return None
    try:
        name = json.loads(begun.group(1))
    except ValueError:  # an escape JSON has not
        return None
    rest = body[begun.end():] if begun.group(0).rstrip().endswith(":") else ""
    return name, rest.strip()


class JsonScan:
    """Where a JSON text's strings and brackets are, one character at a time. ``top_strings``:
    whether a quote outside every bracket opens a string (a call's body reads quotes only inside
    its JSON object, so that text around it cannot hide the closing tag)."""

    def __init__(self, top_strings: bool = True) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self._top_strings = top_strings

    def step(self, c: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = self.depth > 0 or self._top_strings
        elif c in "{[":
            self.depth += 1
        elif c in "}]" and self.depth > 0:
            self.depth -= 1


# what a JsonScan steps over unchanged, in a string and outside one (and no tag begins)
_IN_STRING, _OUTSIDE = re.compile(r'[^"\\]*'), re.compile(r'[^"{}\[\]<]*')


class CallEnd:
    """Finds, in a call's body fed in pieces, the ``</tool_call>`` that closes it: the first one
    outside the body's JSON strings. An argument may hold the tag itself (the tools' grammar
    lets a string hold any text), and the call goes on past it."""

    def __init__(self) -> None:
        self.text = ""  # the body so far
        self.end: int | None = None  # where the closing tag starts, once found
        self.pos = 0  # ``text[:pos]`` is known to be body (a tag may be starting at ``pos``)
        self._scan = JsonScan(top_strings=False)
        self._tagged = False  # ``read``: the body holds a closing tag (in a string: it goes on)
        self._in_string = False  # ... and it is JSON's beginning, cut inside a string's text

    def feed(self, piece: str) -> int | None:
        self.text += piece
        text = self.text
        while self.end is None and self.pos < len(text):
            if text[self.pos] == "<" and not self._scan.in_string:
                if text.startswith(CLOSE, self.pos):
                    self.end = self.pos
                    first = text.find(CLOSE)  # an earlier one in a string of no JSON (quotes
                    if first < self.end and not _json_or_its_beginning(text[: self.end]):
                        self.end = first  # that do not pair) ended it (``fallback``)
                    break
                if CLOSE.startswith(text[self.pos :]):  # the tag may be coming: wait
                    break
            if not self._scan.escaped:  # a run of characters that leave the scan as it is
                run = (_IN_STRING if self._scan.in_string else _OUTSIDE).match(text, self.pos)
                if run.end() > self.pos:
                    self.pos = run.end()
                    continue
            self._scan.step(text[self.pos])
            self.pos += 1
        return self.end

    def read(self, piece: str) -> int | None:
        """``feed``, then ``fallback``: where the call ends as ``parse_tool_calls`` reads the
        text so far, a piece at a time. Once the body holds a tag in a string, each piece is
        read as JSON with the body before it (``fallback``), unless it only goes on with the
        string the body ended in: then the body stays JSON's beginning. That read is of the
        whole body, O(body) a piece: on a long call holding the tag in a string, most pieces
        (any but those) cost it (721 us a step at the end of a 31k-character call, the tag in
        an early string, then numbers)."""
        seen = len(self.text)
        end = self.feed(piece)
        if end is not None:
            return end
        if not self._tagged:
            self._tagged = CLOSE in self.text[max(0, seen - len(CLOSE) + 1) :]
            if not self._tagged:
                return None
        elif self._in_string and _STRING_TEXT.fullmatch(piece):
            return None
        end = self.fallback()
        # (an escape is at most 6 characters: none was cut short; the blanks that end the body
        # were not read: a line break is no string's)
        self._in_string = (self._scan.in_string and "\\" not in self.text[-6:]
                           and not self.text[-1].isspace())
        return end

    def fallback(self) -> int | None:
        """Where the body's first ``</tool_call>`` starts, string or not, if the body so far is
        no JSON nor the beginning of one: the end of a call written without a grammar whose
        quotes do not pair (``"it"s"``), which never closed otherwise. A body that is JSON, or
        its beginning, was cut before its tag, which one of its strings may hold (the tools'
        grammar lets a string hold any text)."""
        at = self.text.find(CLOSE)
        return at if at >= 0 and not _json_or_its_beginning(self.text) else None

    def copy(self) -> CallEnd:
        """A twin to feed text that may still change, this one left as it is."""
        twin, scan = CallEnd.__new__(CallEnd), JsonScan.__new__(JsonScan)
        twin.__dict__.update(self.__dict__)
        scan.__dict__.update(self._scan.__dict__)
        twin._scan = scan
        return twin


# text that goes on with a JSON string and leaves it open: no quote nor control character, whole
# escapes
_STRING_TEXT = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')

# what a value cut short leaves where JSON's reader stops: a number, true, false or null begun
_BEGUN_VALUE = re.compile(r"-?[0-9]*(\.[0-9]*)?([eE][-+]?[0-9]*)?|t(r(ue?)?)?|f(a(l(se?)?)?)?"
                          r"|n(u(ll?)?)?")


def _json_or_its_beginning(text: str) -> bool:
    """Whether ``text`` is a JSON value or the beginning of one (the rest cut off)."""
    text = text.strip()
    try:
        loads_strict(text)
    except json.JSONDecodeError as err:
        if err.msg.startswith("Unterminated string"):
            return True  # everything before the string read, and the string to the end
        if err.msg.startswith("Invalid \\u"):  # json: "Invalid \\u... escape": a last escape, cut
            return re.fullmatch(r"u[0-9a-fA-F]{0,4}", text[err.pos:]) is not None
        if err.msg == "Extra data":  # a whole value, then its closing tag begun (cut there)
            return CLOSE.startswith(text[err.pos:])
        return _BEGUN_VALUE.fullmatch(text[err.pos:]) is not None
    except (ValueError, RecursionError):  # NaN, digits past Python's limit, deep nesting: not
        return True  # about where the call ends
    return True


def _blocks(text: str, pos: int = 0) -> list[tuple[int, int, int | None]]:
    """Each ``<tool_call>`` block of ``text`` (from ``pos``): where its tag starts, where its body
    starts, and where its body ends (None for a call never closed, which runs to the end)."""
    blocks: list[tuple[int, int, int | None]] = []
    while (at := text.find(OPEN, pos)) >= 0:
        start = at + len(OPEN)
        closer = CallEnd()
        end = closer.feed(text[start:])
        if end is None:
            end = closer.fallback()
        if end is None:
            blocks.append((at, start, None))
            break
        blocks.append((at, start, start + end))
        pos = start + end + len(CLOSE)
    return blocks


def stop_at(text: str, stops: tuple[str, ...] | list[str], tool_calls: bool = True
            ) -> int | None:
    """Where the first of ``stops`` begins in ``text``; None where none does. Where the text may
    hold ``tool_calls``, not inside one (after its ``<tool_call>``, to the end of its
    ``</tool_call>``): the call is the grammar's to finish, and cut there its arguments would
    not parse. One that begins at the tag's ``<`` (``<``, ``<tool_call>``) cuts the reply before
    the call, whichever tokens write the tag; one that begins later in the tag (``tool``) cuts
    where it begins if the text held it whole before the token that writes the tag's ``>``
    (the text ``<tool`` is no call yet), and is inside the call where that token completes it
    (always where the tag is one token; a stop that reaches the ``>``). Not at a character
    whose bytes are still coming (a trailing U+FFFD)."""
    text = text.rstrip("\ufffd")
    calls = ([(at, None if end is None else end + len(CLOSE)) for at, _, end in _blocks(text)]
             if tool_calls else [])
    first = None
    for stop in stops:
        at = text.find(stop)
        while at >= 0 and any(opened < at and (closed is None or at < closed)
                              for opened, closed in calls):
            at = text.find(stop, at + 1)
        if at >= 0 and (first is None or at < first):
            first = at
    return first


def unsettled_from(text: str) -> int | None:
    """Where ``text`` may still change its mind about stop strings: in a call not closed yet,
    its body's first ``</tool_call>``. Its body is JSON or the beginning of one so far, so the
    call runs on past that tag (a string holds it); if the body turns out to be no JSON, the
    call ends there after all (``CallEnd.fallback``), and a stop string written after it is no
    longer inside the call. None where nothing is pending."""
    blocks = _blocks(text)
    if not blocks or blocks[-1][2] is not None:
        return None
    start = blocks[-1][1]
    at = text.find(CLOSE, start)
    return None if at < 0 else at


class CallBlocks:
    """``_blocks`` of a text that grows (a reply decoded a step at a time), not read again from
    its start at each step: the blocks that their tag closed (``CallEnd.feed``) in the text's
    stable beginning (what every later text begins with) are kept, and the call open there is
    fed only what came since. What may still change (a body that may turn out no JSON and end
    at its first tag, ``CallEnd.fallback``; what follows such a call; the text not stable yet)
    is read again each time (``tail``)."""

    def __init__(self) -> None:
        self.closed: list[tuple[int, int]] = []  # kept: where the tag starts, its block ends
        self.pos = 0  # where the next ``<tool_call>`` is looked for
        self.call: CallEnd | None = None  # the call open in the stable text
        self.at = self.start = 0  # ... where its tag and its body start
        self.fed = 0  # ... ``text[start:fed]`` fed to it

    @property
    def frontier(self) -> int:
        """Where the blocks not kept may begin."""
        return self.at if self.call is not None else self.pos

    def advance(self, text: str, stable: int) -> None:
        """Read ``text[:stable]``, which every later text begins with."""
        while True:
            if self.call is None:
                at = text.find(OPEN, self.pos, stable)
                if at < 0:  # none begins before: one may straddle ``stable``
                    self.pos = max(self.pos, stable - len(OPEN) + 1)
                    return
                self.call, self.at, self.start = CallEnd(), at, at + len(OPEN)
                self.fed = self.start
            if stable > self.fed:
                self.call.feed(text[self.fed : stable])
                self.fed = stable
            if self.call.end is None:
                return
            self.pos = self.start + self.call.end + len(CLOSE)
            self.closed.append((self.at, self.pos))
            self.call = None

    def tail(self, text: str) -> list[tuple[int, int, int | None]]:
        """``_blocks(text)`` less the blocks kept; ``text`` begins with the stable text read."""
        if self.call is None:
            return _blocks(text, self.pos)
        call = self.call
        if len(text) > self.fed:
            call = call.copy()
            call.feed(text[self.fed :])
        end = call.end if call.end is not None else call.fallback()
        if end is None:
            return [(self.at, self.start, None)]
        return [(self.at, self.start, self.start + end),
                *_blocks(text, self.start + end + len(CLOSE))]

    def in_kept(self, at: int) -> bool:
        """Whether ``at`` is inside a kept block (past its tag's ``<``)."""
        i = bisect.bisect_left(self.closed, (at, -math.inf)) - 1
        return i >= 0 and at < self.closed[i][1]


class StopFinder:
    """``stop_at`` of a text that grows a step at a time (a reply's settled text), reading only
    what each step added: a stop string that ended in the text read before was outside every
    call then (the request stopped) or inside one; those inside a call still open are kept, and
    looked at again where that call turns out to end before them (``CallEnd.fallback``)."""

    def __init__(self, stops: tuple[str, ...] | list[str], tool_calls: bool = True) -> None:
        self.stops = tuple(stops)
        self.calls = CallBlocks() if tool_calls else None
        self.seen = 0  # the stop strings that end in ``text[:seen]`` are found
        self.inside: list[int] = []  # ... where those in the blocks not kept begin, in order

    def find(self, text: str, stable: int) -> int | None:
        """``stop_at(text, stops, tool_calls)``, for a ``text`` that ends in no U+FFFD and begins
        with the last one's ``text[:stable]``; every later text begins with this one's."""
        found = []  # (start, end) of the stop strings that end after the text read
        for stop in self.stops:
            at = text.find(stop, max(0, self.seen - len(stop) + 1))
            while at >= 0:
                found.append((at, at + len(stop)))
                at = text.find(stop, at + 1)
        if self.calls is None:
            return min((at for at, _ in found), default=None)
        # those kept that a block kept now holds are in it for good (they end before its tag)
        self.calls.advance(text, stable)
        frontier = self.calls.frontier
        del self.inside[: bisect.bisect_left(self.inside, frontier)]
        first = self._first_outside(found, self.calls.tail(text))
        if first is not None:
            return first
        for at, end in found:
            if at >= frontier and end <= stable:
                bisect.insort(self.inside, at)
        self.seen = stable
        return None

    def _first_outside(self, found: list[tuple[int, int]],
                       tail: list[tuple[int, int, int | None]]) -> int | None:
        calls = [(at, None if end is None else end + len(CLOSE)) for at, _, end in tail]
        first = None
        for at, _ in found:
            if first is not None and at >= first or self.calls.in_kept(at):
                continue
            if not any(opened < at and (closed is None or at < closed)
                       for opened, closed in calls):
                first = at
        if not self.inside or not calls or calls[0][1] is None:
            return first
        # those kept are all past the first block's tag: outside where a block ends before them
        for (_, closed), (opened, _) in zip(calls, [*calls[1:], (None, None)]):
            if closed is None:
                break
            i = bisect.bisect_left(self.inside, closed)
            if i < len(self.inside) and (opened is None or self.inside[i] <= opened):
                return self.inside[i] if first is None else min(first, self.inside[i])
        return first


def parse_tool_calls(text: str) -> tuple[list[ParsedToolCall], list[MalformedToolCall]]:
    """Every ``<tool_call>`` block of ``text``: the well-formed calls and the malformed ones (a
    call never closed, as a reply cut by max tokens leaves it, is malformed)."""
    calls, bad = [], []
    for _, start, end in _blocks(text):
        if end is None:
            bad.append(MalformedToolCall(text[start:].strip(), f"not closed with {CLOSE}"))
            continue
        call = parse_body(text[start:end])
        (calls if isinstance(call, ParsedToolCall) else bad).append(call)
    return calls, bad


def repeats_a_key(text: str) -> bool:
    """Whether a closed call of the reply ``text`` is JSON that gives a key twice in one object,
    at any depth (JSON takes the last value, a stream shows the first)."""
    for _, start, end in _blocks(text):
        if end is not None:
            try:
                loads_strict(text[start:end], unique_keys=True)
            except RepeatedKey:
                return True
            except (ValueError, RecursionError):  # not JSON, not a repeat
                pass
    return False


def parse_body(body: str) -> ParsedToolCall | MalformedToolCall:
    """One call's body (the text between its tags)."""
    body = body.strip()
    obj, error = load_body(body)
    if error is not None:
        return MalformedToolCall(body, error)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedToolCall(body, 'expected an object with a string "name"')
    twice = _repeated_keys(body) & {"name", "arguments"}
    if twice:  # JSON takes the last, a stream shows the first: no call to trust
        return MalformedToolCall(body, f'"{min(twice)}" is given twice')
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return MalformedToolCall(body, '"arguments" must be an object')
    return ParsedToolCall(obj["name"], args)


def loads_strict(text: str, *, unique_keys: bool = False) -> Any:
    """``json.loads`` refusing NaN and Infinity (``ValueError``), which Python reads and JSON
    has not: a model decoding without the grammar may write them; and a number past a float's
    range (``1e999``, which JSON's grammar allows), which Python reads as infinity.
    ``unique_keys``: an object giving a key twice is refused too (Python keeps the last, and a
    file's first value of it would be lost without a word)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite,
                      object_pairs_hook=unique_object if unique_keys else None)


class RepeatedKey(ValueError):
    """A JSON object gives a key twice."""


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` that refuses a key given twice (``RepeatedKey``)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise RepeatedKey(f"the key {key!r} is given twice in one object")
        obj[key] = value
    return obj



def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} is past the range of a float")
    return value


def load_body(body: str) -> tuple[Any, str | None]:
    """A call's body as JSON, or why it is not: whatever the model wrote, never an exception
    (an integer of more digits than Python converts, nesting deeper than it recurses, NaN)."""
    try:
        return loads_strict(body), None
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err.msg}"
    except (ValueError, RecursionError) as err:
        return None, f"invalid JSON: {str(err) or type(err).__name__}"


def _repeated_keys(body: str) -> set[str]:
    """The keys the JSON object ``body`` (valid JSON) gives more than once at its top level."""
    top: list[tuple[str, Any]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        top[:] = items  # the outermost object's pairs come last
        return dict(items)

    json.loads(body, object_pairs_hook=pairs)
    keys = [k for k, _ in top]
    return {k for k in keys if keys.count(k) > 1}


def text_outside_calls(text: str) -> str:
    """The text of a reply with its tool-call blocks removed (a call never closed included)."""
    pieces, pos = [], 0
    for at, _, end in _blocks(text):
        pieces.append(text[pos:at])
        pos = len(text) if end is None else end + len(CLOSE)
    pieces.append(text[pos:])
    return "".join(pieces).strip()
