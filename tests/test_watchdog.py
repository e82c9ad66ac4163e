"""The fault detector (``ckptbridge.Watchdog``): its judgement on beat histories, then real
four-rank gloo jobs (FSDP2, the job's own TCPStore): no false alarm over 200 healthy steps
with jitter, a straggler injected by a sleep flagged by every rank, a rank whose training
raises named ``failed`` (exit 69, the others 75), a rank whose main thread hangs named ``hung``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from _elastic_harness import example, run_group

import ckptbridge
import ckptbridge.health
from ckptbridge.health import (
    Beat,
    Peer,
    PeerSeen,
    StragglerTracker,
    assess,
    busy_per_step,
    hung,
    observe,
    stragglers,
)

pytestmark = pytest.mark.serial  # detection latencies: run alone (Makefile `test`)
POLICY = ckptbridge.WatchdogPolicy()


# ---------------------------------------------------------------- judgement (pure)


def _seen(**beats: tuple[int, float, int]) -> dict[int, PeerSeen]:
    """rank -> (seq, since, observer beats then)."""
    return {int(r[1:]): PeerSeen(Beat(seq, 10), since, mine) for r, (seq, since, mine) in beats.items()}


def test_beat_round_trips_and_rejects_garbage() -> None:
    b = Beat(7, 41, 0.07, 0.004, -1.5)
    assert Beat.decode(b.encode()) == b and Beat.decode(b.encode().encode()) == b
    assert Beat.decode("") is None and Beat.decode("1 2 x - 0") is None and Beat.decode("1 2 - -") is None
    assert Beat.decode(Beat(1, -1).encode()) == Beat(1, -1, None, None, 0.0)


def test_a_silent_rank_is_named_after_hang_periods_while_the_observer_beats() -> None:
    peers = {r: Peer(r, "h", 100 + r) for r in range(3)}
    hang = POLICY.hang_periods * POLICY.min_period  # 0.5 s (no step history: P = startup 5 s -> 10 s)
    seen = {r: PeerSeen(Beat(50, 10, 0.07), 100.0, 0) for r in range(3)}
    seen[1] = PeerSeen(Beat(20, 9, 0.07), 100.0 - hang, 0)
    found = assess(seen, peers, now=100.0, wall=0.0, my_beats=10, me=0, policy=POLICY, procs={})
    assert [(v.rank, v.kind, v.pid) for v in found] == [(1, "unresponsive", 101)]
    # just under the threshold, or an observer that did not beat meanwhile (itself starved): nobody
    seen[1] = PeerSeen(Beat(20, 9, 0.07), 100.0 - 0.9 * hang, 0)
    assert assess(seen, peers, now=100.0, wall=0.0, my_beats=10, me=0, policy=POLICY, procs={}) == []
    seen[1] = PeerSeen(Beat(20, 9, 0.07), 100.0 - hang, 9)
    assert assess(seen, peers, now=100.0, wall=0.0, my_beats=10, me=0, policy=POLICY, procs={}) == []
    # same host: what the process is doing labels the verdict; a vanished process is named at once
    seen[1] = PeerSeen(Beat(20, 9, 0.07), 100.0 - hang, 0)
    stopped = assess(seen, peers, now=100.0, wall=0.0, my_beats=10, me=0, policy=POLICY, procs={1: "stopped"})
    assert [v.kind for v in stopped] == ["stopped"]
    seen[1] = PeerSeen(Beat(20, 9, 0.07), 100.0 - 2.5 * POLICY.interval, 8)
    gone = assess(seen, peers, now=100.0, wall=0.0, my_beats=10, me=0, policy=POLICY, procs={1: "gone"})
    assert [v.kind for v in gone] == ["dead"]
    assert POLICY.bound(POLICY.period(0.07)) == pytest.approx(0.75)
    assert POLICY.bound(POLICY.period(2.0)) == pytest.approx(6.0)


def test_observe_restarts_a_peers_clock_only_when_its_beat_changes() -> None:
    seen = observe({}, {0: Beat(1, 0), 1: Beat(1, 0)}, 10.0, 3)
    seen = observe(seen, {0: Beat(2, 0), 1: Beat(1, 0)}, 11.0, 4)
    assert (seen[0].since, seen[0].my_beats, seen[1].since, seen[1].my_beats) == (11.0, 4, 10.0, 3)


def test_straggler_and_hung_rules() -> None:
    beats = {r: Beat(5, 9, 0.10, 0.010) for r in range(4)}
    assert stragglers(beats, POLICY) == {}
    beats[2] = Beat(5, 9, 0.10, 0.045)
    assert list(stragglers(beats, POLICY)) == [2]
    beats[2] = Beat(5, 9, 0.10, 0.019)  # 1.9x: under the factor
    assert stragglers(beats, POLICY) == {}
    tracker, crossed = StragglerTracker(), []
    for _ in range(POLICY.straggler_beats):
        tracker, crossed = tracker.update({2: "slow"}, POLICY)
    assert crossed == [2]
    assert busy_per_step([0.1, 0.1, 0.1], [(10, 9), (10, 9), (10, 9)]) == pytest.approx(0.01)
    limit = POLICY.hung_periods * POLICY.min_period
    peers = {r: Peer(r, "h", r) for r in range(3)}
    seen = {0: PeerSeen(Beat(9, 3, 0.07, None, limit), 0, 0), 1: PeerSeen(Beat(9, 3, 0.07, None, -limit), 0, 0),
            2: PeerSeen(Beat(9, 3, 0.07, None, limit / 2), 0, 0)}
    assert [(v.rank, v.kind) for v in hung(seen, peers, wall=0.0, me=0, policy=POLICY)] == [(1, "hung")]
    seen[2] = PeerSeen(Beat(9, 3, 0.07, None, -1.0), 0, 0)  # someone else is busy too: no culprit
    assert hung(seen, peers, wall=0.0, me=0, policy=POLICY) == []


def test_checkpointer_abandon_gives_up_on_a_failed_rank_at_once(tmp_path: Path) -> None:
    """Rank 0 of two commits a step only with rank 1's pieces; once rank 1 is abandoned the save
    fails at once instead of after commit_timeout, and nothing is committed."""
    import numpy as np

    ck = ckptbridge.Checkpointer(tmp_path, rank=0, world_size=2, commit_timeout=60, job_id="t")
    ck.save(3, {"w": np.arange(8, dtype=np.float32)})
    time.sleep(0.3)  # the flush waits for rank 1's manifest
    t0 = time.monotonic()
    ck.abandon([1])
    with pytest.raises(ckptbridge.CheckpointError, match=r"ranks \[1\] failed"):
        ck.wait()
    assert time.monotonic() - t0 < 5 and ck.latest() is None
    ck.close()


def test_import_does_not_load_torch_or_jax() -> None:
    import subprocess
    import sys

    code = "import ckptbridge, sys; ckptbridge.Watchdog; ckptbridge.EXIT_RESTART; print('torch' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_job_store_comes_from_the_runtime_registered_for_it() -> None:
    """``store=`` is served by the runtime registered in the ``ckptbridge.job_stores`` group
    (torch: a real TCPStore on 127.0.0.1, the rank's beats land in it); an object no runtime
    serves is refused, naming its type."""
    import datetime
    import importlib.metadata
    import os

    import torch.distributed as dist

    assert {e.name for e in importlib.metadata.entry_points(group="ckptbridge.job_stores")} >= {"torch", "jax"}
    with pytest.raises(ckptbridge.WatchdogError, match="no installed runtime serves a builtins.object"):
        ckptbridge.Watchdog(store=object(), rank=0, world_size=1, startup_timeout=1).start()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    wd = ckptbridge.Watchdog(store=server, rank=0, world_size=1, job="t", exit_on_fault=False, startup_timeout=5)
    with wd:
        for s in range(3):
            time.sleep(0.05)
            wd.step(s)
        time.sleep(0.3)
    assert wd.verdicts == [] and wd.peers[0].pid == os.getpid()
    beat = ckptbridge.health.Beat.decode(server.get("ckptbridge/watchdog/t/0//beat/0").decode())
    assert beat is not None and beat.seq > 0 and beat.step == 2, beat


# ---------------------------------------------------------------- real jobs


def _job(rank: int, world: int, out: str, scenario: str) -> None:
    """A four-rank FSDP2 job (the example's model and batches) under a Watchdog."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(example.D_IN, example.HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(example.HIDDEN, example.D_OUT))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record: dict = {"stragglers": [], "verdicts": []}

    def save() -> None:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))

    def on_fault(verdicts: list) -> None:
        record["verdicts"] = [json.loads(v.encode()) for v in verdicts]
        save()

    policy = ckptbridge.WatchdogPolicy(hung_periods=6.0) if scenario == "hang" else None
    wd = ckptbridge.Watchdog(policy=policy, on_fault=on_fault, exit_on_fault=scenario != "pattern",
                             on_straggler=lambda v: record["stragglers"].append((v.rank, record["step"])))
    rng = random.Random(rank)
    per = example.GLOBAL_BATCH // world
    with wd:
        healthy, straggling = (200, 120) if scenario == "pattern" else (30, 0)
        for step in range(healthy + straggling):
            record["step"] = step
            if scenario == "raise" and rank == 3 and step == 5:
                raise RuntimeError("injected failure on rank 3")
            if scenario == "hang" and rank == 1 and step == 10:
                time.sleep(3600)  # the main thread is stuck; the process lives and beats
            time.sleep(rng.uniform(0, 0.005))  # normal jitter
            if step >= healthy and rank == 2:
                time.sleep(0.04)  # the straggler
            x, y = example.batch(step)
            xb, yb = torch.from_numpy(x[rank * per:(rank + 1) * per]), torch.from_numpy(y[rank * per:(rank + 1) * per])
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            wd.step(step)
            if step == healthy - 1:
                record["healthy"] = {"verdicts": [v.encode() for v in wd.verdicts], "stragglers": list(record["stragglers"]),
                                     "period": wd.period}
    dist.barrier()
    dist.destroy_process_group()
    save()


def _records(out: Path, world: int = 4) -> dict[int, dict]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if (out / f"rank{r}.json").exists()}


def test_no_false_alarm_over_200_healthy_steps_then_a_straggler_is_flagged(tmp_path: Path) -> None:
    codes = run_group(_job, 4, (str(tmp_path), "pattern"), tmp_path)
    logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(4))
    assert codes == [0, 0, 0, 0], logs[-3000:]
    recs = _records(tmp_path)
    for rank, rec in recs.items():
        assert rec["healthy"]["verdicts"] == [] and rec["healthy"]["stragglers"] == [], (rank, rec)
        assert rec["verdicts"] == [], rec  # nothing fatal at any time
        flagged = {r for r, _ in rec["stragglers"]}
        assert flagged == {2}, (rank, rec["stragglers"])  # only the sleeping rank, by every rank
    first = max(min(s for _, s in rec["stragglers"]) for rec in recs.values()) - 200
    assert logs.count("rank 2 on host") == 1 and "is a straggler" in logs  # one log line names it
    print(f"straggler flagged by every rank within {first} of its 120 slow steps; "
          f"step period {recs[0]['healthy']['period'] * 1e3:.0f} ms")


def test_a_rank_whose_training_raises_is_named_and_exits_69_the_others_75(tmp_path: Path) -> None:
    codes = run_group(_job, 4, (str(tmp_path), "raise"), tmp_path)
    logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(4))
    assert codes == [75, 75, 75, 69], (codes, logs[-3000:])
    for rank, rec in _records(tmp_path).items():
        assert [(v["rank"], v["kind"]) for v in rec["verdicts"]] == [(3, "failed")], (rank, rec)
    assert "injected failure on rank 3" in logs


def test_a_rank_whose_main_thread_hangs_is_named_hung_and_isolated(tmp_path: Path) -> None:
    t0 = time.time()
    codes = run_group(_job, 4, (str(tmp_path), "hang"), tmp_path)
    logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(4))
    # rank 1 is killed by the isolating rank, unless it reads the verdict first and leaves with 69
    assert codes[0] == codes[2] == codes[3] == 75 and codes[1] in (-9, 69), (codes, logs[-3000:])
    recs = _records(tmp_path)
    for rank in (0, 2, 3):
        assert [(v["rank"], v["kind"]) for v in recs[rank]["verdicts"]] == [(1, "hung")], recs[rank]
    assert time.time() - t0 < 120
