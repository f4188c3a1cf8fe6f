"""The cluster recipes of examples/cluster: the two SLURM batch scripts run as they are, with bash, on one machine
posing as two nodes. A stand-in ``srun`` starts each job step's tasks as local processes (one per node, with the
SLURM variables a real step gives them) and a stand-in ``scontrol`` names 127.0.0.1 for every node, so torchrun's
rendezvous, the Lighthouse and the replicas all meet on loopback. The Kubernetes manifest is only parsed."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from adloco.metrics.records import read_metrics
from tests.api.test_replica import needs_torchft
from tests.comm.test_distributed import _env, _free_port
from tests.conftest import FAST, final_params, process_tree, same_params

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster"
NODES = 2
JOB_ID = "4242"
DEADLINE_S = 150  # a whole batch script; each takes 10 to 25 s here

# srun as far as the recipes use it: options before the command, every one written --name or --name=value
SRUN = '''#!{python}
"""A stand-in for SLURM's srun on one machine: each task of the step is a local process."""
import json, os, signal, subprocess, sys

args, options = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    name, _, value = args.pop(0).partition("=")
    options[name] = value
nodes = int(options.get("--nodes", os.environ["SLURM_NNODES"]))
if "--ntasks" in options:
    tasks = [t % nodes for t in range(int(options["--ntasks"]))]
else:
    tasks = [n for n in range(nodes) for _ in range(int(options.get("--ntasks-per-node", "1")))]
with open(os.environ["SRUN_LOG"], "a") as log:
    log.write(json.dumps({{"options": options, "command": args, "nodes": tasks}}) + "\\n")
procs = []
for task, node in enumerate(tasks):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(task), SLURM_LOCALID="0",
               SLURM_NNODES=str(nodes), SLURM_NTASKS=str(len(tasks)))
    procs.append(subprocess.Popen(args, env=env))


def forward(number, frame):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(number)


for number in (signal.SIGTERM, signal.SIGINT):
    signal.signal(number, forward)
codes = [proc.wait() for proc in procs]
failed = [code for code in codes if code != 0]
sys.exit(0 if not failed else failed[0] if failed[0] > 0 else 128 - failed[0])
'''

SCONTROL = """#!/bin/bash
# A stand-in for SLURM's scontrol: `show hostnames LIST` names 127.0.0.1 for every node of the job.
[ "$1" = show ] && [ "$2" = hostnames ] || { echo "scontrol stand-in: only 'show hostnames'" >&2; exit 2; }
for _ in $(seq 1 "$SLURM_NNODES"); do echo 127.0.0.1; done
"""

# gloo on loopback, one thread per process; no progress bars or plots
TINY = [*FAST, "threads=1"]


def _slurm_env(tmp_path: Path, **settings: str) -> dict:
    """The batch script's environment as sbatch gives it (2 nodes), with the stand-ins first on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in _env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID=JOB_ID, SLURM_NNODES=str(NODES),
               SLURM_JOB_NODELIST=f"node[0-{NODES - 1}]", SRUN_LOG=str(tmp_path / "srun.jsonl"),
               PYTHON=sys.executable, RUN_ROOT=str(tmp_path / "runs"), GPUS_PER_NODE="1", RUST_LOG="error")  # fmt: skip
    env.update(settings)
    return env


def _sbatch(script: str, args: list[str], env: dict, cwd: Path) -> tuple[int, str, str]:
    """``bash SCRIPT ARGS`` as sbatch would run it on the first node; the script and everything it started are
    killed at the deadline."""
    proc = subprocess.Popen(["bash", str(CLUSTER / "slurm" / script), *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        for pid in process_tree(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {DEADLINE_S} s)"
    return proc.returncode, out, err


def _steps(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "srun.jsonl").read_text().splitlines()]


@pytest.mark.process
def test_the_torchrun_batch_script_trains_across_two_nodes(tmp_path):
    """One srun of a torchrun launcher per node; the launchers meet at the first node's c10d rendezvous under
    the job's id, and the job's 2 ranks (one per node) train one run to its end."""
    port = str(_free_port())
    flags = "--local-addr=127.0.0.1 --monitor-interval=0.1"  # the ranks' MASTER_ADDR: loopback, so gloo's too
    env = _slurm_env(tmp_path, PORT=port, MAX_RESTARTS="1", TORCHRUN_ARGS=flags)
    start = time.monotonic()
    code, out, err = _sbatch("train.sbatch", [*TINY, "comm.backend=gloo", "run.name=job"], env, tmp_path)
    assert code == 0, err[-3000:]
    assert time.monotonic() - start < DEADLINE_S
    (step,) = _steps(tmp_path)  # one job step, on both nodes
    assert step["nodes"] == [0, 1] and step["options"]["--ntasks-per-node"] == "1"
    launcher = step["command"]
    assert launcher[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={JOB_ID}", "--max-restarts=1"} <= set(launcher)  # fmt: skip
    run_dir = tmp_path / "runs" / "job"
    assert (run_dir / "final" / "model.safetensors").exists() and (run_dir / "config.yaml").exists()
    assert "final validation loss" in out
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["workers"] == 2 and config["comm"]["backend"] == "gloo"
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert rounds and all(len(r["ranks"]) == 2 for r in rounds)  # both nodes' ranks in every round
    # torchrun's run id is the SLURM job's: a restarted attempt would find this run through it
    pointer = tmp_path / "runs" / ".jobs" / JOB_ID
    assert Path(pointer.read_text().strip()) == run_dir.resolve()


@pytest.mark.process
@needs_torchft
def test_the_replica_batch_script_runs_a_lighthouse_and_one_replica_per_node(tmp_path):
    """The Lighthouse as a step of one task, then a step of one replica per node (one process each), indexed by
    SLURM_NODEID; both replicas commit every round together and end on the same θ; the Lighthouse is stopped."""
    env = _slurm_env(tmp_path, LIGHTHOUSE_PORT=str(_free_port()), LIGHTHOUSE_BIND="127.0.0.1", LIGHTHOUSE_WAIT_S="60")
    replica = ["fault_tolerance.host=127.0.0.1", "fault_tolerance.quorum_timeout_s=60"]
    code, out, err = _sbatch("replicas.sbatch", [*TINY, *replica], env, tmp_path)
    assert code == 0, err[-3000:]
    lighthouse, replicas = _steps(tmp_path)
    assert lighthouse["nodes"] == [0] and lighthouse["command"][1:4] == ["-m", "adloco", "lighthouse"]
    assert "--overlap" in lighthouse["options"]
    assert replicas["nodes"] == [0, 1]
    assert f"fault_tolerance.lighthouse=http://127.0.0.1:{env['LIGHTHOUSE_PORT']}" in replicas["command"]
    assert {"fault_tolerance.replicas=2", "fault_tolerance.min_replicas=2", "shards=1"} <= set(replicas["command"])
    job = tmp_path / "runs" / f"replicas-{JOB_ID}"
    for r in range(NODES):
        assert re.search(rf"^replica {r}: final validation loss", out, re.M), out[-2000:]
        records = [x for x in read_metrics(job / f"replica{r}" / "metrics.jsonl") if x["kind"] == "round"]
        assert len(records) >= 2 and all(x["participants"] == 2 and x["committed"] for x in records)
    assert same_params(final_params(job / "replica0"), final_params(job / "replica1"))
    assert "lighthouse stopped" in err  # ended by the script, not left to the end of the allocation


def test_the_batch_scripts_give_slurm_their_settings_before_any_command():
    """sbatch reads #SBATCH lines only up to the first command; each script asks for nodes, one task per node,
    GPUs and a time limit there."""
    for name in ("train.sbatch", "replicas.sbatch"):
        lines = (CLUSTER / "slurm" / name).read_text().splitlines()
        assert lines[0] == "#!/bin/bash"
        first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
        header = [line.split()[1].split("=")[0] for line in lines[:first_command] if line.startswith("#SBATCH")]
        assert {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--time"} <= set(header), name
        assert not any(line.startswith("#SBATCH") for line in lines[first_command:]), name


@pytest.mark.process
def test_the_kubernetes_manifest_is_a_headless_service_and_an_indexed_job_meeting_at_pod_0():
    service, job = yaml.safe_load_all((CLUSTER / "kubernetes" / "train.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == job["spec"]["completions"]
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["JOB_NAME"] == job["metadata"]["name"] and env["SERVICE"] == service["metadata"]["name"]
    assert int(env["NNODES"]) == job["spec"]["completions"]
    assert int(env["GPUS_PER_NODE"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    script = container["command"][2]
    assert 'HEAD="$JOB_NAME-0.$SERVICE"' in script and '--rdzv-endpoint="$HEAD:$PORT"' in script
    assert "--rdzv-backend=c10d" in script and "--node-rank" not in script
    assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0
