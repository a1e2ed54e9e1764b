"""Math answer equivalence: math-verify when installed, else numeric/normalised comparison.

``math_equal("0.5", "\\frac{1}{2}")`` is True either way. math-verify (an optional
dependency) also proves symbolic equivalence; its timeout uses ``signal.alarm``, which only
works in the main thread, so other threads run it without a timeout and the input length
cap (``MAX_MATH_CHARS``) is what bounds the time there.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from fractions import Fraction

MAX_MATH_CHARS = 512

_FRAC_RE = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_BOXED_RE = re.compile(r"\\boxed\{(.*)\}")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]{1,3})?")


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def normalize(text: str) -> str:
    """Strips $ delimiters, \\boxed{}, \\left/\\right, spaces, and a trailing period."""
    t = text.strip().strip("$").strip()
    m = _BOXED_RE.fullmatch(t)
    if m:
        t = m.group(1)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", " "):
        t = t.replace(token, "")
    return t.rstrip(".").lower()


def to_number(text: str) -> Fraction | float | None:
    """Parses integers, decimals, ``a/b``, ``\\frac{a}{b}`` and percentages."""
    t = normalize(text).replace(",", "")
    m = _FRAC_RE.fullmatch(t)
    if m:
        t = f"{m.group(1)}/{m.group(2)}"
    percent = t.endswith("\\%") or t.endswith("%")
    t = t.removesuffix("\\%").removesuffix("%")
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            if not (_NUMBER_RE.fullmatch(num) and _NUMBER_RE.fullmatch(den)):
                return None
            value = Fraction(num) / Fraction(den)
        elif _NUMBER_RE.fullmatch(t):
            value = Fraction(t)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def fallback_equal(pred: str, gold: str, rel_tol: float = 1e-6) -> bool:
    a, b = to_number(pred), to_number(gold)
    if a is not None and b is not None:
        if a == b:
            return True
        try:
            return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)
        except OverflowError:
            return False
    return normalize(pred) == normalize(gold) and normalize(gold) != ""


def _for_math_verify(text: str) -> str:
    # math-verify extracts expressions from delimited LaTeX; bare "x+1" parses as nothing.
    t = text.strip()
    return t if "$" in t or "\\boxed" in t else f"${t}$"


def math_equal(pred: str, gold: str) -> bool:
    """True when ``pred`` and ``gold`` denote the same mathematical answer."""
    if len(pred) > MAX_MATH_CHARS or not pred.strip():
        return False
    if to_number(pred) is not None and to_number(gold) is not None:
        return fallback_equal(pred, gold)  # numbers: exact rational comparison is final
    if fallback_equal(pred, gold):
        return True
    mv = _math_verify()
    if mv is None:
        return False
    in_main = threading.current_thread() is threading.main_thread()
    seconds = 5 if in_main else None
    try:
        gold_parsed = mv.parse(_for_math_verify(gold), parsing_timeout=seconds)
        pred_parsed = mv.parse(_for_math_verify(pred), parsing_timeout=seconds)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=seconds))
    except Exception:  # noqa: BLE001 - an unparseable answer is simply not equal
        return False
