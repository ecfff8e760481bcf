"""Defining agents: a name, a version, a state schema and steps.

Each step is a plain function ``(state, ctx) -> next step name | None``. Given as a list,
the steps form a pipeline: returning ``None`` moves to the next one and the last one ends the
run. Given with the ``@agent.step`` decorator, returning ``None`` ends the run. Returning
``END`` ends it from anywhere; ``END("declined")`` also names how it ended (its outcome,
shown beside its status), as does ``ctx.outcome("declined")`` in the step that ends it.

What the agent is (name, version, steps, schema and its versions) are keywords of their own;
how it is run is grouped in small frozen policy objects (durability.policies), after
Temporal's ``RetryPolicy``: ``retry=RetryPolicy(...)``, ``durability=`` a level's name or a
``DurabilityPolicy``, ``limits=Limits(...)``, ``retention=Retention(...)``. An agent that
needs none names none: ``Agent("echo", steps=[echo])``. The policies are the one spelling,
not flat keywords beside them: there is nothing to reconcile when both are given, each policy
is checked, named in its errors and shared between agents as one value, and ``__init__``
stays short. The old flat keywords are refused with the spelling that replaced them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from durability.conf import conf
from durability.errors import AgentDefinitionError, SchemaViolation, UnknownAgent
from durability.policies import (
    DurabilityPolicy,
    Limits,
    Retention,
    RetryPolicy,
    policy,
)

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

StepFn = Callable[[dict, Any], "str | None"]
Upgrade = Callable[[dict], dict]


# The options that became policies, and where each went: an agent written against the flat
# keywords is told what to write instead of only "unexpected keyword argument".
_MOVED = {
    "max_retries": "retry=RetryPolicy(max_retries=...)",
    "retry_base": "retry=RetryPolicy(base=...)",
    "retry_cap": "retry=RetryPolicy(cap=...)",
    "transient": "retry=RetryPolicy(transient=(...))",
    "periodic_steps": 'durability=DurabilityPolicy("periodic", every_steps=...)',
    "periodic_seconds": 'durability=DurabilityPolicy("periodic", every_seconds=...)',
    "max_concurrent": "limits=Limits(max_concurrent=...)",
    "keep_days": "retention=Retention(keep_days=...)",
    "keep_checkpoints": "retention=Retention(keep_checkpoints=...)",
    "compact_after_days": "retention=Retention(compact_after_days=...)",
}


def _refuse_options(name: str, options: Mapping[str, Any]) -> None:
    for option in options:
        instead = _MOVED.get(option)
        raise AgentDefinitionError(
            f"agent {name}: {option}= is now {instead}"
            if instead
            else f"agent {name}: unknown option {option}="
        )


class Agent:
    """An agent definition. Creating one registers it under its name; its run options are
    the policies of durability.policies (see the module's docstring)."""

    # Durability levels its runs may not be started with, and why (a run's own level given
    # at its start included): none for a native agent.
    refused_levels: Mapping[str, str] = {}

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
        compatible_versions: Iterable[str | int] = (),
        step_timeout: float | None = None,
        retry: RetryPolicy | None = None,
        durability: str | DurabilityPolicy = "strict",
        limits: Limits | None = None,
        retention: Retention | None = None,
        packages: Iterable[str] = (),
        description: str = "",
        register: bool = True,
        **moved: Any,
    ) -> None:
        if not name or not isinstance(name, str):
            raise AgentDefinitionError("an agent needs a non-empty name")
        _refuse_options(name, moved)
        self.name = name
        self.version = str(version)
        self.description = description
        self.schema = schema
        self.input_schema = input_schema
        self.invariants = tuple(invariants)
        self._initial_state = initial_state
        self.schema_version = int(schema_version)
        self.upgrades = dict(upgrades or {})
        # Older versions whose checkpoints this one may continue as they are (same state
        # shape, other code); other versions need a schema upgrade.
        self.compatible_versions = frozenset(str(v) for v in compatible_versions)
        self.package_names = tuple(packages)
        self.step_timeout = step_timeout
        try:
            self.retry = policy("retry", retry, RetryPolicy)
            self.durability_policy = policy("durability", durability, DurabilityPolicy, str)
            # limits.get(call key) -> rate-limited resource (see durability.limits).
            self.limits = policy("limits", limits, Limits)
            self.retention = policy("retention", retention, Retention)
        except AgentDefinitionError as exc:
            raise AgentDefinitionError(f"agent {name}: {exc.message}") from None
        self._fingerprint: tuple[str, str] | None = None
        self.steps: dict[str, StepFn] = {}
        self.order: list[str] = []
        self.pipeline = False
        self.start = start
        self._add_steps(steps)
        self._check_upgrades()
        self._validators = _build_validators(schema)
        self._input_validators = _build_validators(input_schema)
        if register:
            registry.register(self)

    # --- definition -------------------------------------------------------------------------

    def _add_steps(self, steps: Sequence[StepFn] | Mapping[str, StepFn] | None) -> None:
        if isinstance(steps, Mapping):
            for step_name, fn in steps.items():
                self._add(step_name, fn)
        elif steps is not None:
            self.pipeline = True
            for fn in steps:
                self._add(fn.__name__, fn)

    def _check_upgrades(self) -> None:
        for version_from in self.upgrades:
            if not 1 <= version_from < self.schema_version:
                raise AgentDefinitionError(
                    f"agent {self.name}: upgrade from schema version {version_from} does not"
                    f" lead to {self.schema_version}"
                )

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

    def validate_edit(self, state: Any) -> None:
        """An operator's edited state (a fork's): the checks every step's state passes. An
        agent whose state holds more than its schema says (a graph's encoded values) checks
        here, once per edit, what would be too costly at every step."""
        self.validate(state)

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

    # --- the policies' values, as the engine reads them --------------------------------------

    @property
    def durability(self) -> str:
        return self.durability_policy.level

    @property
    def periodic_steps(self) -> int:
        return self.durability_policy.every_steps

    @property
    def periodic_seconds(self) -> float:
        return self.durability_policy.every_seconds

    @property
    def max_retries(self) -> int:
        return self.retry.max_retries

    @property
    def retry_base(self) -> float:
        return self.retry.base

    @property
    def retry_cap(self) -> float:
        return self.retry.cap

    @property
    def transient(self) -> tuple[type[BaseException], ...]:
        return self.retry.transient

    @property
    def max_concurrent(self) -> int | None:
        return self.limits.max_concurrent

    @property
    def keep_days(self) -> float | None:
        return self.retention.keep_days

    @property
    def keep_checkpoints(self) -> str:
        return self.retention.keep_checkpoints

    @property
    def compact_after_days(self) -> float:
        return self.retention.compact_after_days

    def backoff(self, retries: int, retry_after: float | None = None) -> float:
        return self.retry.backoff(retries, retry_after)

    def is_transient(self, exc: BaseException) -> bool:
        return self.retry.is_transient(exc)

    def __repr__(self) -> str:
        return f"<Agent {self.name}@{self.version}>"


def _build_validators(schema: Any) -> list[Callable[[Any], None]]:
    if schema is None:
        return []
    from pydantic import BaseModel, ValidationError

    if isinstance(schema, type) and issubclass(schema, BaseModel):

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
            modules = conf.AGENT_MODULES
            self._discovered = True
        for module in modules:
            importlib.import_module(module)


registry = Registry()
