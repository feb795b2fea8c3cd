"""is_int / is_number: a bool is never a count or a rate."""
from triton_backend.engine.numbers import is_int, is_number


def test_bools_are_neither_ints_nor_numbers():
    assert is_int(3) and is_int(0) and not is_int(True) and not is_int(2.0) and not is_int("3")
    assert is_number(3) and is_number(0.5) and not is_number(False) and not is_number("0.5")
    assert not is_int(None) and not is_number(None)
