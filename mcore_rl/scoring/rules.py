"""Rule rewards with verl's semantics (``verl/utils/reward_score``): GSM8K, MATH-style boxed answers, exact
match and format checks. Pure functions of strings; no torch, so scorer workers start fast.

* GSM8K: only the last 300 characters are read. ``strict`` takes the last ``#### number`` (commas and
  ``$`` stripped); ``flexible`` takes the last number anywhere in them. No answer scores 0, the right one
  ``score``, a wrong one ``format_score``.
* MATH: the last ``\\boxed{...}`` (or ``\\fbox``) of the response, compared with the ground truth for
  mathematical equivalence by math-verify (``\\frac{1}{2}`` equals ``0.5``), not by string normalisation.
  No boxed answer scores 0, a wrong one ``format_score``.
* DAPO / AIME (verl's ``math_dapo``): the last ``Answer: ...`` line of the last 300 characters, compared with
  the ground truth by math-verify as MATH's boxed answer is (verl normalises strings, Minerva's way); right
  scores 1, wrong or no such line -1.
* Exact match: the stripped response equals the stripped ground truth.
* Format: the response matches a regular expression (e.g. ``<think>.*</think>\\s*<answer>.*</answer>``).
"""

from __future__ import annotations

import re
import signal
import threading

GSM8K_TAIL_CHARS = 300
"""verl reads only this many trailing characters of a GSM8K response (long rambles cost nothing)."""
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response, or None."""
    tail = solution_str[-GSM8K_TAIL_CHARS:]
    if method == "strict":
        matches = _GSM8K_STRICT.findall(tail)
    elif method == "flexible":
        matches = [m for m in _NUMBER.findall(tail) if m not in ("", ".")]
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    if not matches:
        return None
    return str(matches[-1]).replace(",", "").replace("$", "")


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of ``\\boxed x``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed ") and "{" not in rest.split(" ", 1)[1][:1]:
        return rest.split(" ", 1)[1].split("$")[0].strip() or None
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[open_at + 1 : i]
    return None  # unbalanced: no answer


def math_equivalent(answer: str, ground_truth: str) -> bool:
    """math-verify's equivalence of two LaTeX / plain answers.

    math-verify bounds its own work with ``signal.alarm``, which only works in a process's main thread;
    elsewhere its timeout is off and the caller's worker timeout (:mod:`mcore_rl.scoring.pool`) bounds it.
    Under the caller's own timer (``reward.timeout_s`` of an in-process scorer: ``ITIMER_REAL``, the timer
    ``alarm`` sets too) its timers are off as well: arming and then cancelling its own would cancel the
    caller's, and the answer would run unbounded by ``reward.timeout_s``.
    """
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    timed_by_caller = in_main and signal.getitimer(signal.ITIMER_REAL)[0] > 0
    limit = 5 if in_main and not timed_by_caller else None
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=limit)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if not gold or not pred:
        return answer.strip() == str(ground_truth).strip()
    return bool(verify(gold, pred, timeout_seconds=limit))


def math_score(solution_str: str, ground_truth: str, format_score: float = 0.0) -> float:
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if math_equivalent(answer, str(ground_truth)) else format_score


DAPO_TAIL_CHARS = 300
"""verl's ``math_dapo`` reads this many trailing characters of a response."""
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_answer(solution_str: str) -> str | None:
    """The last ``Answer: ...`` line's answer (its ``$`` and a closing period dropped), or None."""
    found = _DAPO_ANSWER.findall(solution_str[-DAPO_TAIL_CHARS:])
    if not found:
        return None
    answer = found[-1].strip().strip("$").strip().rstrip(".").strip()
    return answer or None


def dapo_score(solution_str: str, ground_truth: str) -> float:
    answer = dapo_answer(solution_str)
    if answer is None:
        return -1.0
    return 1.0 if math_equivalent(answer, str(ground_truth)) else -1.0


def exact_match_score(solution_str: str, ground_truth: str) -> float:
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def format_score(solution_str: str, pattern: str) -> float:
    """1.0 when the whole (stripped) response matches ``pattern`` (``re.DOTALL``), else 0.0."""
    return 1.0 if re.fullmatch(pattern, solution_str.strip(), flags=re.DOTALL) else 0.0
