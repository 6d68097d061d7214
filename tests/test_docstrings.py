"""Every `>>>` example in the package's docstrings runs and prints what it says.

The examples sit in Markdown fences (```python … ```), as in transformers' docstrings; plain `--doctest-modules` would
read a closing fence as expected output, so the fences are dropped before parsing.
"""

import doctest
import importlib
import pkgutil
import re

import pytest

import hf_rockopd

_FENCE = re.compile(r"^[ \t]*```[a-z]*[ \t]*$", flags=re.MULTILINE)


class _FencedDocTestParser(doctest.DocTestParser):
    def parse(self, string, name="<string>"):
        return super().parse(_FENCE.sub("", string), name)


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(parser=_FencedDocTestParser())
    tests = []
    # Every module of every subpackage: an example is found once, under the module that defines it.
    for info in pkgutil.walk_packages(hf_rockopd.__path__, prefix="hf_rockopd."):
        module = importlib.import_module(info.name)
        tests += [t for t in finder.find(module) if t.examples]
    return sorted(tests, key=lambda t: t.name)


EXAMPLES = _examples()


def test_the_package_has_examples():
    # Guards the collection itself: a parser or import change that finds nothing would make the test below vacuous.
    assert len(EXAMPLES) >= 40
    # Found under whichever module of `hf_rockopd.losses` / `hf_rockopd.policies` defines them.
    names = {t.name for t in EXAMPLES}
    assert any(n.startswith("hf_rockopd.losses") and n.endswith(".chunked_weighted_loss") for n in names)
    assert any(n.startswith("hf_rockopd.policies") and n.endswith(".RockFreezePolicy") for n in names)


@pytest.mark.parametrize("test", EXAMPLES, ids=lambda t: t.name.removeprefix("hf_rockopd."))
def test_docstring_example(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
