"""`make test` runs the suite as groups (Makefile TEST_GROUPS): every test directory and every
top-level test file must be in exactly one group, or a new one would silently never run."""

import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent


def _groups() -> list[str]:
    makefile = (TESTS.parent / "Makefile").read_text()
    block = re.search(r"^TEST_GROUPS := (.*?)\n\n", makefile, re.S | re.M).group(1)
    return [path for group in re.findall(r'"([^"]*)"', block) for path in group.split()]


def test_every_test_path_is_in_exactly_one_group():
    listed = _groups()
    assert len(listed) == len(set(listed)), "a path is in two groups"
    present = {f"tests/{p.name}" for p in TESTS.iterdir()
               if (p.is_dir() and any(p.rglob("test_*.py"))) or
               (p.is_file() and p.name.startswith("test_") and p.suffix == ".py")}
    assert set(listed) == present


def test_test_folders_import_under_the_tests_package():
    """Without tests/__init__.py pytest puts tests/ itself on sys.path and imports tests/kernels as
    a top-level `kernels`, which shadows the library transformers imports under that name (every
    transformers model test then fails on import)."""
    assert __name__ == "tests.test_test_groups"
    import tests.kernels
    assert pathlib.Path(tests.kernels.__file__).parent == TESTS / "kernels"


def test_the_slowest_first_order_names_existing_files_and_is_applied(request):
    """tests/conftest.py's SLOWEST_FIRST orders the files for the workers; a renamed file would
    silently lose its place."""
    from tests.conftest import SLOWEST_FIRST
    missing = [name for name in SLOWEST_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"SLOWEST_FIRST names files that do not exist: {missing}"
    assert len(SLOWEST_FIRST) == len(set(SLOWEST_FIRST))
    # The hook ran on this session's items: a listed file's tests come before unlisted ones.
    items = request.session.items
    ranks = [SLOWEST_FIRST.index(n) if n in SLOWEST_FIRST else len(SLOWEST_FIRST)
             for n in (str(item.path.relative_to(TESTS)).replace("\\", "/") for item in items)]
    assert ranks == sorted(ranks)


def test_the_suite_compiles_with_the_older_emitters_and_children_can_opt_out():
    """tests/conftest.py adds XLA's older CPU fusion emitters (when this jaxlib knows the flag and
    nobody opted out); default_emitters_env gives a child the default ones with the other flags
    kept; an unknown flag is refused (XLA would end every test process on it)."""
    import os

    from tests.conftest import _LEGACY_EMITTERS_FLAG, _xla_knows, default_emitters_env
    flags = os.environ["XLA_FLAGS"].split()
    # Opted out: full optimization, JRL_TEST_LEGACY_EMITTERS=0 (set too where this XLA lacks
    # the flag), or an emitter setting of the caller's own in XLA_FLAGS.
    opted_out = (os.environ.get("JRL_TEST_FULL_OPTIMIZATION") == "1"
                 or os.environ.get("JRL_TEST_LEGACY_EMITTERS") == "0"
                 or any(f.startswith("--xla_cpu_use_fusion_emitters")
                        and f != _LEGACY_EMITTERS_FLAG for f in flags))
    assert (_LEGACY_EMITTERS_FLAG in flags) != opted_out
    child_env = default_emitters_env(EXTRA="1")
    child = child_env["XLA_FLAGS"].split()
    assert _LEGACY_EMITTERS_FLAG not in child and child_env["JRL_TEST_LEGACY_EMITTERS"] == "0"
    assert child_env["EXTRA"] == "1"
    assert child == [f for f in flags if f != _LEGACY_EMITTERS_FLAG]
    assert not _xla_knows("--xla_cpu_no_such_flag_in_any_xla=true")
