"""Data faults: the DVC remote lost during a snapshot (``snapshot``), the poison zoo (``poison``).

``snapshot`` — DVC pushes to an S3 remote (a local ``moto_server``) through a TCP proxy this module
controls, so the remote can vanish and come back without losing what it already holds (a killed
moto server would forget its whole bucket). Per trial the remote is either unreachable for the
whole snapshot or cut after a seeded number of uploaded bytes, mid-push. ``kiln.data.snapshot`` must
raise, record nothing and leave no ``.dvc`` file naming data that is not on the remote; once the
remote is back the same snapshot must succeed, once. After every trial each recorded snapshot is
checked object by object on the remote itself (not through the proxy): a record with an object
missing is a partial snapshot (goal 0).

``poison`` — a corpus (``kiln.data.corpus.build_corpus``) with a seeded combination of poison kinds in
seeded shard positions is validated (``kiln.data.validation``, Great Expectations), the TrainingManifest
built from the reports and the real trainer run on it. Then a poisoned file is swapped in for a
healthy shard *after* validation (the time-of-check/time-of-use gap): the trainer's sha256 check
must refuse it with a diagnosed fault (exit 2), not train on it and not crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kiln.util.net import free_port
from kiln_devtools.chaos.core import Context, Family, TrialResult, outcome_line, total, trial_rng
from kiln_devtools.chaos.fixtures import SNAPSHOT_ID, run_trainer
from kiln_devtools.moto import MotoServer

# ------------------------------------------------------------------------------------------ poison

POISON_TRAIN = ("train.steps=6", "checkpoint.every_steps=3", "train.log_every=3", "optim.warmup_steps=2")
MAX_POISONS = 6


def plan_poison(seed: int, index: int) -> dict[str, Any]:
    from kiln.data.corpus import POISON_KINDS

    rng = trial_rng(seed, "poison", index)
    kinds = rng.sample(sorted(POISON_KINDS), rng.randint(1, MAX_POISONS))
    # At least two clean shards: one to train on, one to donate ids to a cross-shard duplicate.
    return {"kinds": kinds, "shards": len(kinds) + rng.randint(2, 4), "corpus_seed": rng.randrange(10**6)}


def poison_trial(ctx: Context, index: int, contract: Any) -> TrialResult:
    from kiln.data.corpus import build_corpus
    from kiln.data.validation import build_training_manifest, validate_directory

    plan = plan_poison(ctx.seed, index)
    fault = (f"{len(plan['kinds'])} poison(s) {','.join(plan['kinds'])} in {plan['shards']} shards"
             f" (corpus seed {plan['corpus_seed']})")
    root = ctx.work / f"poison-{index}"
    shutil.rmtree(root, ignore_errors=True)
    built = build_corpus(root / "corpus", shards=plan["shards"], seed=plan["corpus_seed"], poison=plan["kinds"],
                         max_bytes=600_000)
    poisoned = {str((root / "corpus" / rel).resolve()) for rel in built["poisoned"]}
    reports = validate_directory(root / "corpus", contract)
    quarantined = {str(Path(r.path).resolve()) for r in reports if r.verdict != "healthy"}
    facts: dict[str, Any] = {
        "poisons": len(poisoned),
        "shards": plan["shards"],
        "poisons_passed_validation": len(poisoned - quarantined),
        "healthy_quarantined": len(quarantined - poisoned),
    }
    losses = []
    if poisoned - quarantined:
        kinds = [built["poisoned"][str(Path(p).relative_to((root / "corpus").resolve()))] for p in sorted(poisoned - quarantined)]
        losses.append(f"poisoned shard(s) passed validation: {kinds}")
    if quarantined - poisoned:
        losses.append(f"healthy shard(s) quarantined: {sorted(Path(p).name for p in quarantined - poisoned)}")
    manifest = build_training_manifest(SNAPSHOT_ID, "stdlib-py", contract, reports, eval_shards=built["eval"])
    manifest_path = manifest.write(root / "manifest.json")
    in_manifest = {str(Path(s["path"]).resolve()) for s in manifest.shards}
    facts["poisoned_in_manifest"] = len(in_manifest & poisoned)
    run = run_trainer(manifest_path, root / "run", list(POISON_TRAIN))
    facts["train_exit"] = run.returncode
    facts["worker_crashes"] = int(run.returncode not in (0, 2))
    if run.returncode != 0:
        losses.append(f"training on the validated manifest failed (exit {run.returncode}): {run.stderr.strip()[-300:]}")
    # The time-of-check/time-of-use gap: a poisoned file replaces a healthy shard after validation.
    if in_manifest and poisoned:
        victim = Path(sorted(in_manifest)[trial_rng(ctx.seed, "poison-swap", index).randrange(len(in_manifest))])
        source = Path(sorted(poisoned)[trial_rng(ctx.seed, "poison-src", index).randrange(len(poisoned))])
        original = victim.read_bytes()
        victim.write_bytes(source.read_bytes())
        try:
            swapped = run_trainer(manifest_path, root / "run-swapped", list(POISON_TRAIN))
        finally:
            victim.write_bytes(original)
        refused = swapped.returncode == 2 and "sha256 mismatch" in swapped.stderr
        facts.update(swap_exit=swapped.returncode, swap_refused=refused)
        facts["worker_crashes"] += int(swapped.returncode not in (0, 2))
        if swapped.returncode == 0:
            losses.append(f"trained on {source.name}'s poisoned bytes swapped in for {victim.name} after validation")
            facts["poisoned_trained_on"] = 1
        elif not refused:
            losses.append(f"the swapped shard ended the run with exit {swapped.returncode}, not the sha256 refusal: "
                          f"{swapped.stderr.strip()[-300:]}")
        fault += f"; then {source.name} swapped in for {victim.name}"
    facts["poisoned_trained_on"] = facts.get("poisoned_trained_on", 0) + facts["poisoned_in_manifest"]
    if facts["poisoned_in_manifest"]:
        losses.append(f"{facts['poisoned_in_manifest']} poisoned shard(s) listed in the TrainingManifest")
    return TrialResult(family="poison", index=index, seed=ctx.seed, outcome="lost" if losses else "recovered",
                       fault=fault, facts=facts, losses=losses)


def run_poison(ctx: Context, indices: list[int]) -> list[TrialResult]:
    from kiln.data.contracts import load_contract

    contract = load_contract("stdlib-py@1")
    results = []
    for index in indices:
        started = time.monotonic()
        try:
            result = poison_trial(ctx, index, contract)
        except Exception as exc:
            result = TrialResult(family="poison", index=index, seed=ctx.seed, outcome="error",
                                 fault=str(plan_poison(ctx.seed, index)), detail=f"{type(exc).__name__}: {exc}")
        result.seconds = round(time.monotonic() - started, 1)
        results.append(result)
        ctx.log(f"  {result.name:<12} {result.outcome:<9} {result.fault}  ({result.seconds:.0f}s)")
        if result.outcome == "recovered":
            shutil.rmtree(ctx.work / f"poison-{index}", ignore_errors=True)
    return results


def summarize_poison(results: list[TrialResult]) -> list[str]:
    swaps = [r for r in results if "swap_refused" in r.facts]
    return [
        outcome_line(results),
        f"poisoned shards placed: {total(results, 'poisons')} in {total(results, 'shards')} shards; passed validation: "
        f"{total(results, 'poisons_passed_validation')}; listed in a TrainingManifest: {total(results, 'poisoned_in_manifest')}",
        f"poisoned shards trained on: {total(results, 'poisoned_trained_on')} (goal 0), including "
        f"{len(swaps)} post-validation swaps, of which {sum(bool(r.facts['swap_refused']) for r in swaps)} refused by "
        "the trainer's sha256 check",
        f"healthy shards quarantined: {total(results, 'healthy_quarantined')} (goal 0)",
        f"worker crashes: {total(results, 'worker_crashes')} (goal 0)",
    ]


POISON = Family(name="poison", title="The poison zoo in random shard positions and combinations",
                goals="poisoned shards trained on 0; healthy shards quarantined 0; worker crashes 0",
                default_trials=4, run=run_poison, summarize=summarize_poison)


# ---------------------------------------------------------------------------------------- snapshot

BUCKET = "kiln-chaos"


class RemoteProxy:
    """A TCP proxy in front of the S3 endpoint: ``down()`` drops every connection and refuses new
    ones (the remote is gone), ``up()`` serves again on the same port; ``cut_after(n)`` goes down
    by itself once ``n`` bytes went upstream (a push cut in the middle)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = free_port()
        self.sent = 0
        self._limit: int | None = None
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.cuts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
            self._limit = None
        if listener is not None:
            self.cuts += 1
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                conn.close()
            except OSError:
                pass

    def cut_after(self, n_bytes: int) -> None:
        with self._lock:
            self.sent, self._limit = 0, n_bytes

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        pair = {client: server, server: client}
        try:
            while True:
                ready, _, _ = select.select(list(pair), [], [], 1.0)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        with self._lock:
                            self.sent += len(data)
                            over = self._limit is not None and self.sent >= self._limit
                        if over:
                            threading.Thread(target=self.down, daemon=True).start()
                            return
                    pair[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (client, server):
                with contextlib.suppress(OSError):
                    sock.close()


def plan_snapshot(seed: int, index: int) -> dict[str, Any]:
    rng = trial_rng(seed, "snapshot", index)
    mode = ("unreachable", "cut_mid_push")[index % 2]
    return {"mode": mode, "cut_fraction": round(rng.uniform(0.05, 0.9), 3), "shards": rng.randint(3, 6),
            "corpus_seed": rng.randrange(10**6)}


def _remote_keys(s3: Any, prefix: str) -> set[str]:
    keys: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys.update(obj["Key"] for obj in page.get("Contents", []))
    return keys


def _md5_key(prefix: str, md5: str) -> str:
    return f"{prefix}/files/md5/{md5[:2]}/{md5[2:]}"


def partial_records(s3: Any, prefix: str) -> list[str]:
    """Recorded snapshots with any object missing on the remote itself: ``.dir`` listing or file."""
    from kiln.data.snapshot import list_snapshots

    keys = _remote_keys(s3, prefix)
    partial = []
    for ref in list_snapshots():
        dir_key = _md5_key(prefix, ref.id)
        if dir_key not in keys:
            partial.append(f"{ref.id}: .dir listing missing on the remote")
            continue
        listing = json.loads(s3.get_object(Bucket=BUCKET, Key=dir_key)["Body"].read())
        missing = [e["relpath"] for e in listing if _md5_key(prefix, e["md5"]) not in keys]
        if missing:
            partial.append(f"{ref.id}: {len(missing)} file object(s) missing on the remote, e.g. {missing[0]}")
    return partial


def snapshot_trial(ctx: Context, index: int, proxy: RemoteProxy, s3: Any, prefix: str) -> TrialResult:
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.data.snapshot import list_snapshots
    from kiln.errors import SnapshotError

    plan = plan_snapshot(ctx.seed, index)
    s = kiln_settings.load()
    name = f"chaos-{index}"
    corpus = s.corpus_root / name
    shutil.rmtree(corpus, ignore_errors=True)
    built = build_corpus(corpus, shards=plan["shards"], seed=plan["corpus_seed"], max_bytes=400_000)
    facts: dict[str, Any] = {"mode": plan["mode"]}
    losses: list[str] = []
    before = {r.id for r in list_snapshots()}
    keys_before = len(_remote_keys(s3, prefix))
    if plan["mode"] == "unreachable":
        proxy.down()
        fault = f"remote unreachable for the whole snapshot of {name} ({plan['shards']} shards)"
    else:
        cut = max(1024, int(built["bytes"] * plan["cut_fraction"]))
        proxy.up()
        proxy.cut_after(cut)
        fault = f"remote cut after {cut} uploaded bytes ({plan['cut_fraction']:.0%} of {built['bytes']}) of {name}"
    try:
        from kiln.data.snapshot import create_snapshot

        create_snapshot(corpus, name=name)
        facts["failed_while_down"] = False
        fault += " — the push finished before the cut"
    except SnapshotError as exc:
        facts["failed_while_down"] = True
        facts["error"] = str(exc)[:300]
    proxy.down()
    facts["objects_pushed_before_cut"] = len(_remote_keys(s3, prefix)) - keys_before
    proxy.up()  # the remote is back
    dvc_file = corpus.with_name(corpus.name + ".dvc")
    after_fault = {r.id for r in list_snapshots()} - before
    if facts["failed_while_down"]:
        if after_fault:
            losses.append(f"a failed snapshot was recorded: {sorted(after_fault)}")
        if dvc_file.exists():
            losses.append(f"{dvc_file.name} was left behind by the failed snapshot")
    partial = partial_records(s3, prefix)
    facts["partial_recorded_after_fault"] = len(partial)
    losses += [f"partial snapshot recorded: {p}" for p in partial]
    again = create_snapshot(corpus, name=name)
    records = [r for r in list_snapshots() if r.id == again.id]
    facts["recorded_after_recovery"] = len(records)
    if len(records) != 1:
        losses.append(f"snapshot {again.id} recorded {len(records)} times after the remote came back")
    partial = partial_records(s3, prefix)
    facts["partial_recorded"] = len(partial) + facts["partial_recorded_after_fault"]
    losses += [f"partial snapshot recorded after recovery: {p}" for p in partial]
    facts["snapshot_id"] = again.id
    return TrialResult(family="snapshot", index=index, seed=ctx.seed, outcome="lost" if losses else "recovered",
                       fault=fault, facts=facts, losses=losses)


def run_snapshot(ctx: Context, indices: list[int]) -> list[TrialResult]:
    import boto3

    keys = {k: os.environ.get(k) for k in ("KILN_DVC_REMOTE", "KILN_DVC_REMOTE_ENDPOINT", "AWS_ACCESS_KEY_ID",
                                            "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "KILN_HOME")}
    folder = ctx.work / "snapshot"
    folder.mkdir(parents=True, exist_ok=True)
    moto = MotoServer(folder / "moto.log")
    proxy = RemoteProxy(moto.port)
    proxy.up()
    prefix = f"chaos-{ctx.seed}"
    os.environ.update({"KILN_HOME": str(folder / "kiln"), "KILN_DVC_REMOTE": f"s3://{BUCKET}/{prefix}",
                       "KILN_DVC_REMOTE_ENDPOINT": proxy.url, "AWS_ACCESS_KEY_ID": "AKIACHAOSTESTONLY001",
                       "AWS_SECRET_ACCESS_KEY": "kiln-chaos-not-a-secret", "AWS_DEFAULT_REGION": "us-east-1"})
    results = []
    try:
        s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        for index in indices:
            started = time.monotonic()
            try:
                result = snapshot_trial(ctx, index, proxy, s3, prefix)
            except Exception as exc:
                result = TrialResult(family="snapshot", index=index, seed=ctx.seed, outcome="error",
                                     fault=str(plan_snapshot(ctx.seed, index)), detail=f"{type(exc).__name__}: {exc}")
            result.seconds = round(time.monotonic() - started, 1)
            results.append(result)
            ctx.log(f"  {result.name:<12} {result.outcome:<9} {result.fault}  ({result.seconds:.0f}s)")
    finally:
        proxy.down()
        moto.stop()
        for key, value in keys.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results


def summarize_snapshot(results: list[TrialResult]) -> list[str]:
    hit = sum(bool(r.facts.get("failed_while_down")) for r in results)
    modes = {m: sum(r.facts.get("mode") == m for r in results) for m in ("unreachable", "cut_mid_push")}
    return [
        outcome_line(results),
        f"remote unreachable for the whole snapshot: {modes['unreachable']}; cut mid-push: {modes['cut_mid_push']}; "
        f"snapshots that failed while the remote was gone: {hit} (objects already pushed when the remote went: "
        f"{total(results, 'objects_pushed_before_cut')})",
        f"partial snapshots recorded: {total(results, 'partial_recorded')} (goal 0)",
        f"snapshots recorded exactly once after the remote came back: "
        f"{sum(r.facts.get('recorded_after_recovery') == 1 for r in results)}/{len(results)}",
    ]


SNAPSHOT = Family(name="snapshot", title="DVC remote unavailable during a snapshot, then back",
                  goals="partial snapshots recorded 0", default_trials=4, run=run_snapshot,
                  summarize=summarize_snapshot)
