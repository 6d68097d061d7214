"""The documentation site builds: `mkdocs build --strict` (a broken link or anchor, a page missing from the navigation
or a command option class missing from the configuration reference fails it), and the generated configuration
reference lists every option of `DistillArguments` and every rock-token field of `RockOPDConfig`."""

import dataclasses
import html
import os
import re
import subprocess
import sys

import pytest

from hf_rockopd.distill import DistillArguments
from hf_rockopd.trainers import RockDistillationConfig, RockOPDConfig
from hf_rockopd.trainers.fields import RockTokenArguments


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def section(page: str, heading_id: str) -> str:
    """The HTML of one `###` section of a page: from its heading to the next heading of level 2 or 3."""
    start = page.index(f'<h3 id="{heading_id}"')
    end = min((i for i in (page.find("<h2", start + 1), page.find("<h3", start + 1)) if i > 0), default=len(page))
    return page[start:end]


def option_names(html_section: str) -> list[str]:
    """The options of a section's table: the code span in each row's first cell."""
    return [html.unescape(name) for name in re.findall(r"<tr>\s*<td><code>([^<]+)</code></td>", html_section)]


def test_every_page_is_built(site):
    for page in ("index", "installation", "quickstart", "trainers", "policies", "loss", "teacher", "distill",
                 "ablate", "lab", "performance", "distributed", "architecture", "reference/config"):
        path = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert path.is_file(), f"docs page {page} was not built"


def test_config_reference_lists_every_distill_option(site):
    page = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    listed = option_names(section(page, "distillarguments"))
    assert listed == [f.name for f in dataclasses.fields(DistillArguments)]
    assert "<!-- config-fields" not in page  # every directive was replaced by its table


@pytest.mark.parametrize("config_class", [RockOPDConfig, RockDistillationConfig])
def test_config_reference_lists_every_rock_token_field(site, config_class):
    page = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    listed = option_names(section(page, config_class.__name__.lower()))
    rock_fields = [f.name for f in dataclasses.fields(RockTokenArguments)]
    assert set(rock_fields) <= set(listed), sorted(set(rock_fields) - set(listed))
    own = set(vars(config_class).get("__annotations__", {}))  # the changed TRL defaults (lmbda, beta, ...)
    assert own <= set(listed)
    # The defaults are the config's own: RockOPDConfig's beta is 1.0 where GKDConfig's is 0.5.
    if config_class is RockOPDConfig:
        row = re.search(r"<td><code>beta</code></td>\s*<td>.*?</td>\s*<td><code>([^<]+)</code></td>",
                        section(page, "rockopdconfig"), flags=re.S)
        assert row and row.group(1) == repr(RockOPDConfig.__dataclass_fields__["beta"].default)
