"""Errors that agentflash reports to its user rather than as tracebacks."""


class UserError(Exception):
    """Bad input from the user (a path, a file, a flag, a request): the message names it."""
