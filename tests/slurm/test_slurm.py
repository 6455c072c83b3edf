"""SLURM end to end on a real cluster (``.ci/run`` starts a single-node one as root):
``slurm/train.sbatch`` runs a 2-rank DDP job into the job-id-named run folder,
``hydra/launcher=slurm`` runs a sweep as an array job, and a job (or a sweep's array task)
sent SIGUSR1 checkpoints, requeues itself and its restart resumes from that checkpoint in the
same folder. CPU, tiny model, few steps. Without a responding cluster they skip, saying why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf
import torch
import yaml

from tests import recorder
from tests.conftest import ROOT, compose_train
from tests.train.helpers import metric_rows

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "slurm" / "train.sbatch"
# What every job trains: the tiny model on the sample data, short sequences, on CPU.
TINY = ["trainer.accelerator=cpu", "data.max_length=96", "data.val_fraction=0", "trainer.enable_progress_bar=false",
        "logger=csv"]
RECORD = ["+callbacks.record._target_=tests.recorder.Recorder", "+callbacks.record.path=${run_dir}/record"]
# CPU resources for one sbatch job: no GPUs (the script asks for 8 by default), 1 CPU a rank.
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--mem=4G", "--time=10"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


def _slurm_conf() -> str | None:
    """$SLURM_CONF, else the system config, else the one tools/local-slurm/start.sh wrote."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    if any(Path(p).exists() for p in ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")):
        return None
    for base in (os.environ.get("LOCAL_SLURM_DIR"), f"{os.environ.get('TMPDIR', '/tmp')}/local-slurm",
                 "/tmp/local-slurm"):
        if base and (Path(base) / "etc" / "slurm.conf").exists():
            return str(Path(base) / "etc" / "slurm.conf")
    return None


def _cluster_env() -> dict[str, str]:
    # Drop SLURM variables of an enclosing allocation (pytest run inside a job) so that
    # they cannot leak into the jobs submitted here.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    conf = _slurm_conf()
    if conf:
        env["SLURM_CONF"] = conf
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    # Keep freed memory in the process: 2-3x faster CPU steps (docs/stack.md).
    env.setdefault("MALLOC_MMAP_MAX_", "0")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "68719476736")
    env.setdefault("MALLOC_TOP_PAD_", "1073741824")
    return env


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    """The environment to talk to a responding cluster with accounting; skips otherwise."""
    for tool in ("sinfo", "sbatch", "squeue", "scancel", "scontrol", "sacct"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` not found: no SLURM client here (.ci/run starts a local cluster when run as root)")
    env = _cluster_env()
    try:
        info = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %c"], env=env, capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        pytest.skip("no SLURM cluster responds: `sinfo` timed out after 20 s")
    if info.returncode != 0:
        pytest.skip(f"no SLURM cluster responds: `sinfo` failed: {info.stderr.strip()}")
    nodes = [line.split() for line in info.stdout.splitlines() if line.strip()]
    usable = [n for n in nodes if n[1] in ("idle", "mixed", "allocated", "completing")]  # "idle*": not responding
    if not usable:
        pytest.skip(f"SLURM responds but no node is up: {info.stdout.strip() or 'no nodes'}")
    if max(int(n[2]) for n in usable) < 2:
        pytest.skip("the 2-rank jobs need a node with at least 2 CPUs")
    config = subprocess.run(["scontrol", "show", "config"], env=env, capture_output=True, text=True, timeout=20,
                            check=True).stdout
    if re.search(r"AccountingStorageType\s*=\s*accounting_storage/none", config):
        pytest.skip("SLURM accounting is off (sacct/submitit need it); local-slurm: LOCAL_SLURM_ACCOUNTING=1")
    return env


@pytest.fixture
def job_name(cluster: dict[str, str]) -> Iterator[str]:
    """A unique job name; every job of the test carries it and is cancelled at teardown,
    whatever happened (a no-op for jobs that have finished)."""
    name = f"rolemrc-pytest-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", "--name", name], env=cluster, capture_output=True, timeout=30)


def _run(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}"
    return done.stdout.strip()


def sbatch(env: dict[str, str], workdir: Path, name: str, *args: str) -> str:
    """Submit slurm/train.sbatch from the repository root, running in ``workdir``; the job id."""
    cmd = ["sbatch", "--parsable", f"--chdir={workdir}", f"--job-name={name}", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"sbatch failed: {done.stderr.strip()}"
    return done.stdout.strip().split(";")[0]


def queue_state(env: dict[str, str], job: str) -> str:
    """The job's state in the queue (PENDING, RUNNING, ...), "" once it has left it."""
    done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True,
                          timeout=30)
    return done.stdout.strip() if done.returncode == 0 else ""


def log_tail(workdir: Path, name: str, job: str) -> str:
    log = workdir / f"{name}-{job}.out"
    return log.read_text()[-4000:] if log.exists() else f"(no job log at {log})"


def wait_until_gone(env: dict[str, str], job: str, timeout: float, why: str = "") -> None:
    deadline = time.monotonic() + timeout
    while queue_state(env, job):
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout:.0f} s. {why}"
        time.sleep(0.5)


def accounted_states(env: dict[str, str], job: str, expect: int = 1, timeout: float = 60) -> list[tuple[str, str]]:
    """(JobID, State) of each run of ``job`` (array tasks and requeued runs included) from
    sacct, once ``expect`` runs have a final state (accounting lags the queue a little)."""
    deadline = time.monotonic() + timeout
    while True:
        out = _run(["sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "JobID,State"], env)
        rows = [(jid, state.split()[0]) for jid, state in (line.split("|") for line in out.splitlines())]
        if sum(state in TERMINAL or state == "REQUEUED" for _, state in rows) >= expect:
            return rows
        assert time.monotonic() < deadline, f"sacct has no final state for {expect} run(s) of {job}: {rows}"
        time.sleep(1)


def test_slurm_launcher_takes_its_resources_from_the_composed_trainer() -> None:
    # Needs no cluster: hydra/launcher=slurm composes with conf/hydra/default.yaml and an experiment.
    cfg = compose_train(["hydra/launcher=slurm", "experiment=rolemrc_llama_sft", "trainer.num_nodes=2"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 4, 4)
    # SLURM's warning signal goes to Lightning (checkpoint + requeue), not to submitit.
    assert launcher["additional_parameters"] == {"signal": "USR1@120", "requeue": True}
    assert all("${" not in line for line in launcher["setup"])


def test_sbatch_runs_two_rank_ddp_job_into_job_id_folder(cluster: dict[str, str], job_name: str,
                                                          tmp_path: Path) -> None:
    job = sbatch(cluster, tmp_path, job_name, "--ntasks-per-node=2", *CPU_JOB, str(SCRIPT), "strategy=ddp", *TINY,
                 "trainer.max_steps=6", "trainer.max_epochs=5", *RECORD)
    wait_until_gone(cluster, job, 300, log_tail(tmp_path, job_name, job))
    assert accounted_states(cluster, job) == [(job, "COMPLETED")], log_tail(tmp_path, job_name, job)

    # Both ranks ran in the one folder named after the job (conf/hydra/default.yaml).
    run = tmp_path / "outputs" / "train" / job
    trainer = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["trainer"]
    assert (trainer["num_nodes"], trainer["devices"]) == (1, 2)  # set by the script from SLURM
    ranks = [recorder.read(run / "record", rank) for rank in (0, 1)]
    for records in ranks:
        assert records[0] == {"event": "start", "local_params": records[0]["full_params"],
                              "full_params": records[0]["full_params"], "world_size": 2, "global_step": 0}
        assert [r["step"] for r in records[1:]] == list(range(1, 7))
    for step0, step1 in zip(ranks[0][1:], ranks[1][1:]):  # DDP: each rank trains on its own share
        assert not set(step0["index"]) & set(step1["index"])
    export = run / "export"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    assert f"exported model: {export}" in log_tail(tmp_path, job_name, job)


def test_sweep_runs_as_slurm_array_job(cluster: dict[str, str], job_name: str, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "optim.lr=1e-3,2e-3", *TINY,
           "trainer.max_steps=4", f"hydra.sweep.dir={sweep}", f"hydra.launcher.name={job_name}",
           "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=3",
           "hydra.launcher.timeout_min=10"]
    done = subprocess.run(cmd, cwd=ROOT, env=cluster, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]

    # One array job with a task per value, each run in its own <sweep>/<job num> folder.
    tasks = sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    array = {t.split("_")[0] for t in tasks}
    assert len(array) == 1 and [t.split("_")[1] for t in tasks] == ["0", "1"], tasks
    (array_id,) = array
    assert accounted_states(cluster, array_id, expect=2) == [(f"{array_id}_0", "COMPLETED"),
                                                            (f"{array_id}_1", "COMPLETED")]
    lr_seen = []
    for num, lr in enumerate([1e-3, 2e-3]):
        run = sweep / str(num)
        assert f"optim.lr={lr:g}" in (run / ".hydra" / "overrides.yaml").read_text()
        assert (run / "export" / "model.safetensors").is_file()
        rows = metric_rows(run)
        assert max(r["step"] for r in rows if "train/loss" in r) == 3  # steps 0..3 logged: 4 steps
        lr_seen.append([r["lr-AdamW"] for r in rows if "lr-AdamW" in r])
    # Same schedule, twice the peak learning rate.
    assert lr_seen[0] and lr_seen[1] == pytest.approx([2 * x for x in lr_seen[0]])


# Two ranks: rolemrc's SlurmRequeue checkpoints at a step boundary on all ranks together
# (Lightning's own handler, checkpointing inside the signal handler, could deadlock here).
REQUEUE_TASKS = 2
REQUEUE_STEPS = 30


def preempt_mid_run(env: dict[str, str], job: str, record: Path, why: Callable[[], str]) -> None:
    """Once ``job`` has trained a few steps, send it what ``--signal=USR1@<s>`` sends before the
    time limit, wait until it is back in the queue, and start it again without SLURM's wait."""
    deadline = time.monotonic() + 300
    while len([r for r in recorder.read(record) if r["event"] == "step"]) < 3:
        assert queue_state(env, job) in ("PENDING", "RUNNING"), f"job {job} ended before step 3: {why()}"
        assert time.monotonic() < deadline, f"job {job} did not reach step 3: {why()}"
        time.sleep(0.1)
    _run(["scancel", "--signal=USR1", job], env)
    # Lightning saves hpc_ckpt_1.ckpt and runs `scontrol requeue`: the job goes back to PENDING.
    deadline = time.monotonic() + 120
    while (state := queue_state(env, job)) != "PENDING":
        assert state, f"job {job} left the queue instead of requeueing: {why()}"
        assert time.monotonic() < deadline, f"job {job} not requeued within 120 s (state {state}): {why()}"
        time.sleep(0.2)
    # SLURM holds a requeued job for ~2 minutes (BeginTime) so that the node is done with the
    # old run; start it sooner, but not too soon: slurmd revokes the old run's credential at
    # one-second resolution, and a restart allocated within that same second is killed
    # ("Job credential revoked") and ends FAILED. So wait for the node to leave COMPLETING and
    # for the wall clock to pass the revocation's second by a safe margin.
    requeued_at = time.monotonic()
    while "completing" in _run(["sinfo", "-h", "-N", "-o", "%T"], env) or time.monotonic() < requeued_at + 2.5:
        assert time.monotonic() < deadline, f"node still completing job {job} after 120 s: {why()}"
        time.sleep(0.2)
    _run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env)


def assert_resumed(run: Path, ranks: int, max_steps: int) -> None:
    """Two runs in ``run``: the restart began at the preemption checkpoint's step and
    trained on to ``max_steps``, from where the data had got to."""
    checkpoint = torch.load(run / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)
    resumed_from = checkpoint["global_step"]
    assert 0 < resumed_from < max_steps
    for rank in range(ranks):
        records = recorder.read(run / "record", rank)
        starts = [i for i, r in enumerate(records) if r["event"] == "start"]
        assert len(starts) == 2, "one start per run of the job"
        first, restart = records[starts[0]], records[starts[1]]
        assert first["global_step"] == 0 and restart["global_step"] == resumed_from
        assert restart["world_size"] == ranks
        before = {r["step"]: r for r in records[: starts[1]] if r["event"] == "step"}
        after = [r for r in records[starts[1]:] if r["event"] == "step"]
        assert [r["step"] for r in after] == list(range(resumed_from + 1, max_steps + 1))
        if resumed_from + 1 in before:  # the first run got on past the checkpoint: same batch again
            assert after[0]["index"] == before[resumed_from + 1]["index"]


def test_sigusr1_checkpoints_requeues_and_resumes(cluster: dict[str, str], job_name: str, tmp_path: Path) -> None:
    strategy = "strategy=ddp" if REQUEUE_TASKS > 1 else "strategy=single"
    job = sbatch(cluster, tmp_path, job_name, f"--ntasks-per-node={REQUEUE_TASKS}", *CPU_JOB, str(SCRIPT), strategy,
                 *TINY, f"trainer.max_steps={REQUEUE_STEPS}", "trainer.max_epochs=100", "export.enabled=false",
                 *RECORD)
    run = tmp_path / "outputs" / "train" / job

    def why() -> str:
        return log_tail(tmp_path, job_name, job)

    preempt_mid_run(cluster, job, run / "record", why)
    wait_until_gone(cluster, job, 300, why())
    assert accounted_states(cluster, job, expect=2) == [(job, "REQUEUED"), (job, "COMPLETED")], why()
    assert_resumed(run, REQUEUE_TASKS, REQUEUE_STEPS)


def test_preempted_sweep_task_requeues_and_resumes_in_its_folder(cluster: dict[str, str], job_name: str,
                                                                 tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "optim.lr=1e-3,2e-3", *TINY,
           f"trainer.max_steps={REQUEUE_STEPS}", "trainer.max_epochs=100", "export.enabled=false", *RECORD,
           f"hydra.sweep.dir={sweep}", f"hydra.launcher.name={job_name}", "hydra.launcher.gpus_per_node=0",
           "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=3", "hydra.launcher.timeout_min=10"]
    launcher_log = tmp_path / "launcher.log"
    with launcher_log.open("w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=cluster, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (tasks := sorted((sweep / ".submitit").glob("*_0"))):
            assert launcher.poll() is None, launcher_log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the sweep submitted no array job"
            time.sleep(0.2)
        task = tasks[0].name
        array_id = task.split("_")[0]

        def why() -> str:
            logs = sorted(tasks[0].glob("*_log.*"))
            return "\n".join(f"== {f}\n{f.read_text()[-2000:]}" for f in logs)

        preempt_mid_run(cluster, task, sweep / "0" / "record", why)
        assert launcher.wait(timeout=300) == 0, launcher_log.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    states = accounted_states(cluster, array_id, expect=3)
    assert sorted(states) == [(task, "COMPLETED"), (task, "REQUEUED"), (f"{array_id}_1", "COMPLETED")], states
    assert_resumed(sweep / "0", 1, REQUEUE_STEPS)  # the requeued task, in its own folder
    untouched = recorder.read(sweep / "1" / "record")
    assert [r["event"] for r in untouched].count("start") == 1
    assert untouched[-1]["step"] == REQUEUE_STEPS
