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

The recipe names its trainer (``kiln_trainer.contract.entrypoint``): a top-level ``trainer = "kiln"``
(the default) or ``"package.module:function"``, or a ``[trainer]`` table (``train``, ``evaluate``,
``export``). For a trainer of the user's own, ``[model]`` is the user's: kiln checks only the keys its
orchestration reads (``block_size``: the packed samples' length; ``vocab_size``: against the
tokenizer) and keeps the others as given in ``Recipe.user_model`` (hashed with the rest); every other
section keeps kiln's schema, since kiln's stages and guarantees read them (``data``, ``train``,
``checkpoint``, ``stragglers``, ``tokenizer``, ``parallel``, and ``optim``/``guard``/``eval`` where the
trainer uses them), each checked alone: the rule across kiln's sections (``optim.warmup_steps`` within
``train.steps``) is kiln's trainer's. A recipe of ``kiln`` records no ``trainer`` in its resolved form, so its hash is
the one it had before a recipe could name a trainer.

Why the tokenizer is its own ``[tokenizer]`` section rather than fields of ``[data]``: it is an
artifact that outlives the run (it is saved in every checkpoint, travels with the registered model
and is what serving encodes with), the tokenize stage needs it and the block size and nothing else
of the recipe, and its fields mean different things per kind. ``[data]`` is how samples are batched
and read; ``[tokenizer]`` is what a token id means.

The batch geometry does not depend on the world size: ``data.global_batch_size`` samples make one
optimizer step whatever the number of ranks ``W``; each rank runs ``data.micro_batch_size`` samples
per forward/backward and ``accum_steps(W) = global_batch_size / (W x micro_batch_size)`` of them per
step, so a run may resume at another world size and train on the same global batches.
``model.vocab_size`` follows the tokenizer (0, the default, resolves to the tokenizer's vocabulary
when the recipe is loaded; a larger value pads, a smaller one is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln_trainer.contract import PARALLEL_STRATEGIES
from kiln_trainer.contract.entrypoint import (
    RECIPE_TRAINER_KEY,
    TrainerSpec,
    apply_trainer_overrides,
    parse_override,
    read_recipe_toml,
    trainer_from_recipe_data,
)
from kiln_trainer.errors import RecipeError, TokenizerError

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
            raise RecipeError(f"{section}.{f.name}: expected {f.type}, got bool {value!r}")
        if not isinstance(value, allowed):
            raise RecipeError(f"{section}.{f.name}: expected {f.type}, got {type(value).__name__} {value!r}")
        if f.type == "float" and isinstance(value, int):  # an int where a float goes (a bool was refused above)
            object.__setattr__(obj, f.name, float(value))


def _require(condition: bool, section: str, name: str, message: str, value: Any) -> None:
    if not condition:
        raise RecipeError(f"{section}.{name} = {value!r}: {message}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The transformer's shape (nanoGPT-style decoder-only)."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Residual stream width."""
    block_size: int = 128
    """Context length in tokens; a training sample is ``block_size + 1`` tokens (the packed shards' block size)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps CPU runs cheap (it stays deterministic either way)."""
    bias: bool = False
    """Bias in Linear and LayerNorm layers."""
    vocab_size: int = 0
    """Rows of the embedding. 0 (default): the tokenizer's vocabulary, filled in when the recipe is
    loaded; a larger value pads (e.g. to a multiple of 64 on GPUs); a smaller one is refused."""

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
            self.vocab_size == 0 or 2 <= self.vocab_size <= MAX_VOCAB,
            s,
            "vocab_size",
            f"must be 0 (the tokenizer's) or in [2, {MAX_VOCAB}]",
            self.vocab_size,
        )


TOKENIZER_KINDS = ("byte", "bpe", "file")
DEFAULT_EOS_TOKEN = "<|endoftext|>"
"""The EOS token of kiln's BPE tokenizers (``kiln_trainer.tokenizer.EOS_TOKEN`` is this value)."""
BYTE_EOS_OWN_ID = 256
"""The byte tokenizer's default EOS: an id of its own after the 256 byte values (vocabulary 257)."""
MAX_VOCAB = 1 << 32
"""Token ids are stored as uint16 or uint32 in the packed shards."""
MAX_BPE_VOCAB = 1 << 20
"""Largest vocabulary kiln trains a BPE for: the tokenizers library's trainer sizes its tables by
``vocab_size`` up front (2**32 asked it for about 70 GB and aborted the process); the largest vocabularies
in use are about 2**18."""
_BPE_MIN_VOCAB = 257
"""The 256 byte symbols of a byte-level BPE plus its EOS."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerConfig:
    """What a token id means: ``byte`` (UTF-8 bytes), ``bpe`` (byte-level BPE trained
    deterministically on the manifest's training shards) or ``file`` (a Hugging Face tokenizer JSON).

    The tokenize stage (or, for a manifest without packed tokens, the trainer's rank 0) builds it with
    ``kiln_trainer.tokenizer.build_tokenizer``; its artifact and sha256 go into the token manifest and
    every checkpoint. Fields that do not apply to the chosen kind must keep their defaults."""

    kind: str = "byte"
    """``byte``, ``bpe`` or ``file``."""
    vocab_size: int = 0
    """``bpe`` only: the vocabulary to train, EOS and the 256 byte symbols included (>= 257). A small
    corpus can end training with fewer ids; the model keeps this many rows."""
    path: str = ""
    """``file`` only: the tokenizer JSON, absolute or relative to the recipe file's directory."""
    eos_id: int = BYTE_EOS_OWN_ID
    """``byte`` only: the id that ends every document. 256 (default): an id of its own, vocabulary
    257, so no byte of text is mistaken for it; 0..255: that byte, vocabulary 256 (0 keeps the
    NUL-separated stream of the trainer before tokenizers)."""
    eos_token: str = DEFAULT_EOS_TOKEN
    """``bpe`` and ``file``: the token that ends every document (a BPE is trained with it at id 0)."""
    max_train_chars: int = 0
    """``bpe`` only: train on the training shards' first documents up to this many characters
    (0: all of them). The order is the manifest's, so the prefix, and the artifact, are fixed."""

    def __post_init__(self) -> None:
        s = "tokenizer"
        _check_types(self, s)
        _require(self.kind in TOKENIZER_KINDS, s, "kind", f"must be one of {', '.join(TOKENIZER_KINDS)}", self.kind)
        if self.kind == "bpe":
            _require(
                _BPE_MIN_VOCAB <= self.vocab_size <= MAX_BPE_VOCAB,
                s,
                "vocab_size",
                f"a bpe tokenizer needs [{_BPE_MIN_VOCAB}, {MAX_BPE_VOCAB}] ids (256 bytes + EOS at least; "
                f"MAX_BPE_VOCAB {MAX_BPE_VOCAB}: what the tokenizers library can train in memory)",
                self.vocab_size,
            )
        else:
            _require(self.vocab_size == 0, s, "vocab_size", "only for tokenizer.kind = 'bpe'", self.vocab_size)
        if self.kind == "file":
            _require(bool(self.path), s, "path", "a file tokenizer needs the path of its JSON", self.path)
        else:
            _require(self.path == "", s, "path", "only for tokenizer.kind = 'file'", self.path)
        if self.kind == "byte":
            _require(0 <= self.eos_id <= BYTE_EOS_OWN_ID, s, "eos_id", "must be 0..255 (a byte) or 256", self.eos_id)
            _require(
                self.eos_token == DEFAULT_EOS_TOKEN,
                s,
                "eos_token",
                "only for bpe and file tokenizers (the byte tokenizer's EOS is tokenizer.eos_id)",
                self.eos_token,
            )
        else:
            _require(
                self.eos_id == BYTE_EOS_OWN_ID,
                s,
                "eos_id",
                "only for tokenizer.kind = 'byte' (bpe and file name their EOS by tokenizer.eos_token)",
                self.eos_id,
            )
            _require(bool(self.eos_token), s, "eos_token", "must name a token", self.eos_token)
        _require(self.max_train_chars >= 0, s, "max_train_chars", "must be >= 0 (0: all documents)", self.max_train_chars)
        if self.kind != "bpe":
            _require(self.max_train_chars == 0, s, "max_train_chars", "only for tokenizer.kind = 'bpe'", self.max_train_chars)

    @property
    def known_vocab_size(self) -> int | None:
        """The vocabulary this config gives without reading any file (None for ``file``)."""
        if self.kind == "byte":
            return 257 if self.eos_id == BYTE_EOS_OWN_ID else 256
        if self.kind == "bpe":
            return self.vocab_size
        return None

    def resolved_path(self, recipe_path: str | Path | None) -> Path:
        """``path`` as a file: relative paths are relative to the recipe file's directory (or the cwd)."""
        path = Path(self.path)
        if path.is_absolute() or recipe_path is None:
            return path
        return Path(recipe_path).resolve().parent / path

    def describe(self) -> str:
        """``tokenizer.kind = 'byte', tokenizer.eos_id = 256`` (the fields that make its vocabulary)."""
        if self.kind == "byte":
            return f"tokenizer.kind = 'byte', tokenizer.eos_id = {self.eos_id}"
        if self.kind == "bpe":
            return f"tokenizer.kind = 'bpe', tokenizer.vocab_size = {self.vocab_size}"
        return f"tokenizer.kind = 'file', tokenizer.path = {self.path!r}"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """How the packed samples are batched and read (``kiln_trainer.loader``)."""

    global_batch_size: int = 8
    """Samples per optimizer step, all ranks together: the same at every world size (tokens per
    step = global_batch_size x model.block_size)."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank; each rank runs ``global_batch_size / (world size x
    micro_batch_size)`` of them per step (gradient accumulation), so that must be a whole number.
    A memory knob: a resume may change it (only the float summation order changes)."""
    window_shards: int = 0
    """Sample order: 0 shuffles all samples globally each epoch; ``w > 0`` shuffles within windows of
    ``w`` shards (a reader needs about ``w`` shards at a time: what a bounded remote cache wants)."""
    prefetch_steps: int = 2
    """The loader's read-ahead level: its background thread reads again when fewer than this many of
    this rank's steps are ready, 8 steps a time (``TokenLoader.read_steps``), so at most
    ``prefetch_steps - 1 + 8`` steps are held."""
    cache_bytes: int = 8 << 30
    """Local cache for token shards streamed from S3, per rank (``KILN_TOKEN_CACHE_BYTES`` overrides)."""

    def __post_init__(self) -> None:
        s = "data"
        _check_types(self, s)
        _require(self.global_batch_size >= 1, s, "global_batch_size", "must be >= 1", self.global_batch_size)
        _require(self.micro_batch_size >= 1, s, "micro_batch_size", "must be >= 1", self.micro_batch_size)
        _require(
            self.global_batch_size % self.micro_batch_size == 0,
            s,
            "global_batch_size",
            f"must be a multiple of data.micro_batch_size ({self.micro_batch_size})",
            self.global_batch_size,
        )
        _require(self.window_shards >= 0, s, "window_shards", "must be >= 0 (0: one global shuffle)", self.window_shards)
        _require(self.prefetch_steps >= 1, s, "prefetch_steps", "must be >= 1", self.prefetch_steps)
        _require(self.cache_bytes >= 1, s, "cache_bytes", "must be >= 1", self.cache_bytes)

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step per rank at this world size; a geometry that does not divide is refused."""
        share = world_size * self.micro_batch_size
        if world_size < 1 or self.global_batch_size % share:
            raise RecipeError(
                f"data.global_batch_size = {self.global_batch_size} does not divide by world size x "
                f"data.micro_batch_size = {world_size} x {self.micro_batch_size}: each rank must run a whole number "
                "of micro-batches per step (change data.micro_batch_size, or the number of ranks)"
            )
        return self.global_batch_size // share


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
class ParallelConfig:
    """How the model and its training state are spread over the ranks (``kiln_trainer.parallel``).

    ``ddp``: every rank holds the whole model and optimizer state; gradients are all-reduced; rank 0
    writes the whole state into each checkpoint (``torch.save`` files, checkpoint format 2).
    ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the
    root): parameters, gradients and optimizer state are sharded over the ranks, so a model larger
    than one device trains; every rank writes its own shards through ``torch.distributed.checkpoint``
    (checkpoint format 3). On CUDA with ``train.dtype`` bfloat16 (or auto), parameters are gathered in
    bfloat16 and gradients reduced in float32 (FSDP2's ``MixedPrecisionPolicy``) instead of autocast.

    A run may change strategy when it resumes (a ddp checkpoint resumes into fsdp and back): both
    hold the same global training state, only its layout differs."""

    strategy: str = "ddp"
    """``ddp`` or ``fsdp``."""
    reshard_after_forward: bool = True
    """fsdp only: free a block's gathered parameters after its forward and gather them again for the
    backward (the ZeRO-3 memory profile); false keeps them until the backward (ZeRO-2: one all-gather
    less per block per step, more memory)."""

    def __post_init__(self) -> None:
        s = "parallel"
        _check_types(self, s)
        _require(
            self.strategy in PARALLEL_STRATEGIES, s, "strategy", f"must be one of {', '.join(PARALLEL_STRATEGIES)}",
            self.strategy,
        )


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
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    """The trainer the recipe names (``kiln``, or the user's entry points)."""
    user_model: dict[str, Any] = field(default_factory=dict)
    """A user trainer's ``[model]`` keys besides ``block_size`` and ``vocab_size`` (``model`` holds
    those two), as the recipe gives them; always empty for ``kiln``."""

    def __post_init__(self) -> None:
        if self.trainer.is_kiln and self.user_model:
            raise RecipeError(f"model: unknown key(s) {sorted(self.user_model)} (kiln's trainer takes "
                              f"{sorted(f.name for f in dataclasses.fields(ModelConfig))})")
        for key, value in self.user_model.items():
            if not _plain_value(value):
                raise RecipeError(f"model.{key} = {value!r}: a user model's value must be a string, number, "
                                  "boolean, array or table (it is hashed as JSON)")
        _require(
            not self.trainer.is_kiln or self.optim.warmup_steps <= self.train.steps,
            "optim",
            "warmup_steps",
            f"must be <= train.steps ({self.train.steps})",
            self.optim.warmup_steps,
        )
        tok = self.tokenizer
        known = tok.known_vocab_size
        if self.model.vocab_size == 0:
            if known is None:
                raise RecipeError(
                    "model.vocab_size = 0: a file tokenizer's vocabulary is read from tokenizer.path when the "
                    "recipe file is loaded (load_recipe); give model.vocab_size here"
                )
            # Frozen: the resolved value is what gets hashed, stored in checkpoints and built.
            object.__setattr__(self, "model", dataclasses.replace(self.model, vocab_size=known))
        elif known is not None:
            check_model_vocab(self.model.vocab_size, known, tok)

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe, ``{section: {key: value}}``: what is hashed and recorded. A user trainer's
        recipe adds ``trainer`` and its ``[model]`` is the user's keys plus ``block_size`` and ``vocab_size``."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in _SECTION_CLASSES}
        if not self.trainer.is_kiln:
            out["model"] = {**self.user_model, **{k: out["model"][k] for k in _USER_MODEL_KILN_KEYS}}
            out[RECIPE_TRAINER_KEY] = self.trainer.to_recipe_value()
        return out

    @property
    def sha256(self) -> str:
        return recipe_sha256(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        """Build from nested ``{section: {key: value}}``; unknown sections/keys raise RecipeError."""
        if not isinstance(data, dict):
            raise RecipeError(f"recipe must be a table of sections, got {type(data).__name__}")
        data = dict(data)
        trainer = trainer_from_recipe_data(data)
        unknown = set(data) - set(_SECTION_CLASSES)
        if unknown:
            raise RecipeError(f"unknown recipe section(s) {sorted(unknown)}; known: "
                              f"{sorted([*_SECTION_CLASSES, RECIPE_TRAINER_KEY])}")
        built: dict[str, Any] = {"trainer": trainer}
        for name, table in data.items():
            section_cls = _SECTION_CLASSES[name]
            if not isinstance(table, dict):
                raise RecipeError(f"[{name}] must be a table, got {type(table).__name__}")
            if name == "model" and not trainer.is_kiln:
                built["user_model"] = {k: v for k, v in table.items() if k not in _USER_MODEL_KILN_KEYS}
                table = {k: v for k, v in table.items() if k in _USER_MODEL_KILN_KEYS}
            keys = {f.name for f in dataclasses.fields(section_cls)}
            bad = set(table) - keys
            if bad:
                raise RecipeError(f"unknown key(s) {sorted(f'{name}.{k}' for k in bad)}; known: {sorted(keys)}")
            built[name] = section_cls(**table)
        return cls(**built)


_SECTION_CLASSES: dict[str, type] = {
    "model": ModelConfig,
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "guard": GuardConfig,
    "stragglers": StragglerConfig,
    "eval": EvalConfig,
}
def _plain_value(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, list):
        return all(_plain_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_value(v) for k, v in value.items())
    return False


_USER_MODEL_KILN_KEYS = ("block_size", "vocab_size")
"""The ``[model]`` keys kiln reads of a user trainer's recipe (the packed samples, the tokenizer check)."""


def check_model_vocab(model_vocab: int, tokenizer_vocab: int, tokenizer: TokenizerConfig) -> None:
    """Refuse a model whose embedding cannot hold every id of the tokenizer."""
    if model_vocab < tokenizer_vocab:
        raise RecipeError(
            f"model.vocab_size = {model_vocab} is smaller than the tokenizer's vocabulary of {tokenizer_vocab} ids "
            f"({tokenizer.describe()}); set model.vocab_size = 0 (follow the tokenizer) or >= {tokenizer_vocab}"
        )


RESUMABLE_CHANGES = frozenset({
    ("data", "micro_batch_size"), ("data", "prefetch_steps"), ("data", "cache_bytes"),
    ("parallel", "strategy"), ("parallel", "reshard_after_forward"),
})
"""Recipe fields a resume may change: how the same global batches are computed, read and laid out
over the ranks, not what is trained (a world-size change may need another micro batch; a ddp
checkpoint resumes into fsdp and back)."""


def resume_identity(recipe: dict[str, Any]) -> dict[str, Any]:
    """A resolved recipe dict without the fields in ``RESUMABLE_CHANGES``: what a resume must match.
    A section left empty is dropped, so a checkpoint written before a section of only resumable
    fields existed (``[parallel]``) still matches."""
    kept = {
        section: {k: v for k, v in (table or {}).items() if (section, k) not in RESUMABLE_CHANGES}
        for section, table in recipe.items()
    }
    return {section: table for section, table in kept.items() if table}


def recipe_sha256(recipe: Recipe) -> str:
    """sha256 of the canonical JSON of the resolved recipe (sorted keys, no whitespace)."""
    blob = json.dumps(recipe.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def load_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Resolve defaults < TOML file (if given) < overrides into a validated Recipe.

    A ``file`` tokenizer is read here (``tokenizer.path``, relative to the recipe file) so that
    ``model.vocab_size`` follows it like the other kinds."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        data = read_recipe_toml(path)
    apply_trainer_overrides(data, overrides)
    for text in overrides:
        section, key, value = parse_override(text)
        if section == RECIPE_TRAINER_KEY:
            continue  # applied above
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise RecipeError(f"override {text!r}: [{section}] is not a table in the recipe")
        table[key] = value
    tokenizer_table = data.get("tokenizer")
    known = {f.name for f in dataclasses.fields(TokenizerConfig)}
    if isinstance(tokenizer_table, dict) and tokenizer_table.get("kind") == "file" and set(tokenizer_table) <= known:
        _resolve_file_vocab(data, TokenizerConfig(**tokenizer_table), path)
    return Recipe.from_dict(data)


def _resolve_file_vocab(data: dict[str, Any], tok: TokenizerConfig, recipe_path: str | Path | None) -> None:
    from kiln_trainer.tokenizer import load_tokenizer  # numpy and tokenizers: only for a file tokenizer

    where = tok.resolved_path(recipe_path)
    try:
        vocab = load_tokenizer(where, eos_token=tok.eos_token).vocab_size
    except TokenizerError as exc:
        raise RecipeError(f"tokenizer.path = {tok.path!r}: {exc}") from exc
    model = data.setdefault("model", {})
    if not isinstance(model, dict):
        raise RecipeError("[model] must be a table")
    asked = model.get("vocab_size", 0)
    if isinstance(asked, bool) or not isinstance(asked, int):
        return  # the type error is ModelConfig's to report
    if asked == 0:
        model["vocab_size"] = vocab
    else:
        check_model_vocab(asked, vocab, tok)


def recipes_dir() -> Path:
    """``training/recipes`` in a source checkout (the package sits at ``training/kiln_trainer``)."""
    return Path(__file__).resolve().parent.parent / "recipes"
