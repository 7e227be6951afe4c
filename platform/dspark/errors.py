"""Errors caused by the user's input or environment, reported as one line naming the culprit."""


class UserError(Exception):
    """Bad input or environment (a path, key, endpoint, file); the message names it."""
