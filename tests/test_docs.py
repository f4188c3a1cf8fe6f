from pathlib import Path

import adloco
from adloco.docs import cli_markdown, configuration_markdown, generated_pages, section_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_generated_pages_are_fresh():
    pages = generated_pages()
    for name, text in pages.items():
        page = (ROOT / "docs" / name).read_text()
        assert page == text, f"docs/{name} is stale: run python -m adloco.docs --write"
    on_disk = {f"configuration/{p.name}" for p in (ROOT / "docs" / "configuration").glob("*.md")}
    assert on_disk == {name for name in pages if name.startswith("configuration/")}, "a section page is left over"


def test_the_configuration_reference_has_a_page_per_config_section_with_bounds_and_method_defaults():
    pages = generated_pages()
    for section in ("model", "data", "inner", "outer", "batch", "merge", "streaming", "codec", "run"):
        assert f"configuration/{section}.md" in pages
        assert f"| [`{section}`](configuration/{section}.md) | " in pages["configuration.md"]
    batch = section_markdown("batch")
    # each key on its own section's page
    assert "| `batch.statistics.eta` |" in batch and "| `codec.name` |" not in batch
    # the sub-sections each under a heading of their own, with their tiers, and the keys they took over, old -> new
    for sub in ("statistics", "time", "scaling", "memory"):
        assert f"### `batch.{sub}`" in batch
    assert batch.index("| `batch.allow_shrink` |") < batch.index("### `batch.statistics`")  # own keys first
    assert "| `batch.time.patience` | advanced | int (≥ 1) | 2 |" in batch
    assert "| `batch.eta` | `batch.statistics.eta` |" in batch
    assert "| `batch.lr_scaling` | `batch.scaling.lr` |" in batch
    assert "(configuration/batch.md#renamed-keys)" in configuration_markdown()
    assert "| `shards` | advanced | int (≥ 1) |" in configuration_markdown()  # bounds from the schema
    assert "| `streaming.overlap` | advanced | int \\| None (≥ 0) |" in section_markdown("streaming")  # | escaped
    assert "[data.md](../data.md)" in section_markdown("data") and "docs/data.md" not in section_markdown("data")
    assert "[data.md](data.md)" in configuration_markdown()  # the section's note, linked from the first page
    # what each method fills in for a key left null, read from the config as it resolves
    methods = configuration_markdown().split("## Defaults per method")[1]
    assert "| key | ddp | localsgd | diloco | adloco | streaming |" in methods
    assert "| `outer.momentum` | 0.0 | 0.0 | 0.5 | 0.5 | 0.5 |" in methods
    assert "| `batch.controller` | test | test | test | time | test |" in methods
    assert "| `trainers` | 1 | 1 | 1 | 1 | 1 |" in methods and "| `streaming.overlap` | 0 | 0 | 0 | 0 | 1 |" in methods
    assert "| `outer.nesterov` | false | false | true | true | true |" in methods
    assert "| `outer.momentum` | 0.0 | 0.0 | 0.5 | 0.5 | 0.5 |" in section_markdown("outer")
    assert "Defaults per method" not in section_markdown("eval")  # no table where no key is null


def test_cli_page_lists_every_command_and_option_of_the_parser():
    from adloco.cli import _parser

    page = cli_markdown()
    help_text = _parser().format_help()
    for command in ("train", "prepare", "eval", "sample", "plot", "runs", "gradients", "estimate", "lighthouse"):
        assert f"## `adloco {command}`" in page and command in help_text
    assert "| `--resume RUN_DIR` |" in page and "| `--print-config [basic,all]` |" in page
    assert "| `--out DIR` | required; " in page and "| `--min-replicas MIN_REPLICAS` |" in page
    assert "%%" not in page


def test_python_api(tmp_path):
    from tests.conftest import FAST

    config = adloco.build_config(overrides=[*FAST, "total_tokens=64", f"run.root={tmp_path}"])
    assert isinstance(config, adloco.TrainConfig)
    result = adloco.train(config)
    assert isinstance(result, adloco.TrainResult) and result.run_dir.exists()


def test_code_map_in_the_design_notes_is_generated_from_the_tree():
    from adloco.docs import code_map

    page = (ROOT / "docs" / "design.md").read_text()
    assert code_map() in page, "docs/design.md's code map is stale: regenerate it with adloco.docs.code_map()"
    groups = {block.split()[0]: block for block in code_map().split("\n\n")}  # a package's line, then its modules
    for module in ("sync/diloco.py", "sync/ddp.py", "algorithms/flat.py", "comm/base.py"):
        package, name = module.split("/")
        assert f"\n  {name} " in groups[package + "/"], module


def test_the_site_navigation_lists_every_page_and_only_pages_that_exist():
    import yaml

    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(items):
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from pages(value) if isinstance(value, list) else [value]

    listed = list(pages(site["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert len(listed) == len(set(listed)) and set(listed) == on_disk


def test_the_pages_benchmarks_write_into_exist():
    """A benchmark that renders its table into a docs page names a page that is there (pages move)."""
    import re

    named = 0
    for script in (ROOT / "benchmarks").glob("*.py"):
        for match in re.finditer(r'ROOT / "docs"((?: / "[^"]+")+)', script.read_text()):
            parts = re.findall(r'"([^"]+)"', match.group(1))
            assert (ROOT / "docs").joinpath(*parts).exists(), f"{script.name} writes into docs/{'/'.join(parts)}"
            named += 1
    assert named >= 15


def test_the_api_page_documents_every_exported_name():
    page = (ROOT / "docs" / "api.md").read_text()
    documented = {line.split()[1].rsplit(".", 1)[1] for line in page.splitlines() if line.startswith("::: ")}
    assert documented == set(adloco.__all__) - {"__version__"}
    for line in (line for line in page.splitlines() if line.startswith("::: ")):
        module, name = line.split()[1].rsplit(".", 1)
        assert getattr(__import__(module, fromlist=[name]), name) is getattr(adloco, name), line
