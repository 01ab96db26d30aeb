"""Helpers for test bodies that run on every rank of a plugin pool."""

from __future__ import annotations


def agreed_message(tp, message: str) -> str:
    """The one message every rank of ``tp``'s group reports (an error's text, or what a call that did not raise
    says); fails with every rank's message when they disagree."""
    messages = tp.all_gather_object(message)
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    return messages[0]


def assert_no_worse_on_every_rank(tp, checks, dtype) -> None:
    """The three-way rule (:func:`tplogp.tolerances.assert_no_worse`) for every ``(name, ours, same-dtype reference,
    float64 truth)`` of ``checks``, each rank's failures collected, one verdict for all ranks."""
    from tplogp.tolerances import assert_no_worse

    problems = []
    for name, ours, reference, truth in checks:
        try:
            assert_no_worse(name, ours, reference, truth, dtype)
        except AssertionError as exc:
            problems.append(str(exc))
    tp.assert_all(not problems, "; ".join(problems))
