"""Defining agents: a name, a version, a state schema and steps.

Each step is a plain function ``(state, ctx) -> next step name | None``. Given as a list,
the steps form a pipeline: returning ``None`` moves to the next one and the last one ends the
run. Given with the ``@agent.step`` decorator, returning ``None`` ends the run. Returning
``END`` ends it from anywhere; ``END("declined")`` also names how it ended (its outcome,
shown beside its status), as does ``ctx.outcome("declined")`` in the step that ends it.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from durability.errors import AgentDefinitionError, SchemaViolation, UnknownAgent

OUTCOME_MAX = 120  # Run.outcome's column


class Ending:
    """What ``END(outcome)`` returns: the end of the run, with the agent's word for how it
    ended ("declined", "rejected at publish")."""

    __slots__ = ("outcome",)

    def __init__(self, outcome: str) -> None:
        self.outcome = checked_outcome(outcome)

    def __repr__(self) -> str:
        return f"END({self.outcome!r})"


class _End(str):
    """``END``: returned by a step, ends the run; called, ends it with an outcome."""

    __slots__ = ()

    def __call__(self, outcome: str) -> Ending:
        return Ending(outcome)


def checked_outcome(outcome: Any) -> str:
    """An outcome as stored: a short line of text. Anything else is the agent's mistake,
    said now rather than cut or mangled at the run's end."""
    if not isinstance(outcome, str):
        raise AgentDefinitionError(f"an outcome is text, not {type(outcome).__name__}")
    text = " ".join(outcome.split())
    if not text or len(text) > OUTCOME_MAX:
        raise AgentDefinitionError(
            f"an outcome is 1 to {OUTCOME_MAX} characters of text, not {len(text)}"
        )
    return text


END = _End("__end__")
DURABILITY_LEVELS = ("strict", "relaxed", "replicated", "periodic")

StepFn = Callable[[dict, Any], "str | None"]
Upgrade = Callable[[dict], dict]


class Agent:
    """An agent definition. Creating one registers it under its name."""

    def __init__(
        self,
        name: str,
        *,
        version: str | int = "1",
        steps: Sequence[StepFn] | Mapping[str, StepFn] | None = None,
        start: str | None = None,
        schema: Any = None,
        input_schema: Any = None,
        invariants: Iterable[Callable[[dict], str | None]] = (),
        initial_state: Callable[[Any], dict] | None = None,
        schema_version: int = 1,
        upgrades: Mapping[int, Upgrade] | None = None,
        transient: tuple[type[BaseException], ...] = (),
        max_retries: int = 5,
        retry_base: float = 1.0,
        retry_cap: float = 300.0,
        step_timeout: float | None = None,
        durability: str = "strict",
        periodic_steps: int = 10,
        periodic_seconds: float = 5.0,
        compatible_versions: Iterable[str | int] = (),
        max_concurrent: int | None = None,
        limits: Mapping[str, str] | None = None,
        keep_days: float | None = None,
        keep_checkpoints: str = "all",
        compact_after_days: float = 7.0,
        packages: Iterable[str] = (),
        description: str = "",
        register: bool = True,
    ) -> None:
        if not name or not isinstance(name, str):
            raise AgentDefinitionError("an agent needs a non-empty name")
        self.name = name
        self.version = str(version)
        self.description = description
        self.schema = schema
        self.input_schema = input_schema
        self.invariants = tuple(invariants)
        self._initial_state = initial_state
        self.schema_version = int(schema_version)
        self.upgrades = dict(upgrades or {})
        self.transient = tuple(transient)
        self.max_retries = max_retries
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.step_timeout = step_timeout
        if durability not in DURABILITY_LEVELS:
            raise AgentDefinitionError(
                f"agent {name}: durability must be one of {', '.join(DURABILITY_LEVELS)},"
                f" not {durability!r}"
            )
        self.durability = durability
        # The periodic level: a checkpoint every ``periodic_steps`` steps or
        # ``periodic_seconds`` seconds, the steps between kept in memory.
        if periodic_steps < 1 or periodic_seconds <= 0:
            raise AgentDefinitionError(f"agent {name}: periodic_steps and _seconds must be > 0")
        self.periodic_steps = periodic_steps
        self.periodic_seconds = periodic_seconds
        # Older versions whose checkpoints this one may continue as they are (same state
        # shape, other code); other versions need a schema upgrade.
        self.compatible_versions = frozenset(str(v) for v in compatible_versions)
        self.package_names = tuple(packages)
        # At most this many runs of the agent execute at once, across all workers.
        if max_concurrent is not None and max_concurrent < 1:
            raise AgentDefinitionError(f"agent {name}: max_concurrent must be at least 1")
        self.max_concurrent = max_concurrent
        # Call key -> rate-limited resource (see durability.limits).
        self.limits = dict(limits or {})
        # Retention: finished runs are deleted ``keep_days`` after they end (never: None);
        # with keep_checkpoints="snapshots", a finished run's checkpoints older than
        # ``compact_after_days`` are folded into snapshots.
        if keep_checkpoints not in ("all", "snapshots"):
            raise AgentDefinitionError(
                f"agent {name}: keep_checkpoints must be 'all' or 'snapshots'"
            )
        self.keep_days = keep_days
        self.keep_checkpoints = keep_checkpoints
        self.compact_after_days = compact_after_days
        self._fingerprint: tuple[str, str] | None = None
        self.steps: dict[str, StepFn] = {}
        self.order: list[str] = []
        self.pipeline = False
        self.start = start
        if isinstance(steps, Mapping):
            for step_name, fn in steps.items():
                self._add(step_name, fn)
        elif steps is not None:
            self.pipeline = True
            for fn in steps:
                self._add(fn.__name__, fn)
        for version_from in self.upgrades:
            if not 1 <= version_from < self.schema_version:
                raise AgentDefinitionError(
                    f"agent {name}: upgrade from schema version {version_from} does not lead"
                    f" to {self.schema_version}"
                )
        self._validators = _build_validators(schema)
        self._input_validators = _build_validators(input_schema)
        if register:
            registry.register(self)

    # --- definition -------------------------------------------------------------------------

    def _add(self, step_name: str, fn: StepFn) -> None:
        if step_name in self.steps:
            raise AgentDefinitionError(f"agent {self.name}: two steps named {step_name!r}")
        if step_name == END:
            raise AgentDefinitionError(f"agent {self.name}: {END!r} is reserved")
        self.steps[step_name] = fn
        self.order.append(step_name)

    def step(self, fn: StepFn | None = None, *, name: str | None = None, start: bool = False):
        """Decorator adding a step; ``start=True`` marks the first one (default: the first
        step added)."""

        def add(f: StepFn) -> StepFn:
            step_name = name or f.__name__
            self._add(step_name, f)
            if start:
                self.start = step_name
            return f

        return add(fn) if fn is not None else add

    @property
    def first_step(self) -> str:
        if self.start:
            if self.start not in self.steps:
                raise AgentDefinitionError(f"agent {self.name}: no step named {self.start!r}")
            return self.start
        if not self.order:
            raise AgentDefinitionError(f"agent {self.name} has no steps")
        return self.order[0]

    def successor(self, step_name: str, returned: Any) -> str:
        """The step after ``step_name`` given what it returned ("" ends the run)."""
        if returned is None:
            if self.pipeline:
                i = self.order.index(step_name)
                return self.order[i + 1] if i + 1 < len(self.order) else ""
            return ""
        if returned == END or isinstance(returned, Ending):
            return ""
        if not isinstance(returned, str) or returned not in self.steps:
            known = ", ".join(self.order)
            raise AgentDefinitionError(
                f"step {step_name!r} of agent {self.name} returned {returned!r}, which is not"
                f" a step (known: {known}), None or END"
            )
        return returned

    # --- state ------------------------------------------------------------------------------

    def initial_state(self, input: Any) -> dict:
        self.validate_input(input)
        if self._initial_state is not None:
            try:
                state = self._initial_state(input)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
                # The agent's code could not make a state of this input: bad input, which
                # gets a clear error and starts nothing (never a crash of the caller).
                raise SchemaViolation(
                    f"agent {self.name}: initial_state() refused the input"
                    f" ({type(exc).__name__}: {exc})"
                ) from None
        elif isinstance(input, dict):
            state = dict(input)
        else:
            state = {"input": input}
        if not isinstance(state, dict):
            raise SchemaViolation(
                f"agent {self.name}: initial_state() returned {type(state).__name__},"
                " not a JSON object"
            )
        return state

    def validate_input(self, input: Any) -> None:
        _run_validators(self._input_validators, input, f"input of agent {self.name}")

    def validate(self, state: Any) -> None:
        """Raise ``SchemaViolation`` unless ``state`` satisfies the schema and invariants."""
        if not isinstance(state, dict):
            raise SchemaViolation(
                f"state of agent {self.name} must be a JSON object, not {type(state).__name__}"
            )
        _run_validators(self._validators, state, f"state of agent {self.name}")
        for check in self.invariants:
            problem = check(state)
            if problem:
                raise SchemaViolation(f"state of agent {self.name} breaks an invariant: {problem}")

    def upgrade(self, state: dict, from_version: int) -> dict:
        """Bring a state written under an older schema version up to this one."""
        if from_version > self.schema_version:
            raise SchemaViolation(
                f"state has schema version {from_version}, newer than agent {self.name}"
                f"@{self.version} knows ({self.schema_version}); deploy the newer code"
            )
        version = from_version
        while version < self.schema_version:
            step_up = self.upgrades.get(version)
            if step_up is None:
                raise SchemaViolation(
                    f"agent {self.name} has no upgrade from schema version {version}"
                    f" to {version + 1}"
                )
            state = step_up(state)
            version += 1
        return state

    # --- what wrote a checkpoint -------------------------------------------------------------

    def fingerprint(self) -> tuple[str, str]:
        """``(config hash, packages JSON)``: a hash of the definition (steps, schema,
        policies) and the installed versions of the declared packages."""
        if self._fingerprint is None:
            import hashlib
            import importlib.metadata

            import orjson

            schema = self.schema
            if schema is not None and not isinstance(schema, Mapping):
                schema = schema.model_json_schema()
            definition = {
                "name": self.name,
                "version": self.version,
                "steps": self.order,
                "start": self.first_step if self.order else "",
                "pipeline": self.pipeline,
                "schema": schema,
                "schema_version": self.schema_version,
                "durability": self.durability,
                "retry": [self.max_retries, self.retry_base, self.retry_cap],
                "step_timeout": self.step_timeout,
            }
            packages = {}
            for name in sorted(self.package_names):
                try:
                    packages[name] = importlib.metadata.version(name)
                except importlib.metadata.PackageNotFoundError:
                    packages[name] = "missing"
            # 64 bits tell one definition from another; a checkpoint row carries it every step.
            digest = hashlib.sha256(
                orjson.dumps(definition, option=orjson.OPT_SORT_KEYS, default=str)
            ).hexdigest()[:16]
            self._fingerprint = (digest, orjson.dumps(packages).decode() if packages else "")
        return self._fingerprint

    def can_continue(self, agent_version: str, schema_version: int) -> bool:
        """Whether this definition may continue a checkpoint another version wrote: the same
        version, one declared compatible, or an older schema it can upgrade."""
        if agent_version == self.version or agent_version in self.compatible_versions:
            return True
        if schema_version < self.schema_version:
            return all(v in self.upgrades for v in range(schema_version, self.schema_version))
        return False

    # --- retries ----------------------------------------------------------------------------

    def backoff(self, retries: int, retry_after: float | None = None) -> float:
        """Exponential backoff with "equal jitter": half fixed, half random, so that many
        runs failing together do not retry together."""
        ceiling = min(self.retry_cap, self.retry_base * (2**retries))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        if retry_after is not None:
            delay = max(delay, float(retry_after))
        return delay

    def is_transient(self, exc: BaseException) -> bool:
        from durability.errors import Transient

        if isinstance(exc, Transient):
            return True
        return bool(self.transient) and isinstance(exc, self.transient)

    def __repr__(self) -> str:
        return f"<Agent {self.name}@{self.version}>"


def _build_validators(schema: Any) -> list[Callable[[Any], None]]:
    if schema is None:
        return []
    try:
        from pydantic import BaseModel, ValidationError
    except ImportError:  # pragma: no cover - pydantic is a dependency
        BaseModel = None  # noqa: N806
    if BaseModel is not None and isinstance(schema, type) and issubclass(schema, BaseModel):

        def check_model(value: Any) -> None:
            try:
                schema.model_validate(value)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'/'.join(str(p) for p in err['loc']) or '/'}: {err['msg']}"
                    for err in exc.errors()[:5]
                )
                raise ValueError(problems) from None

        return [check_model]
    if isinstance(schema, Mapping):
        import jsonschema

        validator_cls = jsonschema.validators.validator_for(schema)
        try:
            validator_cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise AgentDefinitionError(f"invalid JSON Schema: {exc.message}") from None
        validator = validator_cls(schema)

        def check_json_schema(value: Any) -> None:
            errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
            if errors:
                raise ValueError(
                    "; ".join(
                        f"/{'/'.join(str(p) for p in e.path)}: {e.message}" for e in errors[:5]
                    )
                )

        return [check_json_schema]
    raise AgentDefinitionError("schema must be a pydantic model class or a JSON Schema dict")


def _run_validators(validators: list, value: Any, what: str) -> None:
    for check in validators:
        try:
            check(value)
        except ValueError as exc:
            raise SchemaViolation(f"{what} fails the schema: {exc}") from None


class Registry:
    def __init__(self) -> None:
        self._agents: dict[str, Agent] = {}
        self._discovered = False

    def register(self, agent: Agent) -> None:
        self._agents[agent.name] = agent

    def unregister(self, name: str) -> None:
        self._agents.pop(name, None)

    def get(self, name: str) -> Agent:
        self.discover()
        try:
            return self._agents[name]
        except KeyError:
            known = ", ".join(sorted(self._agents)) or "none"
            raise UnknownAgent(f"unknown agent {name!r} (registered: {known})") from None

    def all(self) -> list[Agent]:
        self.discover()
        return [self._agents[k] for k in sorted(self._agents)]

    def discover(self, modules: Iterable[str] | None = None) -> None:
        """Import the modules named in ``DURABILITY_AGENT_MODULES`` once."""
        if self._discovered and modules is None:
            return
        if modules is None:
            from django.conf import settings

            modules = getattr(settings, "DURABILITY_AGENT_MODULES", [])
            self._discovered = True
        for module in modules:
            importlib.import_module(module)


registry = Registry()
