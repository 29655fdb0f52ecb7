"""What signing and verifying a registered model directory costs next to hashing its files.

The directory is a real one: a checkpoint of kiln's GPT with torch weights (``KILN_BENCH_SIGN_LAYERS``
layers, 4, of each width of ``KILN_BENCH_SIGN_WIDTHS``, 384 and 512: about 7 M and 13 M parameters),
written by the trainer's own CheckpointWriter and exported by ``kiln_trainer.export.save_model`` as
registration does (the MLflow model directory: MLmodel, the model as code, the Hugging Face folder with
its safetensors, tokenizer, recipe, checkpoint manifest; about 28 and 50 MiB). The headline ratios are
the first (smallest) directory's, where the fixed costs weigh most.

Baseline (measured in the same run, alternated with each side): ``sha256sum`` of the same files, one
process, warm page cache: the least any signature over every file's bytes must do. A second, stricter
baseline: ``openssl dgst -sha256`` of the same files. coreutils' ``sha256sum`` (9.1 here) is not linked
with libcrypto and hashes about five times slower than OpenSSL on a CPU with the SHA extensions, while
Python's ``hashlib`` (which kiln and model-signing hash with) is OpenSSL's: against ``sha256sum`` alone
a signer that hashes every byte twice can look cheaper than one pass.
Measured: ``kiln.provenance.sign_artifact`` (what registration calls: the statement with every file's
sha256, the DSSE envelope, then model-signing's ``model.sig`` over every file, each signed with the
policy's key) and ``verify_artifact`` (what ``promote``, ``kiln verify`` and ``kiln export`` run on a
downloaded version: both signatures, the statement's files against the directory, model-signing's
verification). The one-time costs of a process (importing model-signing, making the policy's key)
are paid in an untimed first round and reported apart, as is ``code_sha256`` (the digest of kiln's
installed source that registration's statement inputs take, whatever the model's size).

Prints ``ratio = sign / sha256sum`` and ``verify_ratio = verify / sha256sum`` (and, per size, both
against ``openssl dgst``), medians over
``KILN_BENCH_SIGN_REPEATS`` (5) rounds; goal from issue 31: <= 1.3 each. Uses its own folder under
/tmp, deleted afterwards.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def _model_dir(scratch: Path, layers: int, width: int) -> Path:
    """A real checkpoint of kiln's GPT exported as the registered MLflow model directory."""
    import torch

    from kiln_trainer.checkpoint import CheckpointIdentity, CheckpointWriter
    from kiln_trainer.checkpoint_manifest import latest_committed
    from kiln_trainer.config import ModelConfig, Recipe
    from kiln_trainer.export import save_model
    from kiln_trainer.model import GPT

    recipe = Recipe(model=ModelConfig(n_layer=layers, n_head=max(1, width // 64), n_embd=width, block_size=256))
    writer = CheckpointWriter(
        scratch / "run",
        CheckpointIdentity(world_size=1, recipe=recipe.to_dict(), recipe_sha256=recipe.sha256,
                           snapshot_id="0123456789abcdef0123456789abcdef.dir", training_manifest_sha256="ab" * 32),
        keep_last=1, async_save=False,
    )
    torch.manual_seed(0)
    model = GPT(recipe.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    rng = io.BytesIO()
    torch.save({}, rng)
    writer.save(step=1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={"step": 1},
                rng_blobs=[rng.getvalue()])
    writer.close()
    return save_model(latest_committed(scratch / "run"), scratch / "model")


def _inputs(code_sha256: str) -> Any:
    from kiln.provenance.statement import ProvenanceInputs, TrainerIdentity, environment

    h = "ab" * 32
    return ProvenanceInputs(
        policy="production", dag_id="kiln_production", run_id="manual__bench", launcher="local", nodes=(),
        recipe={"model": {"n_layer": 4}}, seed=1337, world_size=1, strategy="ddp", steps=1,
        snapshot_id="0123456789abcdef0123456789abcdef.dir", corpus="stdlib-py", snapshot_remote="/srv/dvc-remote",
        contract="stdlib-py@1", contract_suite_sha256=h, quarantine_report_sha256=h, quarantine_report_uri="/r/q.json",
        training_manifest_sha256=h, training_manifest_uri="/r/m.json", tokenizer_kind="byte", tokenizer_sha256=h,
        code_sha256=code_sha256, trainer=TrainerIdentity(spec="kiln", distribution="kiln", version="0.1.0", sha256=h),
        **environment(), run_key="kiln_production/manual__bench", started_on="", finished_on="",
        checkpoint_manifest_sha256=h, eval_report={"bits_per_byte": 2.5}, decision={"action": "promote", "reasons": []})


def _files(directory: Path) -> list[str]:
    from kiln.provenance.statement import SIGNATURE_FILES

    return sorted(str(p) for p in directory.rglob("*") if p.is_file() and p.name not in SIGNATURE_FILES)


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _measure(scratch: Path, layers: int, width: int, repeats: int) -> dict[str, Any]:
    """Rounds of sha256sum, openssl dgst, sign and verify on one model directory, after an untimed round."""
    from kiln.provenance.sign import sign_artifact
    from kiln.provenance.statement import SIGNATURE_FILES, artifact_files, code_sha256
    from kiln.provenance.verify import verify_artifact

    directory = _model_dir(scratch, layers, width)
    home = scratch / "home"
    files = _files(directory)
    inputs = _inputs(code_sha256())

    def sha256sum() -> None:
        subprocess.run(["sha256sum", *files], check=True, stdout=subprocess.DEVNULL)

    def openssl() -> None:
        subprocess.run(["openssl", "dgst", "-sha256", *files], check=True, stdout=subprocess.DEVNULL)

    def sign() -> None:
        for name in SIGNATURE_FILES:
            (directory / name).unlink(missing_ok=True)
        sign_artifact(directory, inputs, home=home)

    def verify() -> None:
        verify_artifact(directory, "production", home=home)

    first = {"sha256sum": _timed(sha256sum), "sign": _timed(sign), "verify": _timed(verify)}
    rounds = [{"sha256sum": _timed(sha256sum), "openssl": _timed(openssl), "sign": _timed(sign),
               "verify": _timed(verify), "statement hashing": _timed(lambda: artifact_files(directory))}
              for _ in range(repeats)]
    return {"files": len(files), "mib": sum(Path(f).stat().st_size for f in files) / 2**20, "first": first,
            "rounds": rounds, "code_s": _timed(lambda: code_sha256())}


def main() -> dict[str, Any]:
    layers = int(os.environ.get("KILN_BENCH_SIGN_LAYERS", "4"))
    widths = [int(w) for w in os.environ.get("KILN_BENCH_SIGN_WIDTHS", "384,512").split(",")]
    repeats = int(os.environ.get("KILN_BENCH_SIGN_REPEATS", "5"))
    load_before = os.getloadavg()[0]
    sizes: dict[int, dict[str, Any]] = {}
    for width in widths:
        scratch = Path(tempfile.mkdtemp(prefix="kiln-bench-sign-", dir="/tmp"))
        try:
            sizes[width] = _measure(scratch, layers, width, repeats)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def ratios(m: dict[str, Any], side: str, base: str) -> list[float]:
        return sorted(r[side] / r[base] for r in m["rounds"])

    def median(m: dict[str, Any], key: str) -> float:
        return statistics.median(r[key] for r in m["rounds"])

    head = sizes[widths[0]]  # the smallest: the fixed costs weigh most there
    return {
        "name": "Signing and verifying a model directory vs sha256sum",
        "baseline": (f"`sha256sum` of the same {head['files']} files ({head['mib']:.1f} MiB: a real exported model "
                     f"directory of kiln's GPT, {layers} layers x {widths[0]} wide, torch weights), warm page cache, "
                     f"alternated with each side over {repeats} rounds; median ratios (other sizes in the table)"),
        "ratio": round(statistics.median(ratios(head, "sign", "sha256sum")), 2),
        "verify_ratio": round(statistics.median(ratios(head, "verify", "sha256sum")), 2),
        "goal_ratio": "<= 1.3 (sign and verify)",
        "sign_ratios": [round(r, 2) for r in ratios(head, "sign", "sha256sum")],
        "verify_ratios": [round(r, 2) for r in ratios(head, "verify", "sha256sum")],
        "load_avg_1m_before_after": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}",
        "by model directory (median of the rounds)": {
            f"{layers} x {width} wide, {m['mib']:.1f} MiB, {m['files']} files": {
                "sign / sha256sum": round(statistics.median(ratios(m, "sign", "sha256sum")), 2),
                "verify / sha256sum": round(statistics.median(ratios(m, "verify", "sha256sum")), 2),
                "sign / openssl dgst": round(statistics.median(ratios(m, "sign", "openssl")), 2),
                "verify / openssl dgst": round(statistics.median(ratios(m, "verify", "openssl")), 2),
                "sha256sum s": round(median(m, "sha256sum"), 3),
                "openssl dgst -sha256 s": round(median(m, "openssl"), 3),
                "sign_artifact s": round(median(m, "sign"), 3),
                "verify_artifact s": round(median(m, "verify"), 3),
                "one Python hashing pass s": round(median(m, "statement hashing"), 3),
            } for width, m in sizes.items()},
        "once per process or registration (s)": {
            "first sign (imports model-signing, makes the key)": round(head["first"]["sign"], 2),
            "first verify": round(head["first"]["verify"], 2),
            "code_sha256 (kiln's installed source, every registration)": round(head["code_s"], 2),
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
