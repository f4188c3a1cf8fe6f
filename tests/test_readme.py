"""The README is a landing page whose commands and snippets run, and the getting-started pages' commands are valid.

Installing is not repeated here (CI's .ci/run does that from a clean checkout); what is checked is that every
command the README and the getting-started pages show names files, tests, keys and values that exist, and that
the README's run, its own-loop snippet and the default run's settings do what the README says."""

import ast
import re
import shlex
import types
from pathlib import Path

import pytest
import torch

from adloco import build_config
from adloco.cli import main
from tests.conftest import FAST, PINNED_PACE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = [ROOT / "docs" / name for name in ("install.md", "default-run.md", "run-output.md")]


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def _commands(path: Path) -> list[str]:
    """Each shell command of a page's bash blocks, comments dropped, `&&` chains split."""
    commands = []
    for block in _blocks(path, "bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            commands += [part.strip() for part in line.split("&&") if part.strip() and not line.startswith("#")]
    return commands


def _train_items(command: str) -> list[str] | None:
    """The items after `adloco train` (also under torchrun's `-m adloco train`), or None for another command."""
    words = shlex.split(command)
    for index in range(len(words) - 1):
        if words[index : index + 2] == ["adloco", "train"]:
            return words[index + 2 :]
    return None


def test_the_readme_is_a_landing_page_whose_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for section in ("## Quick start", "## What the default run gives", "## Methods", "## Use it", "## Documentation"):
        assert section in text
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) > 20
    for link in links:
        if link.startswith(("http://", "https://", "#")):
            continue
        assert (ROOT / link.split("#")[0]).exists(), f"the README links to {link}, which does not exist"


def test_the_set_up_and_test_commands_name_what_exists_and_ci_runs_them():
    readme = _commands(README)
    install = _commands(ROOT / "docs" / "install.md")
    set_up = ["python3 -m venv .venv", ". .venv/bin/activate"]
    for page in (readme, install):
        for command in [*set_up, "bash scripts/setup.sh", "adloco train", "bash scripts/setup.sh --dev"]:
            assert command in page
        assert "python -m pytest" in page and "python -m pytest -m unit" in page
    assert (ROOT / "scripts" / "setup.sh").is_file() and (ROOT / "scripts" / "docs.sh").is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh --dev" in ci and "\npython -m pytest\n" in ci and "mkdocs build --strict" in ci
    # the quick tier is the tests of the packages below the workers (conftest.py marks them; one that starts a
    # process fails there)
    from tests.conftest import UNIT_PACKAGES

    for package in UNIT_PACKAGES:
        assert len(list((ROOT / "tests" / package).glob("test_*.py"))) >= 2, package


def test_every_training_command_shown_is_a_valid_configuration():
    seen = 0
    for page in [README, *GETTING_STARTED]:
        for command in _commands(page):
            items = _train_items(command)
            if items is None or "--resume" in items:
                continue
            overrides = [item for item in items if "=" in item]
            # a YAML file named in an example is the reader's own; its overrides must still be valid keys
            build_config(overrides=[item for item in overrides if not item.startswith("--")])
            seen += 1
    assert seen >= 8


def test_the_default_run_is_what_the_readme_says():
    config = build_config(overrides=[])
    assert (
        config.method == "diloco" and config.model.preset in (None, "tiny") and config.data.dataset == "tinyshakespeare"
    )
    assert config.total_tokens == 1_536_000
    text = README.read_text(encoding="utf-8")
    assert "**DiLoCo with 4 workers**" in text and "1.536 M training tokens" in text
    assert "docs/images/default-run-loss.png" in text and (ROOT / "docs/images/default-run-loss.png").is_file()


def test_the_readme_cli_snippet_runs(tmp_path, capsys):
    commands = _commands(README)
    train = shlex.split(next(c for c in commands if c.startswith("adloco train method=adloco")))
    root = tmp_path / "runs"
    corpus = tmp_path / "corpus.txt"  # a small corpus, so that `adloco eval` over its whole split takes a moment
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    tiny = [*FAST, *PINNED_PACE, f"data.dataset={corpus}", f"run.root={root}", "run.name=readme"]
    # the README's items, those the test's tiny settings replace left out (a key may be given once)
    replaced = {item.split("=")[0] for item in tiny}
    assert main([*(w for w in train[1:] if w.split("=")[0] not in replaced), *tiny]) == 0
    run = root / "readme"
    assert (run / "final").is_dir() and "method: adloco" in (run / "config.yaml").read_text()
    for command in (c for c in commands if c.startswith(("adloco eval", "adloco sample"))):
        words = [str(run) if w == "runs/<run>" else w for w in shlex.split(command)[1:]]
        if words[0] == "sample":
            words += ["--tokens", "8"]
        assert main(words) == 0, command
    assert "loss" in capsys.readouterr().out


class _Model(torch.nn.Module):
    """A stand-in for the reader's model: called with a batch's keywords, it returns an object with `.loss`."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, y):
        return types.SimpleNamespace(loss=torch.nn.functional.mse_loss(self.net(x), y))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_readme_own_loop_snippet_trains_a_model():
    snippet = next(b for b in _blocks(README, "python") if "DiLoCo(model" in b)
    torch.manual_seed(0)
    model = _model = _Model()
    before = [p.detach().clone() for p in model.parameters()]

    def my_batches(rank):
        generator = torch.Generator().manual_seed(rank)
        for _ in range(30):  # three rounds of sync_every=10
            x = torch.randn(8, 4, generator=generator)
            yield {"x": x, "y": x.sum(dim=1, keepdim=True).sin()}

    namespace = {"torch": torch, "model": _model, "my_batches": my_batches, "rank": 0}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["diloco"] is not None
    after = list(model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the snippet trained nothing"


def test_the_readme_hf_trainer_snippet_names_the_real_integration():
    snippet = next(b for b in _blocks(README, "python") if "use_diloco" in b)
    tree = ast.parse(snippet)
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [
        ("adloco.integrations.hf", ["use_diloco"])
    ]
    pytest.importorskip("accelerate")
    from adloco.integrations.hf import use_diloco

    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "use_diloco")
    keywords = {k.arg for k in call.keywords}
    assert keywords <= set(use_diloco.__code__.co_varnames), keywords


def test_the_main_keys_table_of_the_getting_started_page_gives_the_schema_defaults():
    page = (ROOT / "docs" / "default-run.md").read_text(encoding="utf-8")
    table = page.split("The main keys")[1].split("\n\n")[1]
    compared = 0
    for row in table.splitlines()[2:]:
        keys_cell, defaults_cell = (cell.strip() for cell in row.strip("|").split("|")[:2])
        method = "streaming" if defaults_cell.endswith("(streaming)") else "diloco"
        config = build_config(overrides=[f"method={method}"]).model_dump()
        keys, section = [], ""
        for key in re.findall(r"`([^`]+)`", keys_cell):
            key = section + key if key.startswith(".") else key
            section = key.rsplit(".", 1)[0] if "." in key else ""
            keys.append(key)
        defaults = [re.sub(r"\s*\(.*\)$", "", d).strip("` ") for d in defaults_cell.split(", ")]
        for key, shown in zip(keys, defaults, strict=False):
            if shown in ("per method",) or "." in shown and not shown[0].isdigit():
                continue  # said in words, or another key's value
            value = config
            for part in key.split("."):
                value = value[part]
            if isinstance(value, bool):
                assert shown == str(value).lower(), (key, shown, value)
            elif isinstance(value, int | float):
                assert float(shown.replace(",", "")) == value, (key, shown, value)
            else:
                assert shown == str(value), (key, shown, value)
            compared += 1
    assert compared >= 25
