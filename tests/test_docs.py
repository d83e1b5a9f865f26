"""The front door: a short README whose examples run, and docs that read as documentation, not
as a diary (figures come from result files; the git log keeps the history)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))


def test_the_readme_is_a_short_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for needed in ("make demo", "make test", "pip install", "## Status by platform"):
        assert needed in readme


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_no_page_narrates_sessions_or_dated_reruns(path):
    text = path.read_text()
    # "pytest session(s)" is the tool's term; result files' ISO timestamps are data.
    prose = re.sub(r"pytest\s+sessions?|\d{4}-\d\d-\d\dT[\d:+]+", "", text)
    assert not re.search(r"\bsessions?\b|\b20\d\d-\d\d-\d\d\b", prose, re.I), path.name


def test_every_docs_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS:
        assert str(page.relative_to(ROOT / "docs")) in nav, page.name


def test_the_readme_loss_example_runs():
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Losses as composable functions")[1].split("```python\n")[1]
    namespace: dict = {}
    exec(example.split("```")[0], namespace)       # noqa: S102 - the README's own code
    assert namespace["dlogp"].shape == (4, 8)
    assert float(namespace["loss"]) == float(namespace["loss"])     # finite, not NaN
