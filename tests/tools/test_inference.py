import pytest

from adloco.checkpoint import CheckpointError
from adloco.config import build_config, resume_config
from adloco.data import ByteTokenizer, load_corpus
from adloco.run.training import train
from adloco.tools.inference import evaluate_run, sample


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from tests.conftest import FAST

    root = tmp_path_factory.mktemp("runs")
    # The last 1 % of the corpus as validation split keeps the full evaluations (here and in eval) short.
    overrides = [*FAST, "total_tokens=512", "eval.final_full=true", "data.val_fraction=0.01", f"run.root={root}"]
    return train(build_config(overrides=overrides))


@pytest.mark.training
def test_eval_reproduces_the_final_validation_loss(finished_run):
    loss, tokens = evaluate_run(finished_run.run_dir)
    assert loss == finished_run.val_loss
    validation_split = len(load_corpus(resume_config(finished_run.run_dir).data, ByteTokenizer(), 16).val)
    assert 11_000 < validation_split < 11_300
    assert tokens == (validation_split - 1) // 16 * 16  # the whole validation split in windows of context 16


def test_sample_continues_the_prompt_deterministically(finished_run):
    a = sample(finished_run.run_dir, "ROMEO:", tokens=40, temperature=0.8, top_k=20, seed=1)
    b = sample(finished_run.run_dir, "ROMEO:", tokens=40, temperature=0.8, top_k=20, seed=1)
    greedy = sample(finished_run.run_dir, "ROMEO:", tokens=40, temperature=0, top_k=None, seed=5)
    assert a == b and a.startswith("ROMEO:") and len(a.encode()) >= 40
    assert greedy == sample(finished_run.run_dir, "ROMEO:", tokens=40, temperature=0, top_k=None, seed=6)


def test_a_run_without_an_exported_model_is_a_clear_error(tmp_path):
    (tmp_path / "config.yaml").write_text("method: diloco\n")
    with pytest.raises(CheckpointError, match="no exported model"):
        sample(tmp_path, "x", 5, 1.0, None, 0)


def test_plot_writes_pngs(finished_run):
    from adloco.metrics.plots import plot_run

    paths = plot_run(finished_run.run_dir)
    assert [p.name for p in paths] == ["loss.png", "batch.png", "memory.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths)


def test_eval_from_another_folder_finds_data_given_by_a_relative_path(tmp_path, monkeypatch):
    from tests.conftest import FAST

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "corpus.txt").write_text("To be, or not to be, that is the question.\n" * 120)
    monkeypatch.chdir(tmp_path / "project")
    overrides = [*FAST, "total_tokens=256", "eval.final_full=true", "data.dataset=corpus.txt", f"run.root={tmp_path}"]
    config = build_config(overrides=overrides)
    result = train(config)
    assert "dataset: " + str(tmp_path / "project" / "corpus.txt") in (result.run_dir / "config.yaml").read_text()
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative name no longer resolves from here
    loss, _ = evaluate_run(result.run_dir)
    assert loss == result.val_loss
