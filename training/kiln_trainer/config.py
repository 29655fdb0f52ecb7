"""Recipe configuration: one frozen dataclass per section, loaded from TOML.

Precedence: dataclass defaults < recipe TOML < ``--set section.key=value`` overrides. The resolved
recipe is what gets hashed (``recipe_sha256``), logged to MLflow and stored in every checkpoint
manifest; a resume refuses a recipe whose hash differs from the checkpoint's.

A recipe file is TOML with one table per section, e.g.::

    [model]
    n_layer = 4
    [train]
    steps = 200

Unknown sections or keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln_trainer import BYTE_VOCAB_SIZE
from kiln_trainer.errors import ConfigError

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "str": (str,),
}


def _check_types(obj: Any, section: str) -> None:
    """TOML gives typed values; reject a wrong type here with the field's full name."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed = _PY_TYPES[str(f.type)]
        if isinstance(value, bool) and bool not in allowed:
            raise ConfigError(f"{section}.{f.name}: expected {f.type}, got bool {value!r}")
        if not isinstance(value, allowed):
            raise ConfigError(f"{section}.{f.name}: expected {f.type}, got {type(value).__name__} {value!r}")
        if f.type == "float" and not isinstance(value, float):
            object.__setattr__(obj, f.name, float(value))


def _require(condition: bool, section: str, name: str, message: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"{section}.{name} = {value!r}: {message}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The transformer's shape (nanoGPT-style decoder-only, byte vocabulary)."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Residual stream width."""
    block_size: int = 128
    """Context length in bytes (also the training window length)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps CPU runs cheap (it stays deterministic either way)."""
    bias: bool = False
    """Bias in Linear and LayerNorm layers."""
    vocab_size: int = BYTE_VOCAB_SIZE
    """Fixed at 256: the tokenizer is the identity on bytes."""

    def __post_init__(self) -> None:
        s = "model"
        _check_types(self, s)
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            _require(getattr(self, name) >= 1, s, name, "must be >= 1", getattr(self, name))
        _require(
            self.n_embd % self.n_head == 0,
            s,
            "n_embd",
            f"must be divisible by model.n_head ({self.n_head})",
            self.n_embd,
        )
        _require(0.0 <= self.dropout < 1.0, s, "dropout", "must be in [0, 1)", self.dropout)
        _require(
            self.vocab_size == BYTE_VOCAB_SIZE,
            s,
            "vocab_size",
            "the byte tokenizer has exactly 256 ids",
            self.vocab_size,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """How windows are drawn from the manifest's shards."""

    batch_size: int = 8
    """Windows per micro-batch per rank."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step per rank (tokens/step = world * accum * batch * block)."""
    doc_separator: int = 0
    """Byte written between documents in the stream (0 = NUL, which never occurs in text)."""

    def __post_init__(self) -> None:
        s = "data"
        _check_types(self, s)
        _require(self.batch_size >= 1, s, "batch_size", "must be >= 1", self.batch_size)
        _require(self.grad_accum_steps >= 1, s, "grad_accum_steps", "must be >= 1", self.grad_accum_steps)
        _require(0 <= self.doc_separator <= 255, s, "doc_separator", "must be a byte value 0..255", self.doc_separator)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the last step."""
    warmup_steps: int = 10
    """Linear warmup length in optimizer steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms/biases)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        s = "optim"
        _check_types(self, s)
        _require(self.lr > 0, s, "lr", "must be > 0", self.lr)
        _require(0 <= self.min_lr <= self.lr, s, "min_lr", "must be in [0, optim.lr]", self.min_lr)
        _require(self.warmup_steps >= 0, s, "warmup_steps", "must be >= 0", self.warmup_steps)
        _require(self.weight_decay >= 0, s, "weight_decay", "must be >= 0", self.weight_decay)
        _require(0 <= self.beta1 < 1, s, "beta1", "must be in [0, 1)", self.beta1)
        _require(0 <= self.beta2 < 1, s, "beta2", "must be in [0, 1)", self.beta2)
        _require(self.eps > 0, s, "eps", "must be > 0", self.eps)
        _require(self.grad_clip >= 0, s, "grad_clip", "must be >= 0 (0 disables)", self.grad_clip)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """The loop: length, seed, device, precision, logging."""

    steps: int = 100
    """Total optimizer steps of the run (``--max-steps`` can stop an invocation earlier)."""
    seed: int = 1337
    """Seeds init, data order and every RNG; with the same manifest and world size the run is bit-exact."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cpu`` or ``cuda``."""
    dtype: str = "auto"
    """Autocast dtype: ``auto`` (bfloat16 on cuda, float32 on cpu), ``float32`` or ``bfloat16``."""
    compile: bool = False
    """torch.compile the model (GPU recipes; slow to start on CPU)."""
    log_every: int = 10
    """Steps between metric records (metrics.jsonl, MLflow, the progress line)."""

    def __post_init__(self) -> None:
        s = "train"
        _check_types(self, s)
        _require(self.steps >= 1, s, "steps", "must be >= 1", self.steps)
        _require(0 <= self.seed < 2**63, s, "seed", "must be in [0, 2**63)", self.seed)
        _require(self.device in ("auto", "cpu", "cuda"), s, "device", "must be auto, cpu or cuda", self.device)
        _require(
            self.dtype in ("auto", "float32", "bfloat16"), s, "dtype", "must be auto, float32 or bfloat16", self.dtype
        )
        _require(self.log_every >= 1, s, "log_every", "must be >= 1", self.log_every)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """When to save and how many committed checkpoints to keep."""

    every_steps: int = 50
    """Save every N steps (the final step is always saved)."""
    keep_last: int = 3
    """Committed checkpoints kept; older ones are deleted, the newest never is."""
    async_save: bool = True
    """Write files in a background thread; training blocks only for the state copy."""

    def __post_init__(self) -> None:
        s = "checkpoint"
        _check_types(self, s)
        _require(self.every_steps >= 1, s, "every_steps", "must be >= 1", self.every_steps)
        _require(self.keep_last >= 1, s, "keep_last", "must be >= 1 (the newest is always kept)", self.keep_last)


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """Loss guard: roll back to the last committed checkpoint on a non-finite loss or a spike."""

    spike_factor: float = 0.0
    """Roll back when loss > spike_factor * the mean of the last 20 step losses (needs 5); 0 disables."""
    max_rollbacks: int = 3
    """Rollbacks allowed over the run (counted in the checkpointed event history plus this
    invocation) before it fails with TrainingDivergedError."""

    def __post_init__(self) -> None:
        s = "guard"
        _check_types(self, s)
        _require(
            self.spike_factor == 0 or self.spike_factor > 1,
            s,
            "spike_factor",
            "must be 0 (off) or > 1",
            self.spike_factor,
        )
        _require(self.max_rollbacks >= 0, s, "max_rollbacks", "must be >= 0", self.max_rollbacks)


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """Straggler detection: every rank's step compute time is gathered every ``every_steps`` steps.

    Compute time is a step's wall time minus the time the rank spent blocked in collectives
    (gradient all-reduce wait, loss all-reduce), so a healthy rank waiting for a slow one is not
    itself slow. A window's value per rank is the median over its steps (one descheduled step on a
    shared host does not make a straggler)."""

    every_steps: int = 5
    """Steps per window (one all_gather of a few floats per window)."""
    factor: float = 1.5
    """A rank is slow in a window when its compute time exceeds ``factor`` x the median of the
    other ranks'."""
    windows: int = 3
    """Consecutive slow windows before the rank is flagged (metric, log line, MLflow tag, event)."""

    def __post_init__(self) -> None:
        s = "stragglers"
        _check_types(self, s)
        _require(self.every_steps >= 1, s, "every_steps", "must be >= 1", self.every_steps)
        _require(self.factor > 1.0, s, "factor", "must be > 1", self.factor)
        _require(self.windows >= 1, s, "windows", "must be >= 1", self.windows)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation (``kiln_trainer.evaluate``)."""

    max_windows: int = 64
    """Upper bound on evaluated windows (non-overlapping, from the start of the eval stream)."""
    batch_size: int = 16
    """Windows per forward pass."""

    def __post_init__(self) -> None:
        s = "eval"
        _check_types(self, s)
        _require(self.max_windows >= 1, s, "max_windows", "must be >= 1", self.max_windows)
        _require(self.batch_size >= 1, s, "batch_size", "must be >= 1", self.batch_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """The whole resolved training configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        _require(
            self.optim.warmup_steps <= self.train.steps,
            "optim",
            "warmup_steps",
            f"must be <= train.steps ({self.train.steps})",
            self.optim.warmup_steps,
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @property
    def sha256(self) -> str:
        return recipe_sha256(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        """Build from nested ``{section: {key: value}}``; unknown sections/keys raise ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"recipe must be a table of sections, got {type(data).__name__}")
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise ConfigError(f"unknown recipe section(s) {sorted(unknown)}; known: {sorted(sections)}")
        built: dict[str, Any] = {}
        for name, table in data.items():
            section_cls = _SECTION_CLASSES[name]
            if not isinstance(table, dict):
                raise ConfigError(f"[{name}] must be a table, got {type(table).__name__}")
            keys = {f.name for f in dataclasses.fields(section_cls)}
            bad = set(table) - keys
            if bad:
                raise ConfigError(f"unknown key(s) {sorted(f'{name}.{k}' for k in bad)}; known: {sorted(keys)}")
            built[name] = section_cls(**table)
        return cls(**built)


_SECTION_CLASSES: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "guard": GuardConfig,
    "stragglers": StragglerConfig,
    "eval": EvalConfig,
}


def recipe_sha256(recipe: Recipe) -> str:
    """sha256 of the canonical JSON of the resolved recipe (sorted keys, no whitespace)."""
    blob = json.dumps(recipe.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` → (section, key, value); value parsed as a TOML value, else a bare string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {text!r}: key must be section.key, got {dotted!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # `--set train.device=cpu` without TOML quotes
    return parts[0], parts[1], value


def load_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Resolve defaults < TOML file (if given) < overrides into a validated Recipe."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"recipe file {path} not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"recipe file {path}: invalid TOML: {exc}") from exc
    for text in overrides:
        section, key, value = parse_override(text)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {text!r}: [{section}] is not a table in the recipe")
        table[key] = value
    return Recipe.from_dict(data)


def recipes_dir() -> Path:
    """``training/recipes`` in a source checkout (the package sits at ``training/kiln_trainer``)."""
    return Path(__file__).resolve().parent.parent / "recipes"
