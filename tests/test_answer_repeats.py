"""benchmarks/answer_repeats.py's count: a token is repeated when the n-gram ending at it occurred
earlier in the same answer (a loop), never before n tokens."""

from benchmarks.answer_repeats import repeated_flags


def test_a_loop_is_counted_from_its_second_pass_on():
    loop = [5, 6, 7]
    ids = [1, 2] + loop * 3
    flags = repeated_flags(ids, 3)
    # the n-grams of the first pass (and those reaching back into [1, 2]) are new; from token 7 on,
    # each 3-gram closes one seen three tokens before
    assert flags == [False] * 7 + [True] * 4
    assert repeated_flags(ids, 20) == [False] * len(ids)  # no 20-gram fits twice
    assert repeated_flags([], 2) == []
    assert not any(repeated_flags(list(range(50)), 1))  # distinct tokens never repeat
