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
