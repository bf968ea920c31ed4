"""The demo's printout, what a first-time user judges the product by: a header that says what the numbers are, the
numbers in one format, the model's own completion (not the prompt it copied) and a mark where an answer is cut.
The inputs are answers of the kinds the demo model gives (tests/e2e/test_demo.py runs the demo itself)."""

from __future__ import annotations

import re

from elastic_vllm.demo import CODE, COLUMNS, CUT, DOC, WIDTH, format_row, header, shown_answer

# the demo model's kind of code answer: a fence, the given function again, then its own lines
CODE_ANSWER = (
    "```python\n" + CODE + "        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            out.append(total / window)\n    return out\n```"
)
SUMMARY = (
    "The lighthouse on the northern cape, built in 1871 after three ships were lost, became a museum in 1932 and "
    "is kept by volunteers who restore its log books."
)


def test_header_says_what_omega_msr_and_the_marks_are():
    text = header("SmolLM2-135M-Instruct", 30, 3, "CPU", "router_weights/smollm2-135m-instruct", "auto")
    assert "Omega_MSR = share of the request's KV heads (30 layers x 3 KV heads) the router sent to SA" in text
    assert "0.000 = every head full attention (FA, dense), 1.000 = every head SA" in text
    assert f"{CUT} = cut there" in text and "[repeats N prompt lines]" in text
    assert text.splitlines()[-2] == COLUMNS and set(text.splitlines()[-1]) == {"-"}
    assert "SmolLM2-135M-Instruct on the CPU" in text and "force: auto" in text


def test_code_answer_shows_the_completion_not_the_copied_prompt():
    prompt = "Complete this Python function:\n\n" + CODE
    got = shown_answer(CODE_ANSWER, prompt, stopped_by_length=False, width=200)
    assert got == (
        "[repeats 8 prompt lines] if i >= window: total -= values[i - window] if i >= window - 1: "
        "out.append(total / window) return out"
    ), got  # the model ended it: no mark
    line = shown_answer(CODE_ANSWER, prompt, stopped_by_length=False)  # the demo's width
    assert WIDTH - 2 <= len(line) <= WIDTH and line.endswith(CUT) and got.startswith(line[:-1]), line


def test_answers_are_cut_with_a_mark_at_the_width_and_at_max_tokens():
    prompt = "Summarize in one sentence:\n\n" + DOC * 6
    long = shown_answer(SUMMARY, prompt, stopped_by_length=False)
    assert WIDTH - 2 <= len(long) <= WIDTH and long.endswith(CUT) and SUMMARY.startswith(long[:-1].rstrip()), long
    short = shown_answer("The lighthouse of 1871", prompt, stopped_by_length=True)  # max_tokens ended it
    assert short == "The lighthouse of 1871" + CUT
    assert shown_answer(" 7462901.", "...", stopped_by_length=False) == "7462901."
    assert shown_answer("", "x", stopped_by_length=True) == "(empty)" + CUT
    assert shown_answer(CODE, CODE, stopped_by_length=True) == "[repeats 8 prompt lines] (nothing else)" + CUT


def test_rows_line_up_under_the_columns_with_one_number_format():
    rows = [
        {"request": "needle (sensitive)", "prompt_tokens": 1512, "omega_msr": 0.2, "seconds": 3.14,
         "answer": "7462901.", "correct": True},
        {"request": "summary (robust)", "prompt_tokens": 611, "omega_msr": 0.611, "seconds": 12.0, "answer": "x"},
        {"request": "code (robust)", "prompt_tokens": 112, "omega_msr": None, "seconds": 4.0, "answer": "y",
         "correct": False},
    ]  # fmt: skip
    lines = [format_row(r) for r in rows]
    assert lines[0] == "needle (sensitive)    1512 tok      0.200   3.1 s  [correct] 7462901."
    assert lines[1] == "summary (robust)       611 tok      0.611  12.0 s  x"
    assert lines[2] == "code (robust)          112 tok          -   4.0 s  [WRONG] y"  # no routing recorded: "-"
    start = COLUMNS.index("answer")
    assert all(line[start - 2 : start] == "  " and line[start] != " " for line in lines)
    for line in lines:  # Omega_MSR right-aligned under its column, three decimals
        assert re.fullmatch(r" *(\d\.\d{3}|-)", line[COLUMNS.index("prompt") + 11 : COLUMNS.index("Omega_MSR") + 9])
