"""Thinking apart from the answer (tools/reasoning.py): the split is the same however the
reply is cut into deltas, and only a block at the reply's start is thinking."""

import pytest

from pyllama_paged.testing.deltas import delta_cuts
from pyllama_paged.tools.reasoning import (ReasoningSplitter, prompt_opens_thinking, split_reasoning,
                                           template_thinks)

CASES = [
    # (reply, prompt opened the block, thinking, answer)
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "The user greets me.", "Hello!"),
    ("  <think>a < b </thi</think>yes", False, "a < b </thi", "yes"),
    ("Hello <think>not thinking</think>", False, "", "Hello <think>not thinking</think>"),
    ("Plain answer.", False, "", "Plain answer."),
    ("<think>\n\n</think>\n\nAnswer", False, "", "Answer"),
    ("weighing it\n</think>\n\nThe answer is 4.", True, "weighing it", "The answer is 4."),
    ("<think>cut off by the token limit ", False, "cut off by the token limit", ""),
    ("<thin", False, "", "<thin"),
    ("<think>x</think>", False, "x", ""),
    ("<think>one</think>two</think>three", False, "one", "two</think>three"),
]


@pytest.mark.parametrize("reply,opened,thinking,answer", CASES)
def test_whole_reply(reply, opened, thinking, answer):
    assert split_reasoning(reply, opened) == (thinking, answer)


@pytest.mark.parametrize("reply,opened,thinking,answer", CASES)
def test_every_cut_into_deltas_gives_the_same_split(reply, opened, thinking, answer):
    for points in delta_cuts(reply, 4):
        splitter = ReasoningSplitter(opened)
        got_thinking = got_answer = ""
        bounds = [0, *points, len(reply)]
        for a, b in zip(bounds, bounds[1:]):
            delta = splitter.feed(reply[a:b])
            got_thinking += delta.thinking
            got_answer += delta.content
        last = splitter.finish()
        assert (got_thinking + last.thinking, got_answer + last.content) == (thinking, answer), points


def test_thinking_streams_before_the_block_closes():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>Let me").thinking == "Let me"
    assert splitter.in_thinking
    delta = splitter.feed(" see</th")
    assert delta.thinking == " see" and not delta.content
    delta = splitter.feed("ink>\n\nYes")
    assert (delta.thinking, delta.content) == ("", "Yes") and not splitter.in_thinking


def test_prompts_and_templates_that_think():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    assert template_thinks("{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>")
    assert not template_thinks("{{ '<|im_start|>assistant\n' }}")
