"""The template filler: all placeholders filled, nothing unknown, nothing left behind."""
import pytest

from builder.repository.template import TemplateError, placeholders, render


def test_render_fills_every_placeholder_and_formats_bools():
    text = render("a: ${x}\nb: ${flag}\nc: ${x}", {"x": 3, "flag": True})
    assert text == "a: 3\nb: true\nc: 3"


def test_missing_value_is_an_error_naming_the_key():
    with pytest.raises(TemplateError, match="no value for placeholder.*max_queue_size"):
        render("q: ${max_queue_size} d: ${decoupled}", {"decoupled": False}, source="t.pbtxt")


def test_unknown_value_is_an_error_naming_the_key():
    with pytest.raises(TemplateError, match="unknown placeholder.*max_queue_sise"):
        render("q: ${max_queue_size}", {"max_queue_size": 1, "max_queue_sise": 2})


@pytest.mark.parametrize("template", ["x: ${ spaced }", "x: ${1bad}", "x: ${unterminated"])
def test_malformed_placeholder_never_survives(template):
    with pytest.raises(TemplateError, match="line 1: unfilled or malformed placeholder"):
        render(template, {})


def test_value_cannot_smuggle_a_placeholder():
    with pytest.raises(TemplateError, match="contains"):
        render("x: ${a}", {"a": "${b}"})


def test_placeholders_lists_names():
    assert placeholders("${a} ${b} ${a} $c {d}") == {"a", "b"}
