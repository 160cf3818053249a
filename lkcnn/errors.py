"""The base of every error a user can cause (a config value, a file, a setting): its message says what to change.

It lives at the bottom of the package so that ops, layers and deploy code can raise it; the training app prints such
errors as one line, without a traceback (lkcnn.training.errors).
"""


class UserError(Exception):
    """Base of the errors whose message says what to change; nothing below it is a bug."""
