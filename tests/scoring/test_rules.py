"""Rule rewards against hand-written expected scores (verl's semantics), and the dispatch by data_source."""

from __future__ import annotations

import threading

import pytest

from mcore_rl.config import RewardConfig
from mcore_rl.scoring import ScoreDispatch, ScorerError, default_scorer_name, load_user_scorer
from mcore_rl.scoring.rules import exact_match_score, format_score, gsm8k_score, last_boxed, math_score

# (response, ground truth, method, expected score); format_score 0 unless the case says otherwise.
GSM8K = [
    ("so she has 72 left.\n#### 72", "72", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),  # commas stripped
    ("#### -3", "-3", "strict", 1.0),
    ("#### 5 first, then #### 7", "7", "strict", 1.0),  # the last marked answer counts
    ("#### 72.0", "72", "strict", 0.0),  # compared as strings, as verl does
    ("#### $5", "5", "strict", 0.0),  # '$' is not part of a strict match
    ("the answer is 72", "72", "strict", 0.0),  # no '####'
    ("the answer is 72", "72", "flexible", 1.0),
    ("3 apples, then 4, so 12", "12", "flexible", 1.0),  # the last number
    ("3 apples so 12.", "12", "flexible", 0.0),  # '12.' is the last number token
    ("#### 72" + " filler" * 60, "72", "strict", 0.0),  # only the last 300 characters are read
    ("no digits at all", "5", "flexible", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "method", "expected"), GSM8K)
def test_gsm8k(response: str, truth: str, method: str, expected: float) -> None:
    assert gsm8k_score(response, truth, method) == expected


def test_gsm8k_wrong_but_formatted_gets_the_format_score() -> None:
    assert gsm8k_score("#### 71", "72", "strict", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "72", "strict", format_score=0.1) == 0.0


MATH = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # symbolic equality, not string normalisation
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("first \\boxed{1}, finally \\boxed{2}", "2", 1.0),  # the last boxed answer counts
    ("first \\boxed{2}, finally \\boxed{1}", "2", 0.0),
    ("\\fbox{5}", "5", 1.0),
    ("\\boxed 5", "5", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),  # an approximation is not the number
    ("\\boxed{2}", "3", 0.0),
    ("the answer is 1/2", "1/2", 0.0),  # no boxed answer
    ("\\boxed{\\frac{1}{2}", "1/2", 0.0),  # unbalanced braces: no answer
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH)
def test_math(response: str, truth: str, expected: float) -> None:
    assert math_score(response, truth) == expected


def test_last_boxed_keeps_nested_braces() -> None:
    assert last_boxed("x \\boxed{\\frac{a}{b^{2}}} y") == "\\frac{a}{b^{2}}"


def test_math_verify_runs_off_the_main_thread() -> None:
    """math-verify's signal timeout only works in a main thread; elsewhere ours is off and it still works."""
    scores: list[float] = []
    thread = threading.Thread(target=lambda: scores.append(math_score("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join()
    assert scores == [1.0]


def test_exact_match_and_format() -> None:
    assert exact_match_score(" 579\n", "579") == 1.0
    assert exact_match_score("5790", "579") == 0.0
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    assert format_score("<think>a\nb</think> <answer>4</answer>", pattern) == 1.0
    assert format_score("<answer>4</answer>", pattern) == 0.0


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("openai/gsm8k", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("aime2024", "math_dapo"),
        ("math_dapo", "math_dapo"),
        ("math", "math_dapo"),  # verl's default_compute_score, as of 2026
        ("mcore_rl/arithmetic", "exact_match"),
        ("my/unknown", None),
    ],
)
def test_default_dispatch_by_data_source(source: str, name: str | None) -> None:
    assert default_scorer_name(source) == name


def test_dispatch_uses_sources_custom_and_recipe_options() -> None:
    flexible = ScoreDispatch(RewardConfig(gsm8k_method="flexible"))
    assert flexible("openai/gsm8k", "it is 72", "72", {}) == 1.0
    assert ScoreDispatch(RewardConfig())("openai/gsm8k", "it is 72", "72", {}) == 0.0
    routed = ScoreDispatch(RewardConfig(sources={"my/src": "tests.scoring.user_scorers:with_metrics"}))
    assert routed("my/src", "a", "a", {})["score"] == 1.0
    custom = ScoreDispatch(RewardConfig(custom_function="tests.scoring.user_scorers:with_metrics"))
    assert custom("openai/gsm8k", "x", "y", {})["score"] == 0.0  # the custom function scores every row
    fmt = ScoreDispatch(RewardConfig(sources={"fmt": "format"}))
    assert fmt("fmt", "<a>", None, {"format_pattern": "<a>"}) == 1.0
    with pytest.raises(ScorerError, match=r"extra_info\.format_pattern"):
        fmt("fmt", "<a>", None, {})
    with pytest.raises(ScorerError, match=r"no scorer for data_source 'my/unknown': add reward\.sources"):
        ScoreDispatch(RewardConfig())("my/unknown", "a", "a", {})


def test_user_scorer_from_a_file(tmp_path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.25\n"
    )
    assert load_user_scorer(f"{path}:compute_score")("s", "a", "b", {}) == 0.25


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_colon", "must be 'module:function'"),
        ("tests.scoring.absent_module:f", "cannot import tests.scoring.absent_module"),
        ("tests.scoring.user_scorers:absent", "has no function 'absent'"),
        ("/nowhere/reward.py:f", "file /nowhere/reward.py does not exist"),
        ("gsm8kk", "must be 'module:function'"),
    ],
)
def test_bad_scorer_specs_are_named(spec: str, expected: str) -> None:
    with pytest.raises(ScorerError, match=expected) as info:
        ScoreDispatch(RewardConfig(sources={"s": spec}))
    assert spec in str(info.value)


def test_math_verify_leaves_the_callers_timer_armed() -> None:
    """An in-process scorer bounds each answer with ``ITIMER_REAL`` (``reward.timeout_s``); math-verify's own
    ``signal.alarm`` is the same timer, and arming then cancelling it cancelled the caller's."""
    import signal

    from mcore_rl.scoring.rules import math_equivalent

    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert math_equivalent("1/2", "\\frac12")
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 90.0  # still the caller's, still running
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert math_equivalent("1/2", "\\frac12")  # without a caller's timer: math-verify's own, as before
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("Let me think... so the total is 34.\nAnswer: 34", 1.0),
        ("...\nanswer: $\\frac{1}{2}$.", 1.0),  # the line's case, $ and period as verl reads them
        ("Answer: 12\nwait, no.\nAnswer: 35", -1.0),  # the last line counts
        ("\\boxed{34}", -1.0),  # no Answer: line (DAPO's prompts ask for one)
    ],
)
def test_dapo_and_aime_answers_are_read_from_the_last_answer_line(response: str, score: float) -> None:
    from mcore_rl.scoring.config import RewardConfig
    from mcore_rl.scoring.registry import builtin_scorer

    truth = "\\frac{1}{2}" if "frac" in response else "34"
    assert builtin_scorer("math_dapo", RewardConfig())("aime_2024", response, truth, {}) == score
