"""webchat.serve.rules: the input rules the websocket and the API share (each wire's own tests check its wording)."""

from __future__ import annotations

import pytest

from webchat.serve import rules


def test_strict_json_refuses_nan_and_infinity() -> None:
    assert rules.loads('{"a": 1.5}') == {"a": 1.5}
    for bad in ('{"a": NaN}', '{"a": Infinity}', '[-Infinity]'):
        with pytest.raises(ValueError, match="is not valid JSON"):
            rules.loads(bad)


def test_a_lone_surrogate_is_found_by_its_path_and_shown_escaped() -> None:
    body = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\ud800"}]}
    assert rules.lone_surrogate(body) == "messages.1.content"
    assert rules.lone_surrogate({"k\udfff": 1}) == "k\udfff"
    assert rules.lone_surrogate({"fine": ["😀", {"x": "é"}]}) is None
    assert rules.safe_text("r\ud800") == "r\\ud800"
    assert rules.short_repr("x" * 100).endswith("...") and len(rules.short_repr("x" * 100)) == 60


def test_the_speculative_mode_is_the_request_s_or_the_default_and_must_be_offered() -> None:
    assert rules.speculative_mode(None, "none", ["none", "self"]) == "none"
    assert rules.speculative_mode("self", "none", ["none", "self"]) == "self"
    with pytest.raises(rules.RuleError) as e:
        rules.speculative_mode("draft", "none", ("none", "self"))
    assert e.value.field == "speculative" and "'draft'" in e.value.message and "['none', 'self']" in e.value.message


def test_the_context_leaves_room_for_at_least_one_new_token() -> None:
    assert rules.context_room(10, 256) == 246
    assert rules.context_room(255, 256) == 1
    for n in (256, 300):
        with pytest.raises(rules.RuleError) as e:
            rules.context_room(n, 256)
        assert e.value.field == "prompt"
        assert e.value.message == f"prompt is {n} tokens; the context of 256 allows at most 255"
