"""Decode grouping: runs of similar context length, padding bounded by the slack."""

from engines.runtime.attention import group_by_length


def test_groups_split_where_the_slack_is_exceeded():
    # 4 -> 5 is within 1.25x of 4; 6 is not (6 > 5.0); 6, 7 within 7.5; 8 > 7.5 starts a new run.
    assert group_by_length([4, 5, 6, 7, 8, 40]) == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_equal_lengths_are_one_group_and_empty_is_none():
    assert group_by_length([3, 3, 3]) == [(0, 3)]
    assert group_by_length([]) == []


def test_groups_cover_every_row_once():
    lengths = sorted([1, 2, 2, 9, 10, 11, 30, 31, 64, 65, 80])
    groups = group_by_length(lengths)
    assert [i for lo, hi in groups for i in range(lo, hi)] == list(range(len(lengths)))
    for lo, hi in groups:
        assert lengths[hi - 1] <= 1.25 * lengths[lo]
