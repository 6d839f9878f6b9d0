"""A call cut off in its arguments, read as an object for the APIs whose call input is one."""

import json

import pytest

from strata.engine.calls import partial_object

CASES = [
    ('{"city": "Par', {"city": "Par"}),  # an open string is closed
    ("", {}),  # cut off right after the call's name
    ('{"ci', {}),  # a key without its value: dropped
    ('{"a": 1, "b": tr', {"a": 1}),  # a half-written literal: its member dropped
    ('{"a": 1.', {}),  # a half-written number likewise
    ('{"a": {"b": [1, 2', {"a": {"b": [1, 2]}}),  # nested containers closed
    ('{"a": [{"b": 1}, {"c"', {"a": [{"b": 1}, {}]}),
    ('{"a": "x\\', {"a": "x"}),  # a dangling backslash: its escape is not written
    ('{"a": "q\\"', {"a": 'q"'}),  # an escaped quote does not end the string
    ('{"a": "}, ]"', {"a": "}, ]"}),  # brackets and commas inside a string are text
    ('{"a": "b", "c', {"a": "b"}),
    ("[1, 2", {}),  # not an object: nothing to carry
]


@pytest.mark.parametrize(("text", "want"), CASES, ids=[c[0] or "empty" for c in CASES])
def test_a_cut_off_call_reads_as_far_as_it_was_written(text: str, want: dict) -> None:
    assert partial_object(text) == want


@pytest.mark.parametrize("whole", ['{"a": 1}', '{"s": "{\\"x\\": [1, \\"]\\"]}"}', "{}"])
def test_whole_arguments_read_as_json_does(whole: str) -> None:
    assert partial_object(whole) == json.loads(whole)
    # and every cut of them reads as an object, never an error
    for i in range(len(whole)):
        assert isinstance(partial_object(whole[:i]), dict)
