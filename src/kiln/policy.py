"""Policies: the single source of every difference between sandbox and production.

A DAG is built from the one factory plus one of these objects; nothing else in kiln branches on
"is this production?". The sandbox policy refuses to write any production name (``PolicyError``,
never retried).

What production trains on and serves — its corpus, its contract, its registered model — is not
code: it is the reviewed file ``config/production.toml`` (``ProductionConfig``), read when this
module is imported (a small shipped file, like the recipes the DAG's form lists). Every candidate
version records its values and sha256 (``kiln.registry``), so ``kiln audit`` shows when a change
took effect. The separation does not rest on that file: sandbox names are ``sandbox.*`` and a
production name never is, whatever the file says.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.errors import PolicyError
from kiln.shipped import CHECKOUT, CONFIG_DIR, RECIPES_DIR

if TYPE_CHECKING:
    from kiln.data.mixtures import Mixture

PRODUCTION_RECIPES_DIR = RECIPES_DIR / "production"
PRODUCTION_CONFIG = CONFIG_DIR / "production.toml"
"""The reviewed file the production policy's corpus, contract, model and recipe come from."""
PRODUCTION_CONFIG_ENV = "KILN_PRODUCTION_CONFIG"
"""A deployment's own reviewed production config, instead of the shipped ``config/production.toml``
(read when this module is imported, in every process of the deployment: set it in the environment
the whole stack starts with). kiln's own end-to-end tests deploy ``tests/e2e/production.toml``."""
DEFAULT_PRODUCTION_RECIPE = "production/small.toml"
DEFAULT_PRODUCTION_SCHEDULE = "0 3 * * 1"
"""Production retrains every Monday at 03:00 UTC unless its reviewed config says otherwise."""
DEFAULT_CHAMPION_WATCH_SCHEDULE = "30 5 * * *"
"""Daily, off the Monday 03:00 retrain: a stale champion is caught within a day."""
PRODUCTION_MIXTURE_NAME = "production"
"""The name of the mixture a ``[mixture]`` table of the production config declares (its metrics,
tags and snapshot set say it)."""
SANDBOX_PREFIX = "sandbox."
"""Every registered model the sandbox writes is named ``sandbox.*``; no production name may be."""
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProductionConfig:
    """The reviewed inputs of the production policy (``config/production.toml``): one corpus under
    one contract, or a ``[mixture]`` of corpora each under its own pinned contract."""

    corpus: str = ""
    """Corpus folder under the corpus root: the only corpus production snapshots. With a mixture,
    its first source's (the sandbox form's default corpus)."""
    contract: str = ""
    """``NAME@VERSION`` of the contract production validates with (the version is required). With a
    mixture, its first source's."""
    mixture: Mixture | None = None
    """The corpora production trains on, mixed by weight (``kiln.data.mixtures``; every source's
    contract pinned), declared in the file's ``[mixture]`` table; None: ``corpus`` alone."""
    model: str
    """Registered model that serves; candidates go to ``<model>.candidates``, sandbox runs to
    ``sandbox.<model>``."""
    recipe: str = DEFAULT_PRODUCTION_RECIPE
    """The pinned recipe every production run trains (path under ``training/recipes``): one of the
    reviewed recipes under ``training/recipes/production/``, nothing else."""
    schedule: str = DEFAULT_PRODUCTION_SCHEDULE
    """Cron (UTC, five fields) of scheduled retraining; ``""``: none, runs start by hand and on
    corpus announcements only."""
    champion_watch_schedule: str = DEFAULT_CHAMPION_WATCH_SCHEDULE
    """Cron (UTC, five fields) of the champion watch; ``""``: the watch runs by hand only."""
    source: str = "config/production.toml"
    """Where the values were read (shown in the DAG doc and the task log)."""
    sha256: str = ""
    """sha256 of the file's bytes: recorded on every candidate version."""

    def __post_init__(self) -> None:
        from kiln.data.contracts import parse_contract_ref
        from kiln.data.snapshot import CORPUS_NAME
        from kiln.errors import ContractError

        if self.mixture is not None:
            _pin_mixture(self)
        for name in ("corpus", "contract", "model", "recipe", "schedule", "champion_watch_schedule"):
            if not isinstance(getattr(self, name), str):
                raise PolicyError(f"{self.source}: {name} must be a string, got {getattr(self, name)!r}")
        for name in ("schedule", "champion_watch_schedule"):
            cron = getattr(self, name)
            if cron and not _is_cron(cron):
                raise PolicyError(f"{self.source}: {name} {cron!r} is not a cron expression of five fields "
                                  '(minute hour day-of-month month day-of-week, UTC), nor "" for none')
        if not CORPUS_NAME.fullmatch(self.corpus):
            raise PolicyError(f"{self.source}: corpus {self.corpus!r} is not a corpus name ([a-z0-9][a-z0-9_.-]*)")
        try:
            _, version = parse_contract_ref(self.contract)
        except ContractError as exc:
            raise PolicyError(f"{self.source}: contract: {exc}") from None
        if version is None:
            raise PolicyError(f"{self.source}: contract {self.contract!r} must pin a version (NAME@VERSION)")
        if not _MODEL_NAME.fullmatch(self.model):
            raise PolicyError(f"{self.source}: model {self.model!r} is not a registered-model name "
                              "([A-Za-z0-9][A-Za-z0-9_.-]*, at most 100 characters)")
        if self.model.lower().startswith(SANDBOX_PREFIX):
            raise PolicyError(f"{self.source}: model {self.model!r} is in the sandbox's namespace ({SANDBOX_PREFIX}*); "
                              "a production model may never be")
        recipe = (RECIPES_DIR / self.recipe).resolve()
        if (self.recipe.startswith("/") or PRODUCTION_RECIPES_DIR not in recipe.parents
                or recipe.suffix != ".toml" or not recipe.is_file()):
            shipped = ", ".join(sorted(p.relative_to(RECIPES_DIR).as_posix()
                                       for p in PRODUCTION_RECIPES_DIR.glob("*.toml")))
            raise PolicyError(f"{self.source}: recipe {self.recipe!r} is not one of the reviewed production recipes "
                              f"under training/recipes/production/ ({shipped})")
        from kiln_trainer.contract import RecipeError
        from kiln_trainer.contract.entrypoint import read_recipe_trainer

        try:  # the spec's syntax here; that it resolves, in the run's first task (kiln.stages.inputs)
            read_recipe_trainer(recipe)
        except RecipeError as exc:
            raise PolicyError(f"{self.source}: recipe {self.recipe!r}: {exc}") from None

    def values(self) -> dict[str, str]:
        """What the file sets (what a model version records); the recipe only when it is not the
        default, so versions trained before the key existed record the same values."""
        if self.mixture is None:
            values = {"corpus": self.corpus, "contract": self.contract, "model": self.model}
        else:  # the sources as declared, so an edited weight or contract is a changed config too
            values = {"mixture": json.dumps([s.to_json() for s in self.mixture.sources], sort_keys=True,
                                            separators=(",", ":")), "model": self.model}
        if self.recipe != DEFAULT_PRODUCTION_RECIPE:
            values["recipe"] = self.recipe
        if self.schedule != DEFAULT_PRODUCTION_SCHEDULE:
            values["schedule"] = self.schedule
        if self.champion_watch_schedule != DEFAULT_CHAMPION_WATCH_SCHEDULE:
            values["champion_watch_schedule"] = self.champion_watch_schedule
        return values


def _pin_mixture(config: ProductionConfig) -> None:
    """Production's mixture pins every source's contract (NAME@VERSION) in the reviewed file, as a
    one-corpus config pins its contract: a corpus' own ``corpus.json`` may not choose it."""
    from kiln.data.contracts import parse_contract_ref

    mixture = config.mixture
    assert mixture is not None
    for i, source in enumerate(mixture.sources):
        if source.contract is None or parse_contract_ref(source.contract)[1] is None:
            raise PolicyError(f"{config.source}: mixture.sources[{i}] ({source.name!r}): contract "
                              f"{source.contract!r} must pin a version (contract = \"NAME@VERSION\"): production's "
                              "inputs are pinned in this file")
    first = mixture.sources[0]
    if not config.corpus and not config.contract:  # frozen: set once, here
        object.__setattr__(config, "corpus", first.corpus)
        object.__setattr__(config, "contract", first.contract)
    elif (config.corpus, config.contract) != (first.corpus, first.contract):
        raise PolicyError(f"{config.source}: corpus and contract come from the [mixture] table, not beside it")


def _is_cron(expression: str) -> bool:
    """Five fields that Airflow's cron timetables (croniter) accept."""
    from croniter import croniter

    return len(expression.split()) == 5 and croniter.is_valid(expression)


def production_config_path() -> Path:
    """The reviewed production config this process reads: ``KILN_PRODUCTION_CONFIG`` or the shipped one."""
    chosen = os.environ.get(PRODUCTION_CONFIG_ENV, "").strip()
    return Path(chosen).expanduser().resolve() if chosen else PRODUCTION_CONFIG


def load_production_config(path: Path | None = None) -> ProductionConfig:
    """Read the production policy's reviewed inputs (``path``, else ``production_config_path()``);
    ``PolicyError`` naming the file, and the line (a TOML error) or the key (a missing, unknown or
    bad value)."""
    path = production_config_path() if path is None else path
    shown = path.relative_to(CHECKOUT).as_posix() if path.is_relative_to(CHECKOUT) else str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"{shown}: cannot read the production config: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{shown}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{shown}: not valid TOML: {exc}") from None
    keys: tuple[str, ...] = ("corpus", "contract", "model")
    optional = ("recipe", "schedule", "champion_watch_schedule")
    unknown = sorted(set(data) - set(keys) - set(optional) - {"mixture"})
    if unknown:
        raise PolicyError(f"{shown}: unknown key(s) {', '.join(unknown)}; the file sets "
                          f"{', '.join(keys)} (or model and a [mixture] table) and optionally {', '.join(optional)}")
    values = {k: data[k] for k in (*keys, *optional) if k in data}
    if "mixture" in data:
        from kiln.data.mixtures import parse_mixture
        from kiln.errors import MixtureError

        both = [k for k in ("corpus", "contract") if k in data]
        if both:
            raise PolicyError(f"{shown}: {' and '.join(both)} beside a [mixture] table: production trains one corpus "
                              "(corpus, contract) or a mixture (each source's corpus and contract), not both")
        try:
            mixture = parse_mixture(data["mixture"], name=PRODUCTION_MIXTURE_NAME, origin=f"{shown} [mixture]")
        except MixtureError as exc:
            raise PolicyError(str(exc)) from None
        values["mixture"] = mixture
        keys = ("model",)
    missing = [k for k in keys if k not in data]
    if missing:
        raise PolicyError(f"{shown}: missing key(s) {', '.join(missing)}"
                          + ("" if "mixture" in data else " (or a [mixture] table instead of corpus and contract)"))
    return ProductionConfig(**values, source=shown, sha256=hashlib.sha256(raw).hexdigest())


PRODUCTION_INPUTS = load_production_config()
PRODUCTION_MODEL = PRODUCTION_INPUTS.model
"""The registered model that serves: only the production identity may write it."""
APPROVAL_TIMEOUT_MIN_S = 60
APPROVAL_TIMEOUT_MAX_S = 30 * 24 * 3600
"""Bounds of a review's response timeout: a shorter one leaves no time to read the report, a longer
one parks a production run (``max_active_runs = 1``) for more than a month."""
LAUNCHERS = ("local", "slurm", "kubernetes")
LAUNCHER_FIELDS = ("launcher", "slurm_partition", "slurm_qos", "slurm_conf", "k8s_namespace", "k8s_queue",
                   "k8s_priority_class", "k8s_checkpoint_claim", "k8s_image", "k8s_runtime", "straggler_action",
                   "min_nodes", "replacement_timeout_s", "spare_nodes")
"""What a deployment may set about where a policy's training runs (``Policy.with_launcher``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GatePolicy:
    """Thresholds of the promotion gate (``kiln.registry.decide``)."""

    max_bits_per_byte: float
    """Absolute ceiling on held-out bits per byte; above it a candidate is held."""
    max_regression: float
    """Largest allowed increase of bits per byte over the current champion (absolute)."""

    def __post_init__(self) -> None:
        if not self.max_bits_per_byte > 0:
            raise PolicyError(f"gate.max_bits_per_byte must be > 0, got {self.max_bits_per_byte}")
        if self.max_regression < 0:
            raise PolicyError(f"gate.max_regression must be >= 0, got {self.max_regression}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """Everything that differs between sandbox and production runs."""

    name: Literal["sandbox", "production"]
    dag_id: str
    description: str
    pool: str
    """Airflow pool every task of the DAG runs in (reserved capacity for production)."""
    pool_slots: int
    priority_weight: int
    retries: int
    owner: str
    tags: tuple[str, ...]
    corpus: str
    """Name of the corpus this policy snapshots (production: only the registered corpus)."""
    contract: str
    """``name@version`` of the data contract shards are validated against."""
    max_quarantine_share: float
    """Data gate: the run fails (no retry) when more than this share of shards is quarantined."""
    validation_batch_shards: int
    """Smallest batch of shards per mapped validation task: one process (one GE import, ~4 s) and
    one stacked GE run (~0.1 s whatever the rows) check a batch, so a batch must be large for both
    to vanish next to reading the shards (``benchmarks/validation_vs_pyarrow.py``: by batch size).
    Batches grow so that there are never more than ``validation_max_tasks`` of them."""
    validation_max_tasks: int = 512
    """Upper bound on mapped validation tasks, well below Airflow's ``max_map_length`` (1024): with
    batches of at least 500, a 100,000-shard corpus gets 200 tasks, a 1,000,000-shard one 512."""
    default_recipe: str
    """Recipe path relative to ``training/recipes``."""
    recipes_dir: Path
    """Only recipes under this directory may be used."""
    nodes: int
    nproc_per_node: int
    max_restarts: int
    min_nodes: int | None = None
    """Elastic shrink (``kiln.launchers.elastic``): the fewest nodes a job may go on with after losing
    a node that no replacement stands in for within ``replacement_timeout_s`` (the global batch
    stays; gradient accumulation takes up the change). None: the job's node count, never shrink.
    A run asking for fewer nodes than this cannot shrink at all."""
    replacement_timeout_s: int = 60
    """How long, in whole seconds, a job that lost a node waits for a replacement before it goes on
    with the nodes left (only with ``min_nodes``)."""
    spare_nodes: int | None = None
    """Local launcher: node slots that can stand in for lost nodes (a lost node's slot is gone).
    None: a replacement is always there, within ``max_restarts``. Slurm asks ``sinfo`` instead."""
    launcher: str = "local"
    """Launcher backend (``kiln.launchers``): ``local`` (torchrun agents on this machine) or ``slurm``."""
    slurm_partition: str | None = None
    """Slurm partition and QoS when ``launcher == "slurm"`` (production preempts sandbox through
    them on a real cluster; None uses the cluster's defaults)."""
    slurm_qos: str | None = None
    slurm_conf: str | None = None
    """The cluster's ``slurm.conf`` (``SLURM_CONF`` for sbatch/squeue/scancel) when the submit host's
    default (``/etc/slurm/slurm.conf``) is not the cluster to use."""
    straggler_action: Literal["alert", "exclude_node"] = "alert"
    """What a straggler flag from the trainer leads to (``kiln.launchers.stragglers.StragglerWatch``):
    ``alert`` (metric, log line, MLflow tag, the launcher's log) or, on Slurm only, ``exclude_node``:
    end the job and resubmit it with ``--exclude`` of the slow rank's node (it resumes from the last
    committed checkpoint). Detection itself (factor, windows) is the recipe's ``[stragglers]``."""
    k8s_namespace: str = "kiln"
    """Kubernetes launcher: namespace of the TrainJobs, Kueue LocalQueue and WorkloadPriorityClass
    (production outranks sandbox: Kueue admits and may preempt in that order), the PVC holding run
    dirs and checkpoints (mounted at the same path as KILN_HOME), trainer image and runtime."""
    k8s_queue: str = "kiln"
    k8s_priority_class: str | None = None
    k8s_checkpoint_claim: str = "kiln-shared"
    k8s_image: str = "kiln-trainer:cpu"
    k8s_runtime: str = "kiln-torch"
    candidate_model: str
    """Registered model the candidate version is created in."""
    target_model: str
    """Registered model whose ``alias`` is moved on promotion."""
    alias: str
    requires_approval: bool
    pinned_inputs: bool = False
    """Runs take no recipe/corpus/step overrides: the registered corpus and ``default_recipe`` only."""
    schedule_cron: str | None = None
    """Cron (UTC) of scheduled runs; None means runs start only by hand."""
    schedule_on_corpus_asset: bool = False
    """Also run whenever a new snapshot of the corpus is announced (Airflow Asset event)."""
    champion_watch_dag_id: str | None = None
    """DAG that re-evaluates the serving ``alias`` on a schedule and proposes a rollback through a
    review (``kiln.stages.champion_watch``); None: no watch."""
    champion_watch_cron: str | None = None
    """Cron (UTC) of the champion watch; None: the watch DAG runs by hand only."""
    max_active_runs: int = 8
    reviewers: tuple[str, ...] = ()
    approval_timeout_s: int = 24 * 3600
    gate: GatePolicy = field(default_factory=lambda: GatePolicy(max_bits_per_byte=8.0, max_regression=0.05))
    writable_models: tuple[str, ...] = ()
    """Registered-model names this policy may create versions in or move aliases on."""
    mlflow_conn_id: str | None = None
    """Airflow connection (login/password) of the MLflow identity every task of this policy uses
    (``kiln.mlflow_auth.MlflowIdentity``); without it ``KILN_MLFLOW_<POLICY>_USERNAME/PASSWORD``."""
    signing_conn_id: str | None = None
    """Airflow connection holding this policy's private signing key (PEM in its password or its extra's
    ``private_key``), read in this policy's tasks only (``kiln.provenance.keys.use_policy_key``); without
    it ``KILN_<POLICY>_SIGNING_KEY`` / ``_FILE``, else the key under ``KILN_HOME/keys`` (docs/provenance.md)."""
    config: ProductionConfig | None = None
    """The reviewed file corpus, contract and models came from (production); recorded on every version."""

    def __post_init__(self) -> None:
        for name in ("min_nodes", "replacement_timeout_s", "spare_nodes"):
            value = getattr(self, name)
            if (value is not None or name == "replacement_timeout_s") and (
                    isinstance(value, bool) or not isinstance(value, int)):
                raise PolicyError(f"{name} must be a whole number, got {value!r}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise PolicyError(f"min_nodes must be within [1, nodes={self.nodes}] (None: never shrink), "
                              f"got {self.min_nodes}")
        if self.replacement_timeout_s < 0:
            raise PolicyError(f"replacement_timeout_s must be >= 0 seconds, got {self.replacement_timeout_s}")
        if self.spare_nodes is not None and self.spare_nodes < 0:
            raise PolicyError(f"spare_nodes must be >= 0 (None: a replacement is always there), got {self.spare_nodes}")
        if self.launcher not in LAUNCHERS:
            raise PolicyError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.min_nodes is not None and self.launcher == "kubernetes":
            raise PolicyError("min_nodes (elastic shrink) needs launcher 'local' or 'slurm': a TrainJob's node "
                              "count is fixed when it is created")
        if self.champion_watch_cron and not self.champion_watch_dag_id:
            raise PolicyError("champion_watch_cron needs champion_watch_dag_id (the DAG it schedules)")
        if not 1 <= self.validation_batch_shards <= 10_000:
            raise PolicyError(f"validation_batch_shards must be within [1, 10000], got {self.validation_batch_shards}")
        if not 0 <= self.max_quarantine_share <= 1:
            raise PolicyError(f"max_quarantine_share must be within [0, 1], got {self.max_quarantine_share}")
        for model in (self.candidate_model, self.target_model):
            if model not in self.writable_models:
                raise PolicyError(f"policy {self.name!r} names model {model!r} it may not write")
        if self.name == "sandbox" and PRODUCTION_MODEL in self.writable_models:
            raise PolicyError("the sandbox policy may never write the production model")
        outside = [m for m in self.writable_models if m.lower().startswith(SANDBOX_PREFIX) != (self.name == "sandbox")]
        if outside:
            raise PolicyError(
                f"the sandbox policy may never write a name outside {SANDBOX_PREFIX}*: {', '.join(outside)}"
                if self.name == "sandbox" else
                f"policy {self.name!r} may never write a name in the sandbox's namespace {SANDBOX_PREFIX}*: "
                f"{', '.join(outside)}"
            )
        if self.straggler_action not in ("alert", "exclude_node"):
            raise PolicyError(f"straggler_action must be 'alert' or 'exclude_node', got {self.straggler_action!r}")
        if self.straggler_action == "exclude_node" and self.launcher != "slurm":
            raise PolicyError(f"straggler_action 'exclude_node' needs launcher 'slurm' (a scheduler that can place "
                              f"the job elsewhere), not {self.launcher!r}")
        if not APPROVAL_TIMEOUT_MIN_S <= self.approval_timeout_s <= APPROVAL_TIMEOUT_MAX_S:
            raise PolicyError(
                f"approval_timeout_s must be within [{APPROVAL_TIMEOUT_MIN_S}, {APPROVAL_TIMEOUT_MAX_S}] "
                f"seconds, got {self.approval_timeout_s}"
            )

    def with_approval_timeout(self, raw: str | int | None, source: str) -> Policy:
        """This policy with the review timeout an operator set in ``source`` (None/"" keeps it).

        ``PolicyError`` naming ``source`` for a value that is not a whole number of seconds within
        the bounds, so a typo fails the review task that reads it instead of asking a review that
        never times out.
        """
        if raw is None or str(raw).strip() == "":
            return self
        try:
            seconds = int(str(raw).strip())
        except ValueError:
            raise PolicyError(f"{source} must be a whole number of seconds, got {raw!r}") from None
        if not APPROVAL_TIMEOUT_MIN_S <= seconds <= APPROVAL_TIMEOUT_MAX_S:
            raise PolicyError(
                f"{source} must be within [{APPROVAL_TIMEOUT_MIN_S}, {APPROVAL_TIMEOUT_MAX_S}] seconds, got {seconds}"
            )
        return replace(self, approval_timeout_s=seconds)

    def with_launcher(self, raw: str | dict[str, Any] | None, source: str) -> Policy:
        """This policy with the launcher settings a deployment gave in ``source`` (JSON object of
        ``LAUNCHER_FIELDS``, e.g. ``{"launcher": "slurm", "slurm_partition": "gpu"}``; None/"" keeps
        it). Where training runs is the deployment's business; gates, models and pools are not, so
        any other key is refused with ``PolicyError`` naming it."""
        if raw is None or str(raw).strip() == "":
            return self
        from kiln.util.fs import parse_own_json

        try:
            settings = parse_own_json(raw, source) if isinstance(raw, str) else raw
        except ValueError as exc:
            raise PolicyError(f"{source} must be a JSON object, got {raw!r}: {exc}") from None
        if not isinstance(settings, dict):
            raise PolicyError(f"{source} must be a JSON object, got {raw!r}")
        unknown = sorted(set(settings) - set(LAUNCHER_FIELDS))
        if unknown:
            raise PolicyError(f"{source} may set only {', '.join(LAUNCHER_FIELDS)}; not {', '.join(unknown)}")
        return replace(self, **settings)

    def launcher_options(self, shared_root: Path | None = None) -> dict[str, Any]:
        """Constructor options of this policy's launcher backend (``kiln.launchers.get_launcher``),
        JSON-safe so a deferrable trigger can rebuild the launcher from them."""
        if self.launcher == "slurm":
            options: dict[str, Any] = {"partition": self.slurm_partition, "qos": self.slurm_qos}
            if self.slurm_conf:
                options["env"] = {"SLURM_CONF": self.slurm_conf}
            return options
        if self.launcher == "kubernetes":
            return {"namespace": self.k8s_namespace, "queue": self.k8s_queue, "priority_class": self.k8s_priority_class,
                    "checkpoint_claim": self.k8s_checkpoint_claim, "image": self.k8s_image, "runtime": self.k8s_runtime,
                    "shared_root": str(shared_root) if shared_root else None}
        return {}

    def check_model_write(self, model: str) -> None:
        """Refuse, before any request is sent, a write to a model this policy does not own."""
        if model not in self.writable_models:
            raise PolicyError(
                f"policy {self.name!r} may not write registered model {model!r} "
                f"(writable: {', '.join(self.writable_models)})"
            )

    @property
    def mixture(self) -> Mixture | None:
        """The mixture this policy's every run trains (production's reviewed ``[mixture]``), or None:
        its runs train ``corpus``, or what their ``mixture`` parameter names (sandbox)."""
        return self.config.mixture if self.config is not None else None

    def resolve_recipe(self, recipe: str | None) -> Path:
        """Recipe path for a run; production accepts only its pinned recipes."""
        rel = recipe or self.default_recipe
        path = (RECIPES_DIR / rel).resolve()
        allowed = self.recipes_dir.resolve()
        if allowed not in path.parents:
            raise PolicyError(f"policy {self.name!r} allows only recipes under {allowed}, not {rel!r}")
        if path.suffix != ".toml" or not path.is_file():
            raise PolicyError(f"recipe {rel!r} does not exist under {RECIPES_DIR}")
        return path

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data["recipes_dir"] = str(Path("training", "recipes", self.recipes_dir.relative_to(RECIPES_DIR)))
        data["config"] = f"{self.config.source} (sha256 {self.config.sha256[:16]}…)" if self.config else None
        if self.mixture is not None:  # its sources, in place of the first one's corpus and contract
            data["corpus"] = data["contract"] = None
            data["mixture"] = ", ".join(f"{s.name}: {s.corpus} under {s.contract} x{s.weight:g}"
                                        for s in self.mixture.sources)
        return data

    def doc_md(self, run_time_settings: Sequence[tuple[str, str, str]] = ()) -> str:
        """The DAG's doc: the policy's settings as coded, then the deployment settings read at run
        time (``run_time_settings``: Variable, what it sets, which task reads it). The DAG file is
        parsed without reading them, so the doc cannot show their values: the task log does."""
        rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in self.summary().items() if k not in ("description",))
        source = (f"; corpus, contract, models and recipe from the reviewed `{self.config.source}`" if self.config else "")
        doc = f"{self.description}\n\n**Policy `{self.name}`** (as coded{source})\n\n| setting | value |\n|---|---|\n{rows}\n"
        if run_time_settings:
            settings = "\n".join(f"| `{name}` (or `AIRFLOW_VAR_{name.upper()}`) | {sets} | {read_by} |"
                                  for name, sets, read_by in run_time_settings)
            doc += (
                "\n**Set by this deployment, read at run time.** Each Airflow Variable below overrides the coded "
                "value when the task that needs it starts (never when this file is parsed), so a change applies "
                "to the next task that starts; that task's log says the value in force and where it came from. "
                "A bad value fails that task, without retry, naming the Variable.\n\n"
                f"| Airflow Variable | sets | read by |\n|---|---|---|\n{settings}\n"
            )
        return doc


def build_sandbox_policy(config: ProductionConfig) -> Policy:
    """The sandbox policy next to the production config ``config``: its corpus as the form's default,
    its model under ``sandbox.``."""
    return Policy(
        name="sandbox",
        dag_id="kiln_sandbox",
        description=(
            "Free experiments: trigger from the form, any recipe under `training/recipes/`, "
            "registers only under sandbox model names, lower priority in its own pool."
        ),
        pool="kiln_sandbox",
        pool_slots=1,
        priority_weight=1,
        retries=1,
        owner="ml-platform",
        tags=("kiln", "sandbox"),
        corpus=config.corpus,
        contract=config.contract,
        max_quarantine_share=0.5,
        validation_batch_shards=500,
        default_recipe="tiny.toml",
        recipes_dir=RECIPES_DIR,
        nodes=1,
        nproc_per_node=1,
        max_restarts=1,
        # Never shrink unless a deployment says so (launcher Variable: min_nodes, spare_nodes); an
        # experiment waits a minute for a replacement, then goes on.
        min_nodes=None,
        replacement_timeout_s=60,
        k8s_queue="kiln-sandbox",
        k8s_priority_class="kiln-sandbox",
        candidate_model=SANDBOX_PREFIX + config.model,
        target_model=SANDBOX_PREFIX + config.model,
        alias="sandbox-champion",
        requires_approval=False,
        gate=GatePolicy(max_bits_per_byte=8.0, max_regression=8.0),
        writable_models=(SANDBOX_PREFIX + config.model,),
        mlflow_conn_id="kiln_mlflow_sandbox",
        signing_conn_id="kiln_signing_sandbox",
    )


def build_production_policy(config: ProductionConfig) -> Policy:
    """The production policy with the reviewed inputs ``config``."""
    return Policy(
        name="production",
        dag_id="kiln_production",
        description=(
            "Regulated retraining: scheduled and triggered by new corpus snapshots, pinned recipes, "
            "strict data contract, human approval before the `champion` alias moves."
        ),
        pool="kiln_production",
        pool_slots=1,
        priority_weight=100,
        retries=2,
        owner="ml-platform",
        tags=("kiln", "production"),
        corpus=config.corpus,
        contract=config.contract,
        max_quarantine_share=0.25,
        validation_batch_shards=500,
        default_recipe=config.recipe,
        recipes_dir=PRODUCTION_RECIPES_DIR,
        nodes=2,
        nproc_per_node=1,
        max_restarts=2,
        # Never shrink unless a deployment says so; a retrain is long, so waiting five minutes for a
        # re-provisioned node costs less than running the rest of it on fewer.
        min_nodes=None,
        replacement_timeout_s=300,
        k8s_queue="kiln-production",
        k8s_priority_class="kiln-production",
        candidate_model=f"{config.model}.candidates",
        target_model=config.model,
        alias="champion",
        requires_approval=True,
        pinned_inputs=True,
        schedule_cron=config.schedule or None,
        schedule_on_corpus_asset=True,
        champion_watch_dag_id="kiln_champion_watch",
        champion_watch_cron=config.champion_watch_schedule or None,
        max_active_runs=1,
        reviewers=("demo-reviewer", "reviewer"),
        approval_timeout_s=24 * 3600,
        gate=GatePolicy(max_bits_per_byte=7.5, max_regression=0.05),
        writable_models=(f"{config.model}.candidates", config.model),
        mlflow_conn_id="kiln_mlflow_production",
        signing_conn_id="kiln_signing_production",
        config=config,
    )


SANDBOX = build_sandbox_policy(PRODUCTION_INPUTS)
PRODUCTION = build_production_policy(PRODUCTION_INPUTS)

POLICIES: dict[str, Policy] = {p.name: p for p in (SANDBOX, PRODUCTION)}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None


def owning_policy(model: str) -> Policy | None:
    """The policy that may write registered model ``model`` (its versions are signed with that policy's
    key); None when no policy writes it."""
    return next((p for p in POLICIES.values() if model in p.writable_models), None)
