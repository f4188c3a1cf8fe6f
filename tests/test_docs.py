from pathlib import Path

import adloco
from adloco.docs import configuration_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_generated_from_the_model():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == configuration_markdown(), "docs/configuration.md is stale: run python -m adloco.docs"
    assert "| `batch.eta` |" in page and "| `streaming.overlap` |" in page and "| `codec.name` |" in page


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
    for module in ("sync/diloco.py", "sync/ddp.py", "algorithms/flat.py", "comm/base.py"):
        assert module in code_map()
