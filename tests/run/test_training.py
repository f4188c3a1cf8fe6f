import pytest
import torch

from adloco.checkpoint import list_checkpoints
from adloco.config import build_config
from adloco.metrics.writer import read_metrics
from adloco.run.training import train
from tests.conftest import PINNED_PACE, cut_back, final_params


@pytest.mark.parametrize("method", ["ddp", "localsgd", "diloco", "adloco"])
def test_each_method_runs_end_to_end(method, fast_overrides):
    result = train(build_config(overrides=[*fast_overrides, f"method={method}"]))
    assert result.tokens >= 1024
    assert torch.isfinite(torch.tensor(result.val_loss)) and result.val_loss < 5.6  # below uniform (ln 256)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    steps = [r for r in records if r["kind"] == "step"]
    assert rounds and steps and records[-1]["kind"] == "final"
    assert rounds[-1]["tokens"] == result.tokens
    assert (result.run_dir / "config.yaml").exists() and (result.run_dir / "train.log").exists()
    assert (result.run_dir / "final" / "config.json").exists()
    assert list_checkpoints(result.run_dir / "checkpoints")


def test_bytes_counted_from_reduced_tensors(fast_overrides):
    diloco = train(build_config(overrides=[*fast_overrides, "method=diloco", "total_tokens=256"]))
    ddp = train(build_config(overrides=[*fast_overrides, "method=ddp", "total_tokens=256"]))
    params = sum(t.numel() for t in final_params(diloco.run_dir).values())
    diloco_rounds = [r for r in read_metrics(diloco.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    ddp_rounds = [r for r in read_metrics(ddp.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    # 2 workers each send one fp32 pseudo-gradient per round with their round report in the same collective
    # (float64: out flag, b_max, stop signal, checkpoint request, step, overhead and between-round seconds,
    # 5 statistics, then loss, tokens and health of each step, then ‖Δ‖²) and, once at start-up, every worker's
    # b_max (one float64)
    report_bytes = 2 * 8 * (12 + 3 * diloco_rounds[0]["steps"] + 1)
    assert diloco_rounds[0]["bytes"] == 2 * 4 * params + report_bytes + 2 * 8
    assert [r["exchanges"] for r in diloco_rounds] == [2] + [1] * (len(diloco_rounds) - 1)  # + the handshake
    # DDP sends a full gradient from every worker at every step, each with a one-step report, and no Δ
    assert ddp_rounds[0]["steps"] == diloco_rounds[0]["steps"]
    assert ddp_rounds[0]["bytes"] == ddp_rounds[0]["steps"] * (2 * 4 * params + 2 * 8 * (12 + 3)) + 2 * 8
    assert [r["exchanges"] for r in ddp_rounds][1:] == [r["steps"] for r in ddp_rounds][1:]


@pytest.mark.parametrize("method", ["ddp", "diloco"])
def test_a_lone_worker_sends_nothing(fast_overrides, method):
    alone = train(build_config(overrides=[*fast_overrides, f"method={method}", "workers=1", "total_tokens=128"]))
    rounds = [r for r in read_metrics(alone.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert rounds and all(r["bytes"] == 0 for r in rounds) and alone.bytes_sent == 0


def test_same_seed_same_numbers_and_other_seed_differs(fast_overrides):
    a = train(build_config(overrides=[*fast_overrides, "total_tokens=256"]))
    b = train(build_config(overrides=[*fast_overrides, "total_tokens=256"]))
    c = train(build_config(overrides=[*fast_overrides, "total_tokens=256", "seed=1"]))
    pa, pb, pc = final_params(a.run_dir), final_params(b.run_dir), final_params(c.run_dir)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


@pytest.mark.training
@pytest.mark.parametrize(
    "method",
    [
        ["method=diloco"],
        ["method=diloco", "precision=fp16"],  # the workers' loss scales go through the checkpoint
        ["method=diloco", "checkpoint.format=sharded"],
        [
            "method=adloco",
            "checkpoint.format=sharded",
            "trainers=2",
            "workers=1",
            "merge.every=3",
            "batch.b_cap=4",
            "total_tokens=2048",
            *PINNED_PACE,
        ],  # fmt: skip
        ["method=adloco", "trainers=2", "workers=1", "merge.every=3", "batch.b_cap=4", "total_tokens=2048"]
        + PINNED_PACE,
        # MuLoCo-style: Muon inner steps, outer Adam per fragment; both optimizers' states go through the checkpoint
        ["method=streaming", "inner.optimizer=muon", "outer.optimizer=adam", "sync_every=4", "streaming.fragments=2"],
        # H chosen while training (4, 8, 8, 10, 12, 22: a small drift scale, lengthened as the lr decays): the rule's
        # state goes through the checkpoint, and the resume starts where H changes, fragments' exchanges in flight
        [
            "method=streaming",
            "sync_every=auto",
            "sync_auto.min=4",
            "sync_auto.max=32",
            "sync_auto.start=4",
            "sync_auto.drift_steps=30",
            "total_tokens=3072",
            *PINNED_PACE,
        ],  # fmt: skip
    ],
)
def test_resume_from_a_mid_run_checkpoint_is_bit_identical(method, fast_overrides, tmp_path):
    config = build_config(overrides=[*fast_overrides, *method, "checkpoint.every=1", "checkpoint.keep=100"])
    full = train(config)
    checkpoints = list_checkpoints(full.run_dir / "checkpoints")
    assert len(checkpoints) >= 4
    full_rounds = [r for r in read_metrics(full.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    keep, h = 2, [r["sync_every"] for r in full_rounds]
    if "sync_every=auto" in method:  # cut at the first boundary after round 2 where H changes
        keep = next(n for n in range(2, len(h)) if h[n] != h[n - 1])
    # A copy of the run as it was on disk after round `keep`, as if the process had died then.
    partial = cut_back(full.run_dir, tmp_path / "partial", keep=keep)
    resumed = train(config, resume=partial)
    expected, got = final_params(full.run_dir), final_params(partial)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert resumed.val_loss == full.val_loss and resumed.tokens == full.tokens
    resumed_rounds = [r for r in read_metrics(partial / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["round"] for r in resumed_rounds] == [r["round"] for r in full_rounds]
    assert [r["train_loss"] for r in resumed_rounds] == [r["train_loss"] for r in full_rounds]
    # Bytes are the algorithm's traffic: a resume neither loses nor repeats any of it.
    assert [r["bytes_total"] for r in resumed_rounds] == [r["bytes_total"] for r in full_rounds]
    assert resumed.bytes_sent == full.bytes_sent


def test_one_worker_diloco_localsgd_is_plain_adamw(fast_overrides):
    """With a single worker LocalSGD's outer step copies the worker: training equals a plain AdamW loop."""
    a = train(build_config(overrides=[*fast_overrides, "method=localsgd", "workers=1", "total_tokens=256"]))
    b = train(build_config(overrides=[*fast_overrides, "method=ddp", "workers=1", "total_tokens=256"]))
    pa, pb = final_params(a.run_dir), final_params(b.run_dir)
    assert all(torch.allclose(pa[k], pb[k], atol=1e-6) for k in pa)


@pytest.mark.training
def test_adloco_grows_batches_and_merges_down_to_one_trainer(fast_overrides):
    overrides = [
        *fast_overrides,
        "method=adloco",
        "batch.controller=test",
        "trainers=4",
        "workers=1",
        "batch.b_cap=8",
        "merge.every=1",
        "sync_every=3",
        "total_tokens=4608",
    ]
    result = train(build_config(overrides=overrides))
    records = read_metrics(result.run_dir / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    merges = [r for r in records if r["kind"] == "merge"]
    assert rounds[0]["plan"].keys() == {"0", "1", "2", "3"}  # four trainers of one worker each at the start
    assert len(merges) == 3 and rounds[-1]["workers"] == {"0": 4}
    assert merges[-1]["workers"] == [0, 1, 2, 3]
    assert sorted(w for m in merges for w in m["merged"] if w != m["into"]) == [1, 2, 3]
    for merge in merges:  # b-weighted: weights follow the members' b_req at merge time
        assert abs(sum(merge["weights"]) - 1) < 1e-12
    sizes = [b for r in rounds for b in r["batch"].values()]
    assert max(sizes) > 2  # the test asked for larger batches than the initial b = 2
    decisions = [d for r in rounds if r["batch_test"] for d in r["batch_test"].values()]
    assert decisions and all("sample_variance" in d and "b_req" in d for d in decisions)
    assert all(r["plan"] for r in rounds)


@pytest.mark.training
def test_the_time_aware_controller_grows_b_towards_the_fastest_batch_at_most_2x_per_decision(fast_overrides):
    overrides = [*fast_overrides, "method=adloco", "trainers=1", "workers=2", "batch.size=1", "batch.b_cap=64"]
    result = train(build_config(overrides=[*overrides, *PINNED_PACE, "sync_every=2", "total_tokens=6144"]))
    rounds = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    sizes = [r["batch"]["0"] for r in rounds]
    assert sizes[-1] > sizes[0] == 1  # the pinned costs make b = 1 far from the fastest batch
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:], strict=False))  # at most 2x per decision
    timed = [r["batch_test"]["0"]["timed"] for r in rounds]
    assert all(t["step_seconds"] == pytest.approx(0.01 + 0.001 * t["b_req"]) for t in timed)
    assert all(t["round_seconds"] == 0.05 and t["target"] <= t["limit"] for t in timed)
    assert timed[-1]["limit"] < timed[0]["limit"]  # the end of the budget bounds the growth
    # patience 2: b moves only after two decisions in a row asked for more (a record holds b after its round)
    assert sizes[:2] == [1, 2]


@pytest.mark.training
def test_keep_round_time_takes_fewer_inner_steps_per_round_as_b_grows(fast_overrides):
    overrides = [*fast_overrides, "method=adloco", "trainers=1", "workers=2", "batch.size=1", "batch.b_cap=64"]
    settings = [*PINNED_PACE, "sync_every=8", "total_tokens=8192", "batch.time.keep_round_time=true"]
    result = train(build_config(overrides=[*overrides, *settings]))
    rounds = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    b_at_start = [1] + [r["batch"]["0"] for r in rounds[:-1]]  # a record holds b after its round
    expected = [max(1, round(8 / b)) for b in b_at_start]
    assert [r["steps"] for r in rounds[:-1]] == expected[:-1]  # the last round may be cut by the budget
    assert rounds[-1]["steps"] <= expected[-1] and max(b_at_start) >= 4 and rounds[0]["steps"] == 8


@pytest.mark.training
def test_measured_costs_feed_the_time_aware_controller(fast_overrides):
    overrides = [*fast_overrides, "method=adloco", "trainers=1", "workers=2", "batch.time.min_steps_left=1"]
    result = train(build_config(overrides=[*overrides, "sync_every=2", "total_tokens=2048"]))
    rounds = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    timed = [r["batch_test"]["0"]["timed"] for r in rounds]
    assert all(t["step_seconds"] > 0 and t["round_seconds"] >= 0 for t in timed)
    assert timed[0]["round_seconds"] == 0 < timed[-1]["round_seconds"]  # learnt from the rounds' overhead


@pytest.mark.training
@pytest.mark.parametrize(
    "variant",
    [
        ["batch.test=inner_product"],
        ["batch.statistics.estimator=cross_worker"],
        ["merge.policy=pairwise_reference"],
        ["batch.test=constant", "merge.policy=off", "batch.memory.switch_factor=1"],
    ],
)
def test_adloco_variants_run_and_log_their_statistics(variant, fast_overrides):
    overrides = [*fast_overrides, "method=adloco", "trainers=2", "workers=2", "batch.b_cap=6", *variant]
    result = train(build_config(overrides=[*overrides, "merge.every=1", "total_tokens=2048"]))
    records = read_metrics(result.run_dir / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    decisions = [d for r in rounds if r["batch_test"] for d in r["batch_test"].values()]
    assert decisions  # statistics are logged even when the batch is held constant
    if "batch.test=inner_product" in variant:
        assert all(d["ip_request"] is not None for d in decisions)
    if "batch.test=constant" in variant:
        assert all(b == 2 for r in rounds for b in r["batch"].values())
        assert not any(r["kind"] == "merge" for r in records)
    else:
        assert any(r["kind"] == "merge" for r in records)
    if "batch.statistics.estimator=cross_worker" in variant:
        # the paper's estimator gathers each worker's full gradient: far more than scalars travel
        params = sum(t.numel() for t in final_params(result.run_dir).values())
        assert rounds[0]["bytes"] > 2 * 2 * 4 * params * 2 - 1


def test_every_round_reports_its_mfu_against_the_given_peak(fast_overrides):
    result = train(build_config(overrides=[*fast_overrides, "run.peak_tflops=1", "total_tokens=512"]))
    rounds = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert rounds and all(r["mfu"] > 0 for r in rounds)
    from adloco.models.build import flops_per_token_of, preset_config

    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        per_token = flops_per_token_of(LlamaForCausalLM(preset_config("tiny", 256, 16)), 16)
    first = rounds[0]
    tokens = first["tokens"]
    expected = tokens / (first["round_seconds"] - first["eval_seconds"]) * per_token / 1e12
    assert first["mfu"] == pytest.approx(expected, rel=1e-3)


@pytest.mark.process
def test_mfu_asked_for_on_a_device_of_unknown_peak_is_refused_before_training(tmp_path):
    from tests.conftest import adloco_process

    answer = adloco_process("train", "run.mfu=true", f"run.root={tmp_path}")
    assert answer.returncode == 2
    assert "run.mfu: the peak of this CPU for fp32 is not known; give run.peak_tflops" in answer.stderr
    assert not any(tmp_path.iterdir())  # nothing was built or written
