"""jrl.train.programs: equal keys share one program, in the order of use, boundedly."""

import pytest

from jrl.train import programs


@pytest.fixture(autouse=True)
def _empty():
    programs.clear_shared_programs()
    yield
    programs.clear_shared_programs()


def test_equal_keys_share_one_build_and_other_keys_get_their_own():
    builds = []

    def build(tag):
        def make():
            builds.append(tag)
            return object()
        return make

    first = programs.shared_program(("step", 1.0, (("micro", 2),)), build("a"))
    # An equal key built from new objects (frozen settings compare by value): no second build.
    again = programs.shared_program(("step", 1.0, (("micro", 2),)), build("b"))
    other = programs.shared_program(("step", 0.5, (("micro", 2),)), build("c"))
    assert again is first and other is not first
    assert builds == ["a", "c"]


def test_an_unhashable_key_is_built_every_time():
    builds = []
    key = ("step", [1, 2])                       # a list inside: no hash, so never shared
    a = programs.shared_program(key, lambda: builds.append(1) or object())
    b = programs.shared_program(key, lambda: builds.append(1) or object())
    assert a is not b and len(builds) == 2


def test_the_least_recently_used_program_is_dropped_past_the_bound(monkeypatch):
    monkeypatch.setattr(programs, "MAX_SHARED_PROGRAMS", 2)
    a = programs.shared_program("a", object)
    programs.shared_program("b", object)
    assert programs.shared_program("a", object) is a      # "a" used again: "b" is the oldest
    programs.shared_program("c", object)                  # over the bound: "b" goes
    assert programs.shared_program("a", object) is a
    assert list(programs._programs) == ["c", "a"]
