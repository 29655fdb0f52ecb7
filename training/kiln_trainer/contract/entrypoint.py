"""Which trainer a recipe names, how kiln calls it, and what it records. Standard library only.

A recipe names its trainer (``docs/trainer-contract.md``, "The trainer entry point")::

    trainer = "kiln"                          # the default: kiln's own, kiln_trainer.train:main
    trainer = "my_lm.train:main"              # the user's train entry point

    [trainer]                                 # or a table: train, and optionally evaluate and export
    train = "my_lm.train:main"
    evaluate = "my_lm.evaluate:load_for_evaluation"
    export = "my_lm.export:main"

An entry point is ``package.module:function`` (the function may be a dotted attribute path). Each
role is called its own way (``ENTRYPOINT_CALLS``):

- ``train``: on every rank under torchrun as ``main(argv) -> int``, with exactly the arguments
  kiln's own trainer takes (``parse_trainer_args`` parses them, ``TrainerArgs`` names them);
  returns an exit code of the contract (``EXIT_OK``, ``EXIT_RETRYABLE``, ``EXIT_FATAL``).
- ``evaluate``: in kiln's evaluation process as ``load(checkpoint)``: ``checkpoint`` is a
  ``kiln_trainer.evaluate.EvalCheckpoint`` (the verified manifest, the resolved recipe, the whole
  model state, the tokenizer, the device); it returns a function from token ids ``(batch, T)`` to
  logits ``(batch, T, vocab)``, and kiln scores the eval split with it exactly as it scores its own
  GPT. Without one, a checkpoint of this trainer cannot be evaluated.
- ``export``: ``main(["--checkpoint", STEP_DIR, "--out", DIR]) -> int`` in kiln's registration
  process: writes the checkpoint as a Hugging Face model folder (``kiln_trainer.export`` checks it and
  registers it as the version's model). Without one, a checkpoint of this trainer cannot be registered.

It is loaded from the user's package, never from kiln's source tree: a spec naming a module of
``kiln`` or ``kiln_trainer`` (or a module beside them in a source checkout) is refused; ``kiln`` is
how a recipe asks for kiln's trainer. ``validate_entrypoint`` imports the module in the calling
process (so an entry point's module must be importable without side effects) and checks the
attribute is a function of one argument: kiln calls it before any worker starts, and every error names
the spec and what is wrong with it. ``trainer_record`` says which trainer, and which version of its
distribution, made a checkpoint (``importlib.metadata``: the distribution that provides the
module's top-level package; for ``kiln``, the one that provides ``kiln_trainer``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kiln_trainer.errors import RecipeError

__all__ = [
    "ENTRYPOINT_CALLS",
    "ENTRYPOINT_ROLES",
    "KILN_TRAINER",
    "KILN_TRAIN_ENTRYPOINT",
    "RECIPE_TRAINER_KEY",
    "SAMPLE_LOG_ENV",
    "EntrypointError",
    "TrainerArgs",
    "TrainerSpec",
    "load_entrypoint",
    "parse_override",
    "parse_trainer",
    "parse_trainer_args",
    "read_recipe_toml",
    "read_recipe_trainer",
    "trainer_arg_parser",
    "trainer_from_recipe_data",
    "trainer_record",
    "validate_entrypoint",
    "validate_trainer",
]

KILN_TRAINER: Final = "kiln"
"""The trainer a recipe gets when it names none: kiln's own."""
KILN_TRAIN_ENTRYPOINT: Final = "kiln_trainer.train:main"
"""What ``kiln`` resolves to."""
RECIPE_TRAINER_KEY: Final = "trainer"
"""The recipe's top-level key (a string) or table (``train``, ``evaluate``, ``export``)."""
ENTRYPOINT_ROLES: Final = ("train", "evaluate", "export")
"""The entry points a ``[trainer]`` table may name; ``train`` is required."""
ENTRYPOINT_CALLS: Final = {"train": "main(argv)", "evaluate": "load(checkpoint)", "export": "main(argv)"}
"""How kiln calls each role's function (module docstring): each takes one positional argument."""
SAMPLE_LOG_ENV: Final = "KILN_SAMPLE_LOG"
"""``1``: the default of ``--sample-log`` (a trainer that keeps no sample log may ignore it)."""
_KILN_PACKAGES: Final = frozenset({"kiln", "kiln_trainer"})
_SPEC_RE = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")


class EntrypointError(RecipeError):
    """A trainer spec that cannot be a trainer: bad syntax, no such module, no such attribute, not
    a function of ``argv``, a module inside kiln's source tree. A fault a retry repeats (exit 2)."""


# -- the arguments every rank gets ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerArgs:
    """What ``argv`` hands a train entry point (the names of ``parse_trainer_args``' namespace)."""

    manifest: Path
    """The TrainingManifest JSON."""
    recipe: Path
    """The recipe TOML; ``overrides`` go on top of it."""
    run_dir: Path
    """The run directory, shared by every node. The resume point is its newest committed checkpoint."""
    overrides: tuple[str, ...] = ()
    """``section.key=value`` recipe overrides, in order (``parse_override``)."""
    max_steps: int | None = None
    """Stop this invocation after this step (the recipe's ``train.steps`` is the run's end)."""
    sample_log: bool = False
    """Log the global sample ids each rank consumes per step (kiln's trainer; others may ignore it)."""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> TrainerArgs:
        return cls(manifest=ns.manifest, recipe=ns.recipe, run_dir=ns.run_dir, overrides=tuple(ns.overrides),
                   max_steps=ns.max_steps, sample_log=ns.sample_log)


def trainer_arg_parser(prog: str = "trainer", description: str | None = None) -> argparse.ArgumentParser:
    """The parser of the arguments kiln passes every rank (``kiln.launchers.base.trainer_args``)::

        --manifest M.json --recipe R.toml --run-dir RUN [--set SECTION.KEY=VALUE ...] [--max-steps N] [--sample-log]

    A trainer may add arguments of its own to it; kiln passes only these."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--manifest", required=True, type=Path, help="TrainingManifest JSON")
    parser.add_argument("--recipe", required=True, type=Path, help="recipe TOML (training/recipes/*.toml)")
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory (checkpoints, metrics, result)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe field (repeatable)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop this invocation after this step")
    parser.add_argument(
        "--sample-log", action="store_true", default=os.environ.get(SAMPLE_LOG_ENV, "") not in ("", "0"),
        help=f"log the global sample ids each rank consumes per step (or {SAMPLE_LOG_ENV}=1)",
    )
    return parser


def parse_trainer_args(argv: Sequence[str] | None = None, prog: str = "trainer") -> argparse.Namespace:
    """``argv`` parsed as every rank gets it (``TrainerArgs.from_namespace`` types it). A bad
    argument exits 2 (argparse), which is ``EXIT_FATAL``: a retry repeats it."""
    return trainer_arg_parser(prog).parse_args(None if argv is None else list(argv))


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` → (section, key, value); value parsed as a TOML value, else a bare string."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise RecipeError(f"override {text!r}: key must be section.key, got {dotted!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # `--set train.device=cpu` without TOML quotes
    return parts[0], parts[1], value


# -- the spec ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSpec:
    """The trainer a recipe names: ``kiln``, or the user's entry points (``package.module:function``)."""

    train: str = KILN_TRAINER
    """``kiln`` or the train entry point."""
    evaluate: str = ""
    """The user's checkpoint loader for evaluation, ``load(checkpoint)`` (optional; not with ``kiln``,
    whose GPT kiln loads itself). Without it kiln cannot evaluate this trainer's checkpoints."""
    export: str = ""
    """The user's export to a Hugging Face folder, ``main(argv)`` (optional; not with ``kiln``, whose
    export is kiln's). Without it kiln cannot register this trainer's checkpoints."""

    def __post_init__(self) -> None:
        for role in ENTRYPOINT_ROLES:
            value = getattr(self, role)
            if not isinstance(value, str):
                raise EntrypointError(f"trainer.{role} = {value!r}: must be a string (package.module:function)")
        if self.train == KILN_TRAINER:
            for role in ("evaluate", "export"):
                if getattr(self, role):
                    raise EntrypointError(f"trainer.{role} = {getattr(self, role)!r}: only with a trainer of your "
                                          f"own (trainer.train = {KILN_TRAINER!r} evaluates and exports with kiln's)")
            return
        for role in ENTRYPOINT_ROLES:
            value = getattr(self, role)
            if value or role == "train":
                _check_syntax(value, f"trainer.{role}")

    @property
    def is_kiln(self) -> bool:
        return self.train == KILN_TRAINER

    def entrypoints(self) -> dict[str, str]:
        """``{role: "module:function"}`` of every entry point named (``kiln``: its train entry point)."""
        if self.is_kiln:
            return {"train": KILN_TRAIN_ENTRYPOINT}
        return {role: getattr(self, role) for role in ENTRYPOINT_ROLES if getattr(self, role)}

    def to_recipe_value(self) -> str | dict[str, str]:
        """What a resolved recipe records under ``trainer``: the spec string when only ``train`` is
        named, else the table. (A resolved recipe of ``kiln`` records nothing: its hash stays the one
        recipes had before trainers could be named.)"""
        if not (self.evaluate or self.export):
            return self.train
        return {role: getattr(self, role) for role in ENTRYPOINT_ROLES if getattr(self, role)}

    def describe(self) -> str:
        return ", ".join(f"{role} = {spec!r}" for role, spec in
                         ({"train": self.train} if self.is_kiln else self.entrypoints()).items())


def _check_syntax(spec: str, where: str) -> re.Match[str]:
    match = _SPEC_RE.fullmatch(spec)
    if match is None:
        raise EntrypointError(f"{where} = {spec!r}: not an entry point; expected {KILN_TRAINER!r} or "
                              "package.module:function (a dotted module, a colon, a function name)")
    return match


def parse_trainer(value: Any, where: str = RECIPE_TRAINER_KEY) -> TrainerSpec:
    """A recipe's ``trainer`` value as a spec: absent (``None``) or ``"kiln"``, a spec string, or a
    table with ``train`` and optionally ``evaluate``, ``export``. ``EntrypointError`` naming it."""
    if value is None:
        return TrainerSpec()
    if isinstance(value, str):
        return TrainerSpec(train=value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(ENTRYPOINT_ROLES))
        if unknown:
            raise EntrypointError(f"[{where}]: unknown key(s) {unknown}; known: {list(ENTRYPOINT_ROLES)}")
        if "train" not in value:
            raise EntrypointError(f"[{where}]: no train entry point (train = {KILN_TRAINER!r} or "
                                  "'package.module:function')")
        return TrainerSpec(**{role: value[role] for role in ENTRYPOINT_ROLES if role in value})
    raise EntrypointError(f"{where} = {value!r}: must be a string or a table (train, evaluate, export)")


def trainer_from_recipe_data(data: dict[str, Any]) -> TrainerSpec:
    """Take the ``trainer`` key out of a recipe's parsed TOML (with overrides applied) and parse it."""
    return parse_trainer(data.pop(RECIPE_TRAINER_KEY, None))


def apply_trainer_overrides(data: dict[str, Any], overrides: Sequence[str]) -> None:
    """Apply the ``trainer.*`` overrides to a recipe's parsed TOML; a top-level string ``trainer``
    becomes ``{"train": ...}`` first, so ``--set trainer.evaluate=...`` adds to it."""
    for text in overrides:
        section, key, value = parse_override(text)
        if section != RECIPE_TRAINER_KEY:
            continue
        current = data.get(RECIPE_TRAINER_KEY)
        table = {"train": current} if isinstance(current, str) else current
        if table is None:
            table = {}
        if not isinstance(table, dict):
            raise RecipeError(f"override {text!r}: {RECIPE_TRAINER_KEY} is not a table in the recipe")
        table[key] = value
        data[RECIPE_TRAINER_KEY] = table


def read_recipe_toml(path: str | Path) -> dict[str, Any]:
    """A recipe file's TOML table; ``RecipeError`` naming the file when it is missing, unreadable
    or not TOML (``load_recipe`` and ``read_recipe_trainer`` both read recipes through it)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise RecipeError(f"recipe file {path} not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"recipe file {path}: invalid TOML: {exc}") from exc
    except OSError as exc:
        raise RecipeError(f"recipe file {path}: {exc.strerror or exc}") from exc


def read_recipe_trainer(path: str | Path, overrides: Sequence[str] = ()) -> TrainerSpec:
    """The trainer a recipe file names, with its ``trainer.*`` overrides: what ``load_recipe``
    resolves, read without the rest of the recipe's schema (kiln's worker reads it on every rank)."""
    data = read_recipe_toml(path)
    apply_trainer_overrides(data, overrides)
    try:
        return trainer_from_recipe_data(data)
    except EntrypointError as exc:
        raise EntrypointError(f"recipe file {path}: {exc}") from None


# -- resolving, validating, loading -----------------------------------------------------------------


def _kiln_source_dirs() -> tuple[Path, ...]:
    """The directories of kiln's source tree: ``kiln_trainer``'s parent (``training/`` in a checkout),
    unless that is an installation's site-packages, which holds everybody's packages."""
    parent = Path(__file__).resolve().parents[2]
    if parent.name in ("site-packages", "dist-packages"):
        return ()
    return (parent,)


def _split(spec: str, where: str) -> tuple[str, str]:
    match = _check_syntax(spec, where)
    return match["module"], match["attr"]


def _refuse_kiln_tree(spec: str, module: str, where: str) -> None:
    top = module.split(".")[0]
    if top in _KILN_PACKAGES:
        raise EntrypointError(f"{where} = {spec!r}: module {module} is kiln's own package; name kiln's trainer "
                              f"{KILN_TRAINER!r}, and load your trainer from your own package")
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise EntrypointError(f"{where} = {spec!r}: cannot find module {top}: {exc}") from None
    if found is None:
        raise EntrypointError(f"{where} = {spec!r}: no module named {top!r} on this Python's path "
                              f"(install the trainer's package, or put it on PYTHONPATH)")
    locations = [*(found.submodule_search_locations or ()), *([found.origin] if found.origin else [])]
    for location in locations:
        resolved = Path(location).resolve()
        for tree in _kiln_source_dirs():
            if resolved.is_relative_to(tree):
                raise EntrypointError(f"{where} = {spec!r}: module {top} is inside kiln's source tree ({tree}); "
                                      "a trainer of your own is loaded from your own package")


def load_entrypoint(spec: str, where: str = "trainer.train") -> Callable[..., Any]:
    """Import ``package.module`` and return its ``function`` (``kiln``: kiln's trainer's ``main``);
    ``EntrypointError`` naming the spec: bad syntax, no such module, the module failing to import,
    no such attribute, not callable, a module inside kiln's source tree."""
    target = KILN_TRAIN_ENTRYPOINT if spec == KILN_TRAINER else spec
    module_name, attr = _split(target, where)
    if spec != KILN_TRAINER:
        _refuse_kiln_tree(spec, module_name, where)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(f"{exc.name}.")):
            raise EntrypointError(f"{where} = {spec!r}: no module named {exc.name!r}") from None
        raise EntrypointError(f"{where} = {spec!r}: importing {module_name} failed: {exc}") from exc
    except Exception as exc:  # the user's module raised while importing: name it, whatever it was
        raise EntrypointError(f"{where} = {spec!r}: importing {module_name} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EntrypointError(f"{where} = {spec!r}: module {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise EntrypointError(f"{where} = {spec!r}: {module_name}.{attr} is not callable "
                              f"(a {type(obj).__name__})")
    return obj


def validate_entrypoint(spec: str, where: str = "trainer.train") -> Callable[..., Any]:
    """``load_entrypoint``, and the function must take one positional argument: ``argv`` (a list of
    strings) for ``train`` and ``export``, the checkpoint for ``evaluate`` (``ENTRYPOINT_CALLS``, by
    the role ``where`` names)."""
    function = load_entrypoint(spec, where)
    call = ENTRYPOINT_CALLS.get(where.rpartition(".")[2], ENTRYPOINT_CALLS["train"])
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return function  # a builtin or C function without a signature: calling it will tell
    try:
        signature.bind(object())
    except TypeError as exc:
        raise EntrypointError(f"{where} = {spec!r}: cannot be called as {call} ({exc}); "
                              f"its signature is {signature}") from None
    return function


def validate_trainer(spec: TrainerSpec) -> dict[str, Callable[..., Any]]:
    """Every entry point ``spec`` names, imported and checked (``validate_entrypoint``), by role.
    ``kiln``: only that its trainer's module is there (importing it would import torch)."""
    if spec.is_kiln:
        module_name, _ = _split(KILN_TRAIN_ENTRYPOINT, "trainer.train")
        if importlib.util.find_spec(module_name) is None:
            raise EntrypointError(f"trainer.train = {KILN_TRAINER!r}: kiln's trainer ({module_name}) is not "
                                  "installed in this Python")
        return {}
    return {role: validate_entrypoint(target, f"trainer.{role}") for role, target in spec.entrypoints().items()}


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def trainer_record(spec: TrainerSpec) -> dict[str, str]:
    """Which trainer, from which distribution at which version: ``{"spec", "distribution",
    "version"}`` (``spec``: ``kiln`` or the train entry point). The distribution is the one that
    provides the train module's top-level package; a package found on the path but not installed
    records ``""`` for both, unless it has a ``__version__`` (then ``distribution`` stays ``""``)."""
    module_name, _ = _split(KILN_TRAIN_ENTRYPOINT if spec.is_kiln else spec.train, "trainer.train")
    top = module_name.split(".")[0]
    names = _packages_distributions().get(top) or []
    distribution, version = (names[0], "") if names else ("", "")
    if distribution:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            distribution = ""
    if not version:
        loaded = sys.modules.get(top)
        declared = getattr(loaded, "__version__", "") if loaded is not None else ""
        version = declared if isinstance(declared, str) else ""
    record = {"spec": spec.train, "distribution": distribution, "version": version}
    if not spec.is_kiln:
        record.update({role: target for role, target in spec.entrypoints().items() if role != "train"})
    return record
