"""Errors that agentflash reports to its user rather than as tracebacks."""


from typing import Any


class UserError(Exception):
    """Bad input from the user (a path, a file, a flag, a request): the message names it."""


# what the checks of user input ask of a value (a bool is an int to Python, never to a user)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# the seeds a torch generator takes as they are (it refuses the others rather than fold them in)
SEED_TEXT = "an integer in [-2**63, 2**64 - 1]"


def is_seed(value: Any) -> bool:
    return is_int(value) and -(2**63) <= value < 2**64
