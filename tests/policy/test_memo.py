"""text_memo (guard/policy/_memo.py): a memo bounded by entries and by the characters it holds."""

from __future__ import annotations

import threading

import pytest

from guard.policy._memo import text_memo


def test_least_recently_used_entries_go_past_the_character_bound() -> None:
    calls: list[str] = []

    @text_memo(max_entries=100, max_chars=25)
    def upper(text: str) -> str:
        calls.append(text)
        return text.upper()

    for text in ("a" * 10, "b" * 10):
        assert upper(text) == text.upper()
    upper("a" * 10)  # used again: "b" is the least recently used now
    upper("c" * 10)  # 30 characters: "b" goes
    assert upper.cache_info().chars == 20 and upper.cache_info().currsize == 2
    upper("a" * 10)
    upper("b" * 10)
    assert calls == ["a" * 10, "b" * 10, "c" * 10, "b" * 10]
    assert upper.__name__ == "upper" and upper.cache_info().misses == 4


def test_results_count_and_an_entry_past_the_bound_is_not_kept() -> None:
    calls: list[str] = []

    @text_memo(max_entries=100, max_chars=40, result_chars=len)
    def tripled(text: str) -> str:
        calls.append(text)
        return text * 3

    tripled("x" * 10)
    assert tripled.cache_info().chars == 40
    assert tripled("y" * 11) == "y" * 33  # 44 characters alone: computed, not kept, and the others stay
    assert tripled.cache_info().currsize == 1
    tripled("y" * 11)  # the last result past the bound is kept apart: not computed again
    tripled("x" * 10)
    tripled("z" * 11)  # replaces it
    tripled("y" * 11)
    assert calls == ["x" * 10, "y" * 11, "z" * 11, "y" * 11]
    assert tripled.cache_info().currsize == 1


def test_the_entry_bound_still_holds_and_clear_empties() -> None:
    memo_len = text_memo(max_entries=3, max_chars=10**6)(len)
    for n in range(10):
        memo_len(str(n))
    assert memo_len.cache_info().currsize == 3 and memo_len.cache_info().chars == 3
    memo_len.cache_clear()
    assert memo_len.cache_info() == (0, 3, 0, 0, 10**6)


def test_several_arguments_are_one_key_and_keywords_are_refused() -> None:
    repeated = text_memo(max_entries=10, max_chars=100)(lambda text, times: text * times)
    assert repeated("ab", 2) == "abab" and repeated("ab", 3) == "ababab" and repeated("ab", 2) == "abab"
    assert repeated.cache_info().chars == 4 and repeated.cache_info().misses == 2
    with pytest.raises(TypeError):
        repeated(text="ab", times=2)


def test_threads_keep_the_bounds_and_the_count() -> None:
    reverse = text_memo(max_entries=50, max_chars=500, result_chars=len)(lambda text: text[::-1])
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for n in range(3000):
                text = str((n * 7 + seed) % 120) * (1 + n % 9)
                assert reverse(text) == text[::-1]
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    info = reverse.cache_info()
    assert info.chars <= 500 and info.currsize <= 50
    assert info.chars == sum(chars for _, chars in reverse.memo.entries.values())
