"""The config's errors: ``ConfigError`` (what users see, one line) and ``FieldError``
(raised inside the schema's validators to name a field; ``loader`` turns it into a
``ConfigError`` with the dotted key and the input that set it)."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """A bad config input, as one line: ``<dotted.key>: <what is wrong> (<where>)``.

    ``where`` is a file path, ``--set KEY=VALUE``, or ``defaults``. When one input has
    several problems, the first is in ``key``/``problem``/``where`` and the others follow
    on the same line, joined by ``"; "`` in the same form.
    """

    def __init__(self, key: str, problem: str, where: str, more: Sequence[str] = ()):
        self.key, self.problem, self.where = key, one_line(problem), one_line(where)
        self.more = tuple(more)
        line = "; ".join([f"{key}: {self.problem} ({self.where})", *self.more])
        super().__init__(one_line(line))

    def __reduce__(self):  # picklable across spawned ranks
        return type(self), (self.key, self.problem, self.where, self.more)


class FieldError(ValueError):
    """Raised inside the schema's validators to name the offending field (relative dotted
    path); ``loader`` reports it as a ``ConfigError``."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())
