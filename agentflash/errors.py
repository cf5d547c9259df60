"""Errors that agentflash reports to its user rather than as tracebacks."""


import numbers
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def described(err: BaseException) -> str:
    """``Type: message`` of an exception (its type alone without a message, or where its
    ``__str__`` itself fails: a user's exception class whose message is built wrongly); a
    group's, its first few exceptions' after its own (a tool's task group that failed twice)."""
    try:
        message = str(err)
    except Exception:  # noqa: BLE001
        message = ""
    if isinstance(err, BaseExceptionGroup):  # its own text counts them: the first few said
        leaves, more = _first_leaves(err)
        inner = "; ".join([*(described(e) for e in leaves), *([more] if more else [])])
        message = f"{message}: {inner}" if message else inner
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _first_leaves(group: BaseException, shown: int = 5, visits: int = 10_000
                  ) -> tuple[list[BaseException], str]:
    """The first ``shown`` exceptions inside ``group`` (nested groups walked, not recursed:
    hundreds deep, or one group shared many times over), and how many more ("and 3 more", ""
    for none; "and many more" past ``visits`` nodes)."""
    leaves: list[BaseException] = []
    more, seen, stack = 0, 0, list(reversed(group.exceptions))  # type: ignore[attr-defined]
    while stack:
        seen += 1
        if seen > visits:  # (one group shared many times over, or nested past belief)
            return leaves, "and many more" if leaves else f"nested past {visits:,} groups"
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(reversed(exc.exceptions))
        elif len(leaves) < shown:
            leaves.append(exc)
        else:
            more += 1
    return leaves, f"and {more} more" if more else ""


class UserError(Exception):
    """Bad input from the user (a path, a file, a flag, a request): the message names it."""


class ChatTemplateError(UserError):
    """A model's chat template that failed on the messages (its ``raise_exception``) or cannot
    be read; ``reason``, jinja's message, is what a server tells its client."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


def expand_user(path: Any) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded; as it is where there is no such
    user (``Path.expanduser`` raises): then it is named, as it is, where it is looked for."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def missing_file(path: Path) -> str:
    """Why ``path`` is not there, said as its user would say it: a stream the command was
    started without (``--messages /dev/stdin <&-``) is closed, not a file that does not exist."""
    stream = re.fullmatch(r"/dev/(stdin|stdout|stderr|fd/(\d+))|/proc/self/fd/(\d+)", str(path))
    if stream is None:
        return "does not exist"
    fd = int(stream.group(2) or stream.group(3) or ("stdin", "stdout", "stderr").index(
        stream.group(1)))
    return "cannot be read: " + ("standard input is closed" if fd == 0
                                 else f"file descriptor {fd} is not open")


def shown_url(url: str) -> str:
    """``url`` as messages show it (errors, traces, the model's tool results): without a user,
    password, query or fragment, where a key may be. Everything up to the last ``@`` goes (a
    password may hold a raw ``/``, ``?`` or ``#``: more hidden rather than any of it shown)."""
    scheme = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", url)
    head = scheme.group(0).lower() if scheme is not None else ""
    rest = re.sub(r"^.*@", "", url[len(head):], flags=re.S)
    return head + re.split(r"[?#]", rest)[0]


class UserErrors(UserError):
    """Several problems found at once (a workflow file's): each names its place."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems

    def __reduce__(self) -> tuple:  # copied or pickled: its list, not the joined message
        return type(self), (self.problems,), self.__dict__


# what the checks of user input ask of a value (a bool is an int to Python, never to a user)


# the least non-zero sampling temperature (0 is greedy): below it, logits over the temperature
# overflow float32 and sampling fails
MIN_TEMPERATURE = 1e-6


def is_temperature(value: Any) -> bool:
    return is_number(value) and (value == 0 or MIN_TEMPERATURE <= value <= 10.0)


TEMPERATURE_TEXT = f"0 (greedy) or a number from {MIN_TEMPERATURE:g} to 10"


def is_int(value: Any) -> bool:
    """An integer (a numpy one too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (a numpy one too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# the seeds a torch generator takes as they are (it refuses the others rather than fold them in)
SEED_TEXT = "an integer in [-2**63, 2**64 - 1]"


def is_seed(value: Any) -> bool:
    return is_int(value) and -(2**63) <= value < 2**64
