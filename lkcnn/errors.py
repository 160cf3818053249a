"""The base of every error a user can cause (a config value, a file, a setting): its message says what to change.

It lives at the bottom of the package so that ops, layers and deploy code can raise it; the training app prints such
errors as one line, without a traceback (lkcnn.training.errors).
"""


class UserError(Exception):
    """Base of the errors whose message says what to change; nothing below it is a bug."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none): another library's error, quoted
    in one of lkcnn's one-line messages."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def one_line(message: object) -> str:
    """A message of several lines joined into one (Hydra's and OmegaConf's errors span lines)."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())
