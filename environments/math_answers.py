"""Reading and checking the turns of ``math_chat``: the answer a response gives, whether it is right, the verdict.

Right or wrong is decided by math-verify (Hugging Face's answer verifier, the grader of open-r1 and lighteval):
``parse`` reads the answer (a bare number, ``The answer is 17``, ``\\boxed{17}``, ``17.``, LaTeX) and ``verify``
compares it with the right one symbolically, so ``0.5`` and ``\\frac{1}{2}`` agree.

Two guards of ours around it:

- math-verify's own timeouts use ``signal.alarm``, which works only in a process's main thread; the pipeline calls
  plugins from threads, where math-verify then fails quietly and grades every answer wrong. So they are off, and
  the work is bounded here instead: only the first line of a response is read (at most ``MAX_ANSWER_CHARS``), and
  an answer with a huge power (``9^9^9`` makes sympy compute for minutes) is wrong without being compared. The
  action pool's per-action timeout is the backstop in training.
- Where the right answer is a number, the answer must be a number too, not an expression left to compute:
  math-verify evaluates ``17 + 5`` to 22, so a solver echoing the question would be paid for it.

math-verify and sympy are imported on first use: entry points load every plugin module whenever the registry is
read (the CLI, the config check), and the two take seconds to import.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

MAX_ANSWER_CHARS = 100
"""Longest answer text read from a response (its first line); longer text is cut."""

MAX_EXPONENT = 100
"""An answer with a power whose exponent is not a number of at most this size is not compared (see above)."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_FIRST_WORD = re.compile(r"[\W_]*([a-z]+)")


def answer_text(response: str) -> str:
    """The part of a response taken as its answer: its first non-empty line, stripped, at most MAX_ANSWER_CHARS."""
    for line in response.splitlines():
        if line.strip():
            return line.strip()[:MAX_ANSWER_CHARS]
    return ""


def normalized_answer(response: str) -> str:
    """A response's answer for counting equal answers: first line, lower case, spaces collapsed, no final period."""
    return " ".join(answer_text(response).lower().split()).rstrip(".").strip()


def verdict_of(response: str) -> str | None:
    """``yes`` or ``no`` when the response's first word is one of them (any case, punctuation or markdown around
    it: ``Yes.``, ``**No**``), else None."""
    first = _FIRST_WORD.match(answer_text(response).lower())
    return first.group(1) if first and first.group(1) in ("yes", "no") else None


def is_plain_number(answer: str) -> bool:
    """Whether a right answer is a plain number (``17``, ``-4``, ``2.5``, ``3/4``): math-verify grades those."""
    return _NUMBER.fullmatch(answer.strip()) is not None


def near_miss(answer: str, offset: int) -> str:
    """A plain-number answer moved by ``offset`` units (the solver's usual kind of mistake): ``17`` -> ``19``,
    ``2.5`` -> ``4.5``, ``3/4`` -> ``11/4``; ``offset`` must not be 0."""
    if not offset:
        raise ValueError("a near miss needs a non-zero offset")
    text = answer.strip()
    if not is_plain_number(text):
        raise ValueError(f"near_miss needs a plain number, got {answer!r}")
    if "/" in text:
        value = Fraction(text) + offset
        return f"{value.numerator}/{value.denominator}"
    if "." in text:
        decimals = len(text.split(".")[1])
        return f"{float(text) + offset:.{decimals}f}"
    return str(int(text) + offset)


def check_math(right_answer: str, response: str) -> bool:
    """Whether ``response`` (its first line) gives ``right_answer``, by math-verify, with the guards above.

    Raises:
        ValueError: math-verify cannot read ``right_answer`` (a task's answer, not the model's: a bug to see).
    """
    from math_verify import verify

    gold = _parse(right_answer)
    if not gold:
        raise ValueError(f"math-verify cannot read the right answer {right_answer!r}")
    given = _parse(answer_text(response))
    if not given or not _bounded(given[0]):
        return False
    if _is_literal_number(gold[0]) and not _is_literal_number(given[0]):
        return False
    return bool(verify(gold, given, timeout_seconds=None))


def stated_answer(response: str) -> str | None:
    """The answer a response states, as math-verify reads it (``28 + 6 = 34`` -> ``34``), or its first line where
    math-verify reads none (a word, a list); None for an empty response or an answer too costly to compare."""
    parsed = _parse(answer_text(response))
    if not parsed:
        return answer_text(response) or None
    if not _bounded(parsed[0]):
        return None
    # [value, the text it was read from], or only the text where math-verify matched LaTeX it could not read ($x^$)
    return parsed[-1] if isinstance(parsed[-1], str) else str(parsed[0])


def same_answer(first: str, second: str) -> bool:
    """Whether two responses state the same answer: math-verify's values when both parse (``34`` and ``28 + 6 =
    34.`` agree), else their normalised first lines; an empty response agrees with nothing."""
    from math_verify import verify

    ours, theirs = _parse(answer_text(first)), _parse(answer_text(second))
    if ours and theirs:
        return _bounded(ours[0]) and _bounded(theirs[0]) and bool(verify(ours, theirs, timeout_seconds=None))
    if ours or theirs:
        return False
    return bool(normalized_answer(first)) and normalized_answer(first) == normalized_answer(second)


@lru_cache(maxsize=4096)
def _parse(text: str) -> list:
    from math_verify import parse

    return parse(text, parsing_timeout=None) if text else []


def _is_literal_number(expression) -> bool:
    """A number as written: ``22``, ``-4``, ``2.5``, ``1/2`` (sympy keeps ``1/2`` as ``1 * 2**-1``), not ``17 + 5``."""
    import sympy

    if isinstance(expression, sympy.Number):
        return True
    if isinstance(expression, sympy.Pow):
        return isinstance(expression.base, sympy.Integer) and expression.exp == -1
    if isinstance(expression, sympy.Mul):
        return all(_is_literal_number(factor) and not isinstance(factor, sympy.Mul) for factor in expression.args)
    return False


def _bounded(expression) -> bool:
    """Whether comparing ``expression`` is cheap: every power's exponent is a symbol or a number <= MAX_EXPONENT."""
    import sympy

    if not isinstance(expression, sympy.Basic):
        return True  # math-verify also returns sets, intervals and strings; sympy bounds those by their elements
    for power in expression.atoms(sympy.Pow):
        exponent = power.exp
        if not (exponent.is_Symbol or (exponent.is_Number and abs(exponent) <= MAX_EXPONENT)):
            return False
    return True
